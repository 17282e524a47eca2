// The scaling of attention scores into the online softmax's log2 domain, and the soft cap
// (score = cap * tanh(score / cap), before the mask: capping after it would turn a masked -inf
// into -cap). One rule for decode, prefill, POD and MLA, so their capped logits agree.
#pragma once

#include "math.cuh"

namespace attnd::cuda {

// How raw scores (q.k in the MMA's accumulator) become log2-domain logits.
struct SoftmaxParams {
  float scale_log2;       // applied to raw scores (1 when soft-capped: the cap applies it)
  float cap_input_scale;  // soft cap: s -> cap_log2 * tanh(s * cap_input_scale)
  float cap_log2;
  bool soft_cap;

  // `score_scale` = sm_scale * k_scale; `soft_cap` <= 0: none.
  __host__ __device__ static SoftmaxParams Of(float score_scale, float soft_cap) {
    SoftmaxParams sp;
    sp.soft_cap = soft_cap > 0.0f;
    // Without a cap, scores stay raw and exp2(s * scale_log2 - m) folds the scale into one FFMA.
    sp.scale_log2 = sp.soft_cap ? 1.0f : score_scale * kLog2e;
    sp.cap_input_scale = sp.soft_cap ? score_scale / soft_cap : 0.0f;
    sp.cap_log2 = soft_cap * kLog2e;
    return sp;
  }
};

#ifdef __CUDACC__
// The soft-capped log2-domain logit of raw score `s`: cap * tanh(s * score_scale / cap) * log2(e).
__device__ __forceinline__ float SoftCapLog2(float s, float cap_input_scale, float cap_log2) {
  return cap_log2 * AccurateTanh(s * cap_input_scale);
}
#endif  // __CUDACC__

}  // namespace attnd::cuda
