#include "backend/cuda_pod_step.h"

#include <vector>

namespace attnd::cuda_backend {

PodStepShape PodShapeOf(const StepBatch& batch, int32_t page_size, bool hopper_prefill) {
  PodStepShape shape;
  shape.page_size = page_size;
  shape.hopper_prefill = hopper_prefill;
  shape.deterministic = batch.options.deterministic;
  for (int32_t b = 0; b < batch.batch_size; ++b) {
    const int32_t rows = batch.qo_indptr[b + 1] - batch.qo_indptr[b];
    if (rows == 1) ++shape.num_decode_requests;
    if (rows > 1) {
      ++shape.num_prefill_requests;
      shape.num_prefill_rows += rows;
    }
  }
  return shape;
}

absl::StatusOr<plan::PodPlan> PlanPodStep(const StepBatch& batch, const CacheGeometry& geometry,
                                          const plan::PrefillWaveSizes& prefill_ctas_per_wave,
                                          const plan::PodWaveSizes& pod_ctas_per_wave) {
  std::vector<int32_t> kv_lengths(batch.batch_size);
  for (int32_t b = 0; b < batch.batch_size; ++b) {
    kv_lengths[b] = static_cast<int32_t>(batch.KvLength(b, geometry.page_size));
  }
  plan::PrefillPlanInput input;
  input.qo_indptr = batch.qo_indptr;
  input.kv_lengths = kv_lengths;
  input.num_qo_heads = geometry.num_qo_heads;
  input.num_kv_heads = geometry.num_kv_heads;
  input.head_dim = geometry.k_head_dim;
  input.causal = batch.options.params.causal;
  input.ctas_per_wave = prefill_ctas_per_wave;
  input.deterministic = batch.options.deterministic;
  input.disable_split_kv = batch.options.disable_split_kv;
  input.fixed_split_tokens = batch.options.fixed_split_tokens;
  return plan::PlanPod(input, pod_ctas_per_wave);
}

}  // namespace attnd::cuda_backend
