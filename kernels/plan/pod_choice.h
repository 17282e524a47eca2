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
// Hopper (wgmma) prefill kernel is much faster than mma.sync.
//   - page size 1: fused / back to back 0.72-0.78 and fused / one merged prefill 0.78-0.91 on
//     all five reference cases (the Hopper prefill gains nothing there: 0.81 vs 0.80 ms);
//   - page size 16 with the Hopper prefill: fused / back to back 0.94-1.13 (slower on 3 of 5),
//     and 1.09x the separate kernels' time on the e2e mixed step (512 prefill + 128 decodes);
//   - page size 16 against back to back with the mma.sync prefill (what runs where the Hopper
//     kernel does not: no sm_90a, head_dim 256, mixed dtypes): fused 0.84-0.91.
// So: POD when the separate prefill would not be the Hopper kernel, or the page size is 1.
// Page sizes 2 to 8 with the Hopper kernel were not measured and keep the separate kernels.
bool PodAutoPicks(const PodStepShape& shape);

// Whether a step of `shape` runs POD under `mode`: only mixed steps (>= 1 prefill and >= 1
// decode request), never deterministic ones; then on: yes, off: no, auto: PodAutoPicks.
bool ChoosePod(PodMode mode, const PodStepShape& shape);

}  // namespace attnd::plan
