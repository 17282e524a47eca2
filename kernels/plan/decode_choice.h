// Which decode kernel the CUDA backend's decode planner may use (issue 14): its own per-step
// choice (DecodeKernelChoice::kAuto), or one forced for measurements by attnd's --decode_kernel
// flag (auto|cuda_core|tensor_core; default auto; when the flag is not given, the environment
// variable ATTND_DECODE_KERNEL, read by main.cc only), applied to each cache when it is created.
// A forced kernel the cache has no kernel of (fp8 or group 16 on CUDA cores, fp8 or groups below
// 4 on tensor cores) leaves that cache on the planner's choice. Plain C++ (no CUDA).
#pragma once

#include <string_view>

#include "absl/status/statusor.h"
#include "plan/decode_plan.h"

namespace attnd::plan {

// "auto", "cuda_core", "tensor_core"; INVALID_ARGUMENT otherwise (the message names the value).
absl::StatusOr<DecodeKernelChoice> ParseDecodeKernelChoice(std::string_view name);
// ATTND_DECODE_KERNEL, or kAuto when unset or empty: the fallback of attnd's --decode_kernel
// flag (main.cc) and of the GPU tests' backends; nothing else reads the environment.
absl::StatusOr<DecodeKernelChoice> DecodeKernelChoiceFromEnvironment();

// `requested`, or kAuto when it names a kernel the cache lacks.
DecodeKernelChoice EffectiveDecodeKernelChoice(DecodeKernelChoice requested,
                                               bool cuda_core_supported,
                                               bool tensor_core_supported);

}  // namespace attnd::plan
