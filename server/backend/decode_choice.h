// Which decode kernel the CUDA backend's decode planner may use (issue 14): its own per-step
// choice (plan::DecodeKernelChoice::kAuto), or one forced for measurements by the environment
// variable ATTND_DECODE_KERNEL (auto|cuda_core|tensor_core; unset: auto), read once per cache
// when it is created. A forced kernel the cache has no kernel of (fp8 or group 16 on CUDA cores,
// fp8 or groups below 4 on tensor cores) leaves that cache on the planner's choice. Plain C++.
#pragma once

#include <string_view>

#include "absl/status/statusor.h"
#include "plan/decode_plan.h"

namespace attnd::cuda_backend {

// "auto", "cuda_core", "tensor_core"; INVALID_ARGUMENT otherwise (the message names the value).
absl::StatusOr<plan::DecodeKernelChoice> ParseDecodeKernelChoice(std::string_view name);
// ATTND_DECODE_KERNEL, or kAuto when unset or empty.
absl::StatusOr<plan::DecodeKernelChoice> DecodeKernelChoiceFromEnvironment();

// `requested`, or kAuto when it names a kernel the cache lacks.
plan::DecodeKernelChoice EffectiveDecodeKernelChoice(plan::DecodeKernelChoice requested,
                                                     bool cuda_core_supported,
                                                     bool tensor_core_supported);

}  // namespace attnd::cuda_backend
