// Attention semantics shared by every kernel and the reference.
#pragma once

#include <cstdint>

namespace attnd {

struct AttentionParams {
  // Bottom-right aligned: query i of a request with q_len rows and kv_len keys sees keys at
  // positions <= kv_len - q_len + i.
  bool causal = true;
  float sm_scale = 1.0f;         // resolved by the caller (1/sqrt(head_dim) by default)
  float logits_soft_cap = 0.0f;  // > 0: score = cap * tanh(score / cap)
  int32_t window_left = -1;      // >= 0: a query at position p sees keys >= p - window_left
  // Dequantisation scales of FP8 caches (stored * scale); 1 otherwise.
  float k_scale = 1.0f;
  float v_scale = 1.0f;
};

}  // namespace attnd
