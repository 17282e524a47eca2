// POD attention on the GPU (DESIGN 4.5): a mixed batch's prefill and decode rows in one grid.
//
// Use, once per cache: waves = PodCtasPerWave(head_dim, q_dtype, kv_dtype) (plus
//                      BatchPrefillCtasPerWave for the plan input's ctas_per_wave);
//      once per step:  plan = plan::PlanPod(input, waves) on the host;
//                      bytes = PodWorkspaceBytes(plan) (a reused device buffer, one per stream);
//                      UploadPodPlan(plan, workspace, bytes, stream);
//      once per layer: PodAttention(plan, args, workspace, bytes, stream).
// PodAttention zeroes the scheduler's counters in the workspace on the stream (cudaMemsetAsync)
// before the fused launch, so a workspace serves one stream at a time: two streams need two.
// A plan that is not fused runs as ordinary mma.sync batch prefill launches. Split requests of
// either role write fp32 partials into the workspace; one MergeStates follows every launch.
// Nothing here allocates or synchronises.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "attnd/kernels/cuda/prefill.h"
#include "plan/pod_plan.h"

namespace attnd::cuda {

// Resident CTAs of the fused kernel per SM times SMs, per prefill-role tile, for PlanPod.
absl::StatusOr<plan::PodWaveSizes> PodCtasPerWave(int32_t head_dim, DType q_dtype, DType kv_dtype);

// The batch prefill workspace of plan.prefill, then the scheduler's counters (256-aligned).
int64_t PodWorkspaceBytes(const plan::PodPlan& plan);

// Copies the plan's work list and merge rows (UploadBatchPrefillPlan) into `workspace`.
absl::Status UploadPodPlan(const plan::PodPlan& plan, void* workspace, int64_t workspace_bytes,
                           cudaStream_t stream);

// Launches the plan on `stream`: the launches outside the fusion, then the fused grid, then the
// merge. Arguments as BatchPrefill's (same checks, same errors).
absl::Status PodAttention(const plan::PodPlan& plan, const BatchPrefillArgs& args, void* workspace,
                          int64_t workspace_bytes, cudaStream_t stream);

}  // namespace attnd::cuda
