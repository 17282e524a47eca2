// Batch prefill attention on the GPU (DESIGN 4.3): ragged queries against the paged KV cache,
// on tensor cores. Chunked prefill (new tokens of a sequence that already has KV) is the same
// call: a request's q rows are its last q_len positions.
//
// Use, once per cache: waves = BatchPrefillCtasPerWave(head_dim, q_dtype, kv_dtype);
//      once per step:  plan = plan::PlanPrefill({..., .ctas_per_wave = waves}) on the host;
//                      bytes = BatchPrefillWorkspaceBytes(plan); (a reused device buffer)
//                      UploadBatchPrefillPlan(plan, workspace, bytes, stream);
//      once per layer: BatchPrefill(plan, args, workspace, bytes, stream).
// A plan that splits KV (plan.split_kv()) runs the prefill kernels into fp32 partials in the
// workspace, then MergeStates (merge.h) writes the split requests' rows of o and lse.
// Two kernels: mma.sync (every config) and, on compute capability 9.0 with a build that includes
// sm_90a, a warp-specialised wgmma kernel for 128-row tiles of 16-bit q and KV of one type,
// head_dim 64/128; the plan names the kernel of each launch (plan::PrefillKernel).
// Every pointer in BatchPrefillArgs is device memory; the caller keeps it alive until the stream
// has passed the launch. Nothing here allocates or synchronises.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "attnd/kernels/attention_params.h"
#include "attnd/kernels/views.h"
#include "plan/prefill_plan.h"

namespace attnd::cuda {

struct BatchPrefillArgs {
  TokenHeadsView q;                    // [T_q][num_qo_heads][head_dim], fp16 or bf16, rotated
  const int32_t* qo_indptr = nullptr;  // [batch_size + 1], the plan's qo_indptr, on the device
  PageTableView pages;                 // device arrays; SHARED (v == k ids) or SEPARATE_KV
  PagedKvView k_cache;                 // fp16, bf16 or fp8_e4m3; NHD or HND
  PagedKvView v_cache;                 // same geometry and dtype as k_cache
  AttentionParams params;              // sm_scale > 0 resolved; k/v scales dequantise fp8
  TokenHeadsView o;                    // [T_q][num_qo_heads][head_dim], q's dtype; fully
                                       // masked rows get 0
  float* lse = nullptr;                // [T_q][num_qo_heads] natural log, -inf when fully
                                       // masked; optional
  // > 0: the plan's Hopper launches run persistent over at most this many CTAs (a mixed step's
  // prefill beside its decode, plan::StepPlan::side_by_side_prefill_ctas); 0: the plan's grid.
  // A work item's result does not depend on the grid.
  int32_t max_persistent_ctas = 0;
  // The Hopper kernel's CTAs take works on demand, in the plan's order, from a counter in the
  // workspace (UploadBatchPrefillPlan zeroes it; each launch leaves it zero), rather than each
  // from its fixed place in the layout: a CTA that finishes early takes more. The same bits
  // either way (every work runs the same code wherever it lands).
  bool works_on_demand = false;
  // With works_on_demand, > 0: a second grid of (up to) this many CTAs shares each Hopper
  // launch's works, launched by BatchPrefillTail on a stream of its own (beside a decode: where
  // the decode ends, its SMs join the prefill). BatchPrefill then leaves the merge of split
  // works to MergeBatchPrefill, to be enqueued once both grids are done.
  int32_t tail_ctas = 0;
  // false: the Hopper kernel drains its tile loop after every work even where the plan's launch
  // has short works (plan::PrefillLaunch::short_works); the same bits either way (tests compare).
  bool pipeline_short_works = true;
};

// CTAs of each query tile's kernel the current device runs at once (resident CTAs per SM x
// SMs), for plan::PrefillPlanInput::ctas_per_wave; hopper_tile128 > 0 when the Hopper kernel
// runs here for these dtypes. Fixed per device and dtypes: query it once.
absl::StatusOr<plan::PrefillWaveSizes> BatchPrefillCtasPerWave(int32_t head_dim, DType q_dtype, DType kv_dtype);

// Device workspace bytes the plan needs: its work list, merge rows and, when it splits KV, the
// fp32 partials ([num_partials][num_qo_heads][head_dim] plus lse). 256-byte aligned sections.
int64_t BatchPrefillWorkspaceBytes(const plan::PrefillPlan& plan);

// Copies the plan's work list and merge rows into `workspace` on `stream`. The copy is from
// pageable memory, which CUDA stages before returning, so the plan may change or die after.
absl::Status UploadBatchPrefillPlan(const plan::PrefillPlan& plan, void* workspace,
                                    int64_t workspace_bytes, cudaStream_t stream);

// Launches the plan's kernels (one per query tile size) on `stream`. Validates shapes, dtypes
// and the workspace (INVALID_ARGUMENT / UNIMPLEMENTED) and reports launch failures (INTERNAL);
// page ids and lengths in device memory are trusted (validated when the engine built them).
absl::Status BatchPrefill(const plan::PrefillPlan& plan, const BatchPrefillArgs& args,
                          void* workspace, int64_t workspace_bytes, cudaStream_t stream);

// With args.works_on_demand and args.tail_ctas > 0: the second grid of each Hopper launch of
// BatchPrefill's (same plan, args and workspace), on `stream`; it takes the works that are left
// when its CTAs start. Nothing else runs here.
absl::Status BatchPrefillTail(const plan::PrefillPlan& plan, const BatchPrefillArgs& args,
                              void* workspace, int64_t workspace_bytes, cudaStream_t stream);

// The merge of split works BatchPrefill leaves when a tail grid shares its works
// (args.works_on_demand and args.tail_ctas > 0), on `stream`, after both grids; nothing
// otherwise (BatchPrefill merged) or when the plan does not split KV.
absl::Status MergeBatchPrefill(const plan::PrefillPlan& plan, const BatchPrefillArgs& args,
                               void* workspace, int64_t workspace_bytes, cudaStream_t stream);

}  // namespace attnd::cuda
