// Test fixtures for the reference ops: random paged caches with known contents, and a plain
// float64 attention formula over dense tensors that shares no code with the reference.
#pragma once

#include <cstdint>
#include <random>
#include <vector>

#include "attnd/kernels/attention_params.h"
#include "attnd/kernels/dtype.h"
#include "attnd/kernels/views.h"

namespace attnd::testing {

// A dense tensor in some dtype, with its bytes and a float64 view of the stored values.
struct HostTensor {
  DType dtype = DType::kFloat32;
  int64_t num_tokens = 0;
  int32_t num_heads = 0;
  int32_t head_dim = 0;
  std::vector<uint8_t> bytes;

  static HostTensor Random(DType dtype, int64_t num_tokens, int32_t num_heads, int32_t head_dim,
                           std::mt19937& rng, double magnitude = 1.0);
  // Every byte 0xFF: NaN in float32, float16 and bfloat16, so an unwritten element shows.
  static HostTensor Poisoned(DType dtype, int64_t num_tokens, int32_t num_heads, int32_t head_dim);

  TokenHeadsView View() {
    return {bytes.data(), dtype, num_tokens, num_heads, head_dim};
  }
  double At(int64_t token, int32_t head, int32_t dim) const;
  bool IsPoisoned(int64_t token, int32_t head, int32_t dim) const;
};

struct PagedCacheSpec {
  int32_t num_heads = 1;
  int32_t head_dim = 64;
  int32_t page_size = 16;
  DType dtype = DType::kBFloat16;
  KvLayout layout = KvLayout::kNHD;
  bool separate_kv = false;  // V ids drawn independently of K ids (TRT-LLM tables)
  std::vector<int64_t> kv_lens;
  int32_t spare_pages = 3;   // unused pages, full of garbage
  // For MLA the V pool holds kpe, whose width differs from ckv's.
  int32_t v_head_dim = 0;    // 0: head_dim
  double k_magnitude = 1.0;  // values drawn uniformly in +-magnitude before storing
  double v_magnitude = 1.0;
  uint32_t seed = 1;
};

// K and V pools with a CSR page table. Pages are scattered in a random order, every byte not
// holding a token is random garbage (NaN codes included), and tokens hold random values.
class PagedCache {
 public:
  explicit PagedCache(const PagedCacheSpec& spec);

  PageTableView Table() const;
  PagedKvView KView() { return View(k_pool_, spec_.head_dim); }
  PagedKvView VView() { return View(v_pool_, VHeadDim()); }
  // The stored value of token t of request b, as float64 (no scale applied).
  double K(int32_t request, int64_t token, int32_t head, int32_t dim) const;
  double V(int32_t request, int64_t token, int32_t head, int32_t dim) const;

  const PagedCacheSpec& spec() const { return spec_; }
  int32_t VHeadDim() const { return spec_.v_head_dim > 0 ? spec_.v_head_dim : spec_.head_dim; }
  int64_t num_pages() const { return num_pages_; }
  std::vector<uint8_t>& k_pool() { return k_pool_; }
  std::vector<uint8_t>& v_pool() { return v_pool_; }
  // Page table arrays, for tests that build their own views.
  const std::vector<int32_t>& indptr() const { return indptr_; }
  const std::vector<int32_t>& k_indices() const { return k_indices_; }
  const std::vector<int32_t>& v_indices() const { return v_indices_; }
  const std::vector<int32_t>& last_page_len() const { return last_page_len_; }
  // Element index of (request, token, head, dim) in the K (or V) pool, from the layout's
  // definition (not through PagedKvView::Offset).
  int64_t ElementOffset(int32_t request, int64_t token, int32_t head, int32_t dim, bool v) const;

 private:
  PagedKvView View(std::vector<uint8_t>& pool, int32_t head_dim);

  PagedCacheSpec spec_;
  int64_t num_pages_ = 0;
  std::vector<uint8_t> k_pool_;
  std::vector<uint8_t> v_pool_;
  std::vector<int32_t> indptr_;
  std::vector<int32_t> k_indices_;
  std::vector<int32_t> v_indices_;
  std::vector<int32_t> last_page_len_;
};

// Plain float64 attention over dense per-request K/V (DESIGN 2): for every request, query row
// and head, scores over the visible keys, max-subtracted softmax, weighted sum of V.
struct DenseAttentionResult {
  std::vector<double> o;    // [T_q][num_qo_heads][v_dim]
  std::vector<double> lse;  // [T_q][num_qo_heads]
};

// key(request, token, kv_head, dim) and value(...) give dequantised values; q is [T][H][qk_dim].
template <typename KeyFn, typename ValueFn>
DenseAttentionResult DenseAttention(const std::vector<double>& q, int32_t num_qo_heads,
                                    int32_t num_kv_heads, int32_t qk_dim, int32_t v_dim,
                                    const std::vector<int32_t>& qo_indptr,
                                    const std::vector<int64_t>& kv_lens,
                                    const AttentionParams& params, KeyFn&& key, ValueFn&& value);

}  // namespace attnd::testing

#include "reference_test_util_inl.h"
