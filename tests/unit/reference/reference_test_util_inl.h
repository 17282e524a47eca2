// The dense float64 attention formula of reference_test_util.h. Deliberately naive: one
// (row, head) at a time, every key visited, no tiling, no online rescaling.
#pragma once

#include <cmath>
#include <limits>

namespace attnd::testing {

template <typename KeyFn, typename ValueFn>
DenseAttentionResult DenseAttention(const std::vector<double>& q, int32_t num_qo_heads,
                                    int32_t num_kv_heads, int32_t qk_dim, int32_t v_dim,
                                    const std::vector<int32_t>& qo_indptr,
                                    const std::vector<int64_t>& kv_lens,
                                    const AttentionParams& params, KeyFn&& key, ValueFn&& value) {
  const int64_t num_rows = qo_indptr.back();
  DenseAttentionResult result;
  result.o.assign(num_rows * num_qo_heads * v_dim, 0.0);
  result.lse.assign(num_rows * num_qo_heads, -std::numeric_limits<double>::infinity());
  const int32_t group = num_qo_heads / num_kv_heads;
  for (size_t request = 0; request + 1 < qo_indptr.size(); ++request) {
    const int64_t q_len = qo_indptr[request + 1] - qo_indptr[request];
    const int64_t kv_len = kv_lens[request];
    for (int64_t i = 0; i < q_len; ++i) {
      const int64_t row = qo_indptr[request] + i;
      const int64_t position = kv_len - q_len + i;  // the query's own key position
      for (int32_t head = 0; head < num_qo_heads; ++head) {
        const int32_t kv_head = head / group;
        std::vector<double> scores;
        std::vector<int64_t> keys;
        for (int64_t t = 0; t < kv_len; ++t) {
          if (params.causal && t > position) continue;
          if (params.window_left >= 0 && t < position - params.window_left) continue;
          double dot = 0;
          for (int32_t d = 0; d < qk_dim; ++d)
            dot += q[(row * num_qo_heads + head) * qk_dim + d] * key(request, t, kv_head, d);
          double score = params.sm_scale * dot;
          if (params.logits_soft_cap > 0) {
            score = params.logits_soft_cap * std::tanh(score / params.logits_soft_cap);
          }
          scores.push_back(score);
          keys.push_back(t);
        }
        if (keys.empty()) continue;
        double max_score = -std::numeric_limits<double>::infinity();
        for (double s : scores) max_score = std::max(max_score, s);
        double sum = 0;
        for (double s : scores) sum += std::exp(s - max_score);
        double* o = &result.o[(row * num_qo_heads + head) * v_dim];
        for (size_t k = 0; k < keys.size(); ++k) {
          const double p = std::exp(scores[k] - max_score) / sum;
          for (int32_t d = 0; d < v_dim; ++d) o[d] += p * value(request, keys[k], kv_head, d);
        }
        result.lse[row * num_qo_heads + head] = max_score + std::log(sum);
      }
    }
  }
  return result;
}

}  // namespace attnd::testing
