// The step-level kernel choice of the CUDA backend, built once at PrepareStep: which attention
// kernels run for which rows (over the planners of this directory), and the layout of the one
// buffer of int32 arrays (page table, COO append index, decode plan) that is uploaded once and
// read by every layer. Plain C++ (no CUDA calls): tests/unit/plan drives it without a GPU.
//
// Kernel choice:
// - decode-only steps (every entry 1 row or padding): BatchDecode, when a decode kernel exists
//   for the cache's dtypes, head_dim and GQA group; otherwise BatchPrefill. The decode planner
//   picks its CUDA-core or tensor-core kernel per step (plan::DecodePlanOptions).
// - steps with prefill rows: BatchPrefill for the entries of more than one row, and, when a
//   decode kernel exists, BatchDecode for the 1-row entries of the same step (launches on one
//   stream, each writing its own rows of o and lse). Where POD is not picked, this is the split
//   that keeps a decode request's kernel, and so its bits under deterministic=true, the same
//   whether or not prefill rows share its step. Without a decode kernel BatchPrefill runs
//   every row (it takes 1-row requests).
// - mixed steps that pod_choice.h picks (--pod=on, or auto by its measured rule; never
//   deterministic ones): one POD launch over every row (cuda::PodAttention), kernel "pod".
// - MLA caches: MlaDecode for every row (its units carry any number of query tokens per
//   request, causal among them), in one launch. Requests of at most kMlaSplitMaxQueryTokens rows
//   (decode, speculative decode) are planned with KV-split (oversubscription, one wave, pinned or
//   deterministic, as the options say); longer ones (prefill, chunked prefill) are never split:
//   their row tiles already fill the GPU, and the partials of q_len x chunks rows would need a
//   workspace that grows with the prompt. Either way a request's chunking depends on the request
//   alone, so deterministic=true holds.
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "attnd/kernels/cache_geometry.h"
#include "attnd/kernels/step_batch.h"
#include "plan/buffer_alignment.h"
#include "plan/decode_plan.h"
#include "plan/mla_plan.h"
#include "plan/pod_choice.h"
#include "plan/pod_plan.h"
#include "plan/prefill_plan.h"

namespace attnd::plan {

struct StepPlanContext {
  const CacheGeometry* geometry = nullptr;
  bool decode_supported = false;  // some decode kernel exists for the cache (either below)
  // The CUDA-core kernel (attnd::cuda::DecodeSupports, DecodeCtasPerWave) and the tensor-core
  // one (TensorCoreDecodeSupports, TensorCoreDecodeCtasPerWave); the decode planner picks
  // between them per step (plan::DecodePlanOptions).
  bool decode_cuda_core_supported = true;
  int32_t decode_ctas_per_wave = 0;
  bool decode_tensor_core_supported = false;
  int32_t decode_tensor_core_ctas_per_wave = 0;
  // CudaBackendOptions::decode_kernel (decode_choice.h), already reduced to a kernel the cache has.
  DecodeKernelChoice decode_kernel_choice = DecodeKernelChoice::kAuto;
  PrefillWaveSizes prefill_ctas_per_wave;  // attnd::cuda::BatchPrefillCtasPerWave
  int32_t mla_ctas_per_wave = 0;  // attnd::cuda::MlaDecodeCtasPerWave (MLA caches)
  PodMode pod_mode = PodMode::kOff;  // pod_choice.h: when a mixed step runs POD
  PodWaveSizes pod_ctas_per_wave;    // attnd::cuda::PodCtasPerWave
};

// MLA requests with more query rows than this are planned without KV-split (see above).
inline constexpr int32_t kMlaSplitMaxQueryTokens = 4;

// Byte offsets of the arrays inside the uploaded buffer; each kBufferAlignment-aligned.
struct StepArrayOffsets {
  int64_t qo_indptr = 0;            // [batch_size + 1]
  int64_t page_indptr = 0;          // [batch_size + 1]
  int64_t k_page_indices = 0;       // [num_pages]
  int64_t v_page_indices = 0;       // [num_pages]; == k_page_indices when SHARED
  int64_t last_page_len = 0;        // [batch_size]
  int64_t token_batch_indices = 0;  // [num_tokens]
  int64_t token_positions = 0;      // [num_tokens]
  int64_t decode_work = 0;          // DecodePlan::Pack()
  int64_t mla_work = 0;             // MlaPlan::Pack() (16-byte aligned units)
  int64_t total_bytes = 0;
};

struct StepPlan {
  bool run_decode = false;   // BatchDecode for the decode rows
  bool run_prefill = false;  // BatchPrefill for the prefill rows (or every row)
  DecodePlan decode;         // q rows are the step's rows (remapped when mixed)
  PrefillPlan prefill;
  bool run_mla = false;       // MlaDecode for every row (MLA caches)
  bool mla_has_prefill = false;  // some MLA request has more than one row
  MlaPlan mla;                // units' q rows are the step's rows
  // POD (pod_choice.h): a mixed step whose decode and prefill rows run in one fused launch
  // (cuda::PodAttention over `pod`; run_decode and run_prefill are then false).
  bool run_pod = false;
  PodPlan pod;
  StepArrayOffsets offsets;

  // "none", "decode" or "prefill" (a step that runs both reports "prefill", its larger part);
  // "pod" for a fused mixed step;
  // MLA: "mla_decode", or "mla_prefill" when some request has more than one row (the names the
  // CPU backend reports).
  std::string_view KernelName() const;
  // Writes the arrays at their offsets into `buffer` (offsets.total_bytes bytes).
  void Fill(const StepBatch& batch, uint8_t* buffer) const;
};

absl::StatusOr<StepPlan> PlanStep(const StepBatch& batch, const StepPlanContext& context);

// PlanPod over every entry of `batch` (decode rows become the 16-row decode role).
absl::StatusOr<PodPlan> PlanPodStep(const StepBatch& batch, const CacheGeometry& geometry,
                                    const PrefillWaveSizes& prefill_ctas_per_wave,
                                    const PodWaveSizes& pod_ctas_per_wave);

}  // namespace attnd::plan
