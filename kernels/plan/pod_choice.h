// When the CUDA backend runs a mixed step (prefill and decode rows) as one POD launch (DESIGN
// 4.5, kernels/include/attnd/kernels/cuda/pod.h) instead of the decode kernel then the prefill
// kernel. Plain C++ (no CUDA), so the rule is unit-tested anywhere; step_plan.h applies it.
//
// The mode is CudaBackendOptions::pod_mode, set from attnd's --pod flag (auto|on|off; default
// auto; when the flag is not given, the environment variable ATTND_POD, read by main.cc only):
//   off:  never POD.
//   on:   POD for every mixed step that is not deterministic (tests, measurements).
//   auto: the rule below (PodAutoPicks).
// Deterministic steps never run POD: a decode request's bits must not depend on whether prefill
// rows share its step, and the decode kernel (CUDA cores) and POD's 16-row tensor-core tile
// reduce in different orders.
#pragma once

#include <cstdint>
#include <string_view>

#include "absl/status/statusor.h"
#include "attnd/kernels/step_batch.h"

namespace attnd::plan {

enum class PodMode { kAuto, kOn, kOff };

// "auto", "on", "off"; INVALID_ARGUMENT otherwise (the message names the value).
absl::StatusOr<PodMode> ParsePodMode(std::string_view name);
// ATTND_POD, or kAuto when unset or empty: the fallback of attnd's --pod flag (main.cc) and of
// the GPU tests' backends; nothing else reads the environment.
absl::StatusOr<PodMode> PodModeFromEnvironment();

// What the rule sees of a step.
struct PodStepShape {
  int32_t num_prefill_requests = 0;  // entries of more than one row
  int32_t num_decode_requests = 0;   // entries of exactly one row
  int64_t num_prefill_rows = 0;      // rows of the prefill entries
  int32_t page_size = 0;             // the cache's tokens per page
  bool hopper_prefill = false;       // the separate path's prefill would run the Hopper kernel
  bool deterministic = false;
};

// What the POD rule sees of `batch` on a cache of `page_size` whose separate prefill would run
// the Hopper kernel when `hopper_prefill`.
PodStepShape PodShapeOf(const StepBatch& batch, int32_t page_size, bool hopper_prefill);

// The auto rule, from bench/pod_bench on an H100 (docs/benchmarks.md, POD): POD's prefill role
// runs the mma.sync tiles, so it wins where the separate prefill would too, and loses where the
// Hopper (wgmma) prefill kernel runs.
//   - 2026-11-28, the separate path's decode on tensor cores (as the planner picks it): fused /
//     back to back with the Hopper prefill 1.08-1.24 at page size 1 and 1.10-1.28 at page size
//     16 (POD lost everywhere); against back to back with the mma.sync prefill (what runs where
//     the Hopper kernel does not: no sm_90a, head_dim 256, mixed dtypes) 0.95-0.99.
//   - (2026-11-22, before the tensor-core decode: fused / back to back 0.72-0.78 at page size 1,
//     0.94-1.13 at page size 16 with the Hopper prefill.)
// So: POD when the separate prefill would not be the Hopper kernel. Where it would, a mixed step
// runs the decode and the Hopper prefill side by side on two streams instead (step_plan.h).
bool PodAutoPicks(const PodStepShape& shape);

// Whether a step of `shape` runs POD under `mode`: only mixed steps (>= 1 prefill and >= 1
// decode request), never deterministic ones; then on: yes, off: no, auto: PodAutoPicks.
bool ChoosePod(PodMode mode, const PodStepShape& shape);

}  // namespace attnd::plan
