// Host planning of POD attention (DESIGN 4.5): prefill and decode CTAs of a mixed batch in one
// grid. Plain C++, built once per step, testable without a GPU.
//
// A POD plan is a batch prefill plan over every request (plan::PlanPrefill, mma.sync kernel
// only) in which two launches fuse into one grid: the launch of the largest query tile (the
// prefill role: compute-bound tiles of 128 rows, or 64) and the 16-row launch (the decode role:
// one token per request, its GQA group's rows stacked into the MMA's M dimension, memory-bound).
// Any other launch (a 64-row launch beside a 128-row one) runs on its own before the fused one.
// Both roles write their split requests' fp32 partials into the plan's one partial space, merged
// once at the end (MergeStates).
//
// The prefill role's split is told how many decode CTAs share its wave
// (PrefillPlanInput::num_colocated_ctas) and sized against the fused kernel's residency, so it
// cuts keys into fewer chunks. Under deterministic=true neither applies: the plan is exactly the
// mma.sync prefill plan of the batch (a request's chunk follows from the request alone), so a
// request's bits are those of the separate mma.sync launches, never depend on the rest of the
// batch, and never on which role an SM ran first (a block's arithmetic ignores its role).
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "plan/pod_schedule.h"  // PodTakesPrefillRole, the kernel's role rule
#include "plan/prefill_plan.h"

namespace attnd::plan {

struct PodPlan {
  PrefillPlan prefill;          // every request; launches are mma.sync
  int32_t prefill_launch = -1;  // index into prefill.launches: the prefill role; -1: not fused
  int32_t decode_launch = -1;   // index into prefill.launches: the 16-row decode role
  int32_t num_colocated_ctas = 0;  // decode CTAs the prefill split was told about

  bool fused() const { return prefill_launch >= 0 && decode_launch >= 0; }
  int32_t prefill_tile_rows() const { return fused() ? prefill.launches[prefill_launch].tile_rows : 0; }
  int64_t PrefillRoleCtas() const;  // items x KV heads of the prefill role
  int64_t DecodeRoleCtas() const;   // items x KV heads of the decode role
  std::string DebugString() const;
};

// Resident CTAs of the fused kernel per SM, times SMs (cuda::PodCtasPerWave): it holds the
// shared memory of the larger role and the registers of both, so it fits fewer CTAs than
// either kernel alone. 0: use the prefill tiles' own waves.
struct PodWaveSizes {
  int32_t tile64 = 0;   // prefill role of 64 rows
  int32_t tile128 = 0;  // prefill role of 128 rows
};

// Plans `input` for POD. The kernel is forced to mma.sync (input.kernel is ignored; the Hopper
// kernel has no decode role). The result is fused when the batch has both a 16-row launch and
// a larger one; otherwise it is an ordinary mma.sync prefill plan (fused() false) that
// cuda::PodAttention runs as separate launches.
absl::StatusOr<PodPlan> PlanPod(PrefillPlanInput input, const PodWaveSizes& pod_waves = {});

}  // namespace attnd::plan
