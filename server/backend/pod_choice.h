// When the CUDA backend runs a mixed step (prefill and decode rows) as one POD launch (DESIGN
// 4.5, kernels/include/attnd/kernels/cuda/pod.h) instead of the decode kernel then the prefill
// kernel. Plain C++ (no CUDA), so the rule is unit-tested anywhere.
//
// The mode comes from the environment variable ATTND_POD (auto|on|off; unset: auto), read once
// per cache when it is created:
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

namespace attnd::cuda_backend {

enum class PodMode { kAuto, kOn, kOff };

// "auto", "on", "off"; INVALID_ARGUMENT otherwise (the message names the value).
absl::StatusOr<PodMode> ParsePodMode(std::string_view name);
// ATTND_POD, or kAuto when unset or empty.
absl::StatusOr<PodMode> PodModeFromEnvironment();

// What the rule sees of a step.
struct PodStepShape {
  int32_t num_prefill_requests = 0;  // entries of more than one row
  int32_t num_decode_requests = 0;   // entries of exactly one row
  int64_t num_prefill_rows = 0;      // rows of the prefill entries
  bool deterministic = false;
};

// The form of the auto rule: POD when the step has at least `min_decode_requests` decode
// requests (enough memory-bound work to hide under the prefill) and at most
// `max_prefill_rows` prefill rows (beyond that the prefill dominates, and POD's mma.sync prefill
// tiles lose to the separate Hopper prefill kernel). min_decode_requests 0 disables it.
bool PodAutoRule(const PodStepShape& shape, int32_t min_decode_requests, int64_t max_prefill_rows);

// The thresholds auto uses. PLACEHOLDER until measured: 0 (POD off), so auto behaves as off until
// they are set from bench/pod_bench's table on an H100 (fused vs back to back per reference case
// and page size: the smallest decode count and the largest prefill at which fused wins).
inline constexpr int32_t kPodAutoMinDecodeRequests = 0;
inline constexpr int64_t kPodAutoMaxPrefillRows = 0;

// PodAutoRule with the thresholds above. Only called for mixed, non-deterministic steps.
bool PodAutoPicks(const PodStepShape& shape);

// Whether a step of `shape` runs POD under `mode`: only mixed steps (>= 1 prefill and >= 1
// decode request), never deterministic ones; then on: yes, off: no, auto: PodAutoPicks.
bool ChoosePod(PodMode mode, const PodStepShape& shape);

}  // namespace attnd::cuda_backend
