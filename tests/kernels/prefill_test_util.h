// Helpers of the batch-prefill and POD GPU tests (prefill_test.cc, pod_test.cc), on top of
// kernel_test_util.h: a test configuration, and random batches over paged pools whose unused
// slots are NaN, so a read outside a request's keys shows up in its output.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <numeric>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "attnd/kernels/attention_params.h"
#include "attnd/kernels/dtype.h"
#include "attnd/kernels/views.h"
#include "gtest/gtest.h"
#include "kernel_test_util.h"
#include "plan/prefill_plan.h"
#include "reference/attention.h"

namespace attnd::prefill_test {

using kernel_test::DeviceBuffer;
using kernel_test::HaveGpu;

// Upload, but at least 16 bytes: an empty table still gets a valid device pointer.
template <typename T>
inline DeviceBuffer Upload(const std::vector<T>& host) {
  DeviceBuffer buffer(std::max<size_t>(host.size() * sizeof(T), 16));
  if (!host.empty()) cudaMemcpy(buffer.get(), host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice);
  return buffer;
}

enum class TableForm { kShared, kSeparateKv };

struct Config {
  DType q_dtype = DType::kBFloat16;
  DType kv_dtype = DType::kBFloat16;
  int32_t head_dim = 128;
  int32_t num_qo_heads = 8;
  int32_t num_kv_heads = 2;
  int32_t page_size = 16;
  KvLayout layout = KvLayout::kNHD;
  TableForm table = TableForm::kShared;
  AttentionParams params;  // sm_scale 0 here means 1/sqrt(head_dim)
  bool return_lse = true;
  bool deterministic = false;
  bool split_kv = true;          // false: disable_split_kv
  int32_t fixed_split_tokens = 0;
  plan::PrefillKernel kernel = plan::PrefillKernel::kAuto;
  int32_t max_persistent_ctas = 0;  // BatchPrefillArgs::max_persistent_ctas (Hopper grid)
  bool works_on_demand = false;     // BatchPrefillArgs::works_on_demand
  bool pipeline_short_works = true;  // BatchPrefillArgs::pipeline_short_works
  // BatchPrefillArgs::tail_ctas: the second grid on a stream of its own, the merge after both.
  int32_t tail_ctas = 0;
  // BatchPrefill runs this many times on one upload of the plan, o and lse poisoned before
  // each (the output is the last launch's).
  int32_t launches = 1;
  uint32_t seed = 1;

  std::string Name() const {
    return std::string(DTypeName(q_dtype)) + "/" + std::string(DTypeName(kv_dtype)) + " D" +
           std::to_string(head_dim) + " H" + std::to_string(num_qo_heads) + "/" + std::to_string(num_kv_heads) +
           " page" + std::to_string(page_size) + (layout == KvLayout::kNHD ? " NHD" : " HND") +
           (table == TableForm::kShared ? " shared" : " separate") + (params.causal ? " causal" : "") +
           (params.logits_soft_cap > 0 ? " cap" : "") +
           (params.window_left >= 0 ? " window" + std::to_string(params.window_left) : "") +
           (fixed_split_tokens > 0 ? " split" + std::to_string(fixed_split_tokens) : "") +
           (deterministic ? " deterministic" : "") +
           (max_persistent_ctas > 0 ? " grid" + std::to_string(max_persistent_ctas) : "") +
           (works_on_demand ? " on-demand" : "") + (tail_ctas > 0 ? " tail" + std::to_string(tail_ctas) : "") + (launches > 1 ? " x" + std::to_string(launches) : "") +
           (kernel != plan::PrefillKernel::kAuto ? std::string(" ") + plan::PrefillKernelName(kernel) : "");
  }
};

// Normwise relative error bound against float64: P and the output round to the MMA type
// (fp16 whenever either side is fp16 and the other is 16-bit; bf16 otherwise), o to q's type.
inline double Tolerance(const Config& config) {
  if (config.kv_dtype == DType::kFloat8E4M3) return 5e-2;
  if (config.q_dtype == DType::kBFloat16 || config.kv_dtype == DType::kBFloat16) return 1e-2;
  return 2e-3;
}

// Host-side batch: random q and pools, page tables, and the views of both sides.
struct Batch {
  Config config;
  std::vector<int32_t> q_lens, kv_lens;
  std::vector<int32_t> qo_indptr, page_indptr, k_page_ids, v_page_ids, last_page_len;
  std::vector<uint8_t> q, k_pool, v_pool;
  int64_t num_pages = 0;
  int64_t num_rows = 0;

  PagedKvView Pool(void* data) const {
    PagedKvView view;
    view.data = data;
    view.dtype = config.kv_dtype;
    view.layout = config.layout;
    view.num_pages = num_pages;
    view.page_size = config.page_size;
    view.num_heads = config.num_kv_heads;
    view.head_dim = config.head_dim;
    return view;
  }
  AttentionParams Params() const {
    AttentionParams params = config.params;
    if (params.sm_scale == 0.0f) params.sm_scale = 1.0f / std::sqrt(static_cast<float>(config.head_dim));
    return params;
  }
};

inline uint16_t NanBits16() { return 0x7fff; }

inline Batch MakeBatch(const Config& config, const std::vector<int32_t>& q_lens, const std::vector<int32_t>& kv_lens) {
  Batch batch;
  batch.config = config;
  batch.q_lens = q_lens;
  batch.kv_lens = kv_lens;
  std::mt19937 rng(config.seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const int32_t batch_size = static_cast<int32_t>(q_lens.size());
  const int32_t page_size = config.page_size;

  batch.qo_indptr = {0};
  batch.page_indptr = {0};
  for (int32_t b = 0; b < batch_size; ++b) {
    batch.qo_indptr.push_back(batch.qo_indptr.back() + q_lens[b]);
    const int32_t pages = (kv_lens[b] + page_size - 1) / page_size;
    batch.page_indptr.push_back(batch.page_indptr.back() + pages);
    batch.last_page_len.push_back(pages == 0 ? 0 : kv_lens[b] - (pages - 1) * page_size);
  }
  batch.num_rows = batch.qo_indptr.back();
  const int32_t used_pages = batch.page_indptr.back();
  // Spare pages, shuffled ids: pages of a request are scattered through the pool.
  batch.num_pages = used_pages + 3;
  std::vector<int32_t> ids(batch.num_pages);
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng);
  batch.k_page_ids.assign(ids.begin(), ids.begin() + used_pages);
  if (config.table == TableForm::kSeparateKv) std::shuffle(ids.begin(), ids.end(), rng);
  batch.v_page_ids.assign(ids.begin(), ids.begin() + used_pages);

  const int q_bytes = DTypeBytes(config.q_dtype);
  const int kv_bytes = DTypeBytes(config.kv_dtype);
  const int64_t q_elements = batch.num_rows * config.num_qo_heads * config.head_dim;
  batch.q.resize(q_elements * q_bytes);
  for (int64_t i = 0; i < q_elements; ++i) StoreFromFloat(config.q_dtype, batch.q.data(), i, normal(rng));

  // Every slot starts as NaN, so a read outside a request's keys shows up in its output.
  const PagedKvView shape = batch.Pool(nullptr);
  const int64_t pool_elements = batch.num_pages * shape.PageElements();
  for (std::vector<uint8_t>* pool : {&batch.k_pool, &batch.v_pool}) {
    pool->resize(pool_elements * kv_bytes);
    if (kv_bytes == 1) {
      std::fill(pool->begin(), pool->end(), uint8_t{0x7f});
    } else {
      auto* words = reinterpret_cast<uint16_t*>(pool->data());
      std::fill(words, words + pool_elements, NanBits16());
    }
  }
  const AttentionParams params = batch.Params();
  for (int32_t b = 0; b < batch_size; ++b) {
    for (int32_t token = 0; token < kv_lens[b]; ++token) {
      const int32_t slot = batch.page_indptr[b] + token / page_size;
      for (int32_t head = 0; head < config.num_kv_heads; ++head) {
        const int64_t k_offset = shape.Offset(batch.k_page_ids[slot], token % page_size, head);
        const int64_t v_offset = shape.Offset(batch.v_page_ids[slot], token % page_size, head);
        for (int32_t d = 0; d < config.head_dim; ++d) {
          StoreFromFloat(config.kv_dtype, batch.k_pool.data(), k_offset + d, normal(rng) / params.k_scale);
          StoreFromFloat(config.kv_dtype, batch.v_pool.data(), v_offset + d, normal(rng) / params.v_scale);
        }
      }
    }
  }
  return batch;
}

// Non-finite inputs (NaN in, NaN out): one element of q (request, query token, q head) or of a
// cached k or v (request, key, KV head) set to `value` (NaN for fp8 caches, which hold no inf).
struct Poison {
  enum class Where { kQ, kK, kV };
  Where where;
  int32_t request;
  int32_t token;
  int32_t head;
  int32_t dim;
  float value;
};

// Whether query token `i` of `request` sees key `key` (causal bottom-right, window, length).
inline bool SeesKey(const Batch& batch, int32_t request, int32_t i, int32_t key) {
  const AttentionParams params = batch.Params();
  const int32_t position = batch.kv_lens[request] - batch.q_lens[request] + i;
  return key >= 0 && key < batch.kv_lens[request] && (!params.causal || key <= position) &&
         (params.window_left < 0 || key >= position - params.window_left);
}

// Writes the poisons into the batch and returns how many (row, head) pairs the rule marks: rows
// that see a poisoned key, and poisoned q rows that see any key.
inline int64_t ApplyPoisons(Batch& batch, const std::vector<Poison>& poisons) {
  const Config& config = batch.config;
  const int32_t group = config.num_qo_heads / config.num_kv_heads;
  const PagedKvView pool = batch.Pool(nullptr);
  std::vector<bool> marked(batch.num_rows * config.num_qo_heads, false);
  for (const Poison& poison : poisons) {
    const int32_t b = poison.request;
    if (poison.where == Poison::Where::kQ) {
      const int64_t row = (batch.qo_indptr[b] + poison.token) * int64_t{config.num_qo_heads} + poison.head;
      StoreFromFloat(config.q_dtype, batch.q.data(), row * config.head_dim + poison.dim, poison.value);
      bool sees_any = false;
      for (int32_t key = 0; key < batch.kv_lens[b]; ++key) sees_any |= SeesKey(batch, b, poison.token, key);
      if (sees_any) marked[row] = true;
      continue;
    }
    const bool is_k = poison.where == Poison::Where::kK;
    const int32_t slot = batch.page_indptr[b] + poison.token / config.page_size;
    const int32_t page = (is_k ? batch.k_page_ids : batch.v_page_ids)[slot];
    kernel_test::StoreNonFinite(config.kv_dtype, (is_k ? batch.k_pool : batch.v_pool).data(),
                                pool.Offset(page, poison.token % config.page_size, poison.head) + poison.dim,
                                poison.value);
    for (int32_t i = 0; i < batch.q_lens[b]; ++i) {
      if (!SeesKey(batch, b, i, poison.token)) continue;
      for (int32_t h = poison.head * group; h < (poison.head + 1) * group; ++h) {
        marked[(batch.qo_indptr[b] + i) * int64_t{config.num_qo_heads} + h] = true;
      }
    }
  }
  return std::count(marked.begin(), marked.end(), true);
}

// For q_lens {100, 40, 1}, kv_lens {100, 300, 129} and 2 KV heads: NaN and -inf v of keys that
// earlier rows of the same tiles do not see (causal), +inf k, NaN k of a cached key, +-inf q.
inline std::vector<Poison> StandardPoisons(int32_t head_dim) {
  using Where = Poison::Where;
  return {{Where::kV, 0, 50, 0, 3, NAN},          {Where::kK, 0, 70, 1, 0, INFINITY},
          {Where::kQ, 0, 20, 6, 2, INFINITY},     {Where::kQ, 1, 5, 2, 9, -INFINITY},
          {Where::kK, 1, 10, 1, head_dim - 1, NAN}, {Where::kV, 2, 128, 0, 1, -INFINITY}};
}

// The float64 CPU reference over the same batch.
struct Expected {
  std::vector<float> o;
  std::vector<float> lse;
};

inline Expected RunReference(const Batch& batch) {
  const Config& config = batch.config;
  Expected expected;
  expected.o.resize(batch.num_rows * config.num_qo_heads * config.head_dim);
  expected.lse.resize(batch.num_rows * config.num_qo_heads);
  reference::BatchAttentionArgs args;
  args.q = {const_cast<uint8_t*>(batch.q.data()), config.q_dtype, batch.num_rows, config.num_qo_heads,
            config.head_dim};
  args.qo_indptr = batch.qo_indptr.data();
  args.pages.batch_size = static_cast<int32_t>(batch.q_lens.size());
  args.pages.page_size = config.page_size;
  args.pages.indptr = batch.page_indptr.data();
  args.pages.k_indices = batch.k_page_ids.data();
  args.pages.v_indices = batch.v_page_ids.data();
  args.pages.last_page_len = batch.last_page_len.data();
  args.k_cache = batch.Pool(const_cast<uint8_t*>(batch.k_pool.data()));
  args.v_cache = batch.Pool(const_cast<uint8_t*>(batch.v_pool.data()));
  args.params = batch.Params();
  args.o = {expected.o.data(), DType::kFloat32, batch.num_rows, config.num_qo_heads, config.head_dim};
  args.lse = expected.lse.data();
  args.accumulation = reference::Accumulation::kFloat64;
  reference::BatchAttention(args);
  return expected;
}

// Compares a GPU result with the reference: normwise relative error of o, lse within 2e-3
// (-inf exactly where the reference has it), fully masked rows exactly 0, nothing NaN.
// Output: any GPU result with o (q_dtype bytes) and lse (float) of every row and head.
template <typename Output>
void ExpectMatches(const Batch& batch, const Output& got, const Expected& expected) {
  const Config& config = batch.config;
  const int64_t rows = batch.num_rows * config.num_qo_heads;
  const int32_t head_dim = config.head_dim;
  ASSERT_EQ(got.o.size(), static_cast<size_t>(rows * head_dim * DTypeBytes(config.q_dtype)));
  double error_sq = 0.0, norm_sq = 0.0;
  int64_t bad_rows = 0, bad_lse = 0;
  std::string first_bad;
  for (int64_t row = 0; row < rows; ++row) {
    const bool masked = std::isinf(expected.lse[row]) && expected.lse[row] < 0;
    bool row_bad = false;
    for (int32_t d = 0; d < head_dim; ++d) {
      const float value = LoadAsFloat(config.q_dtype, got.o.data(), row * head_dim + d);
      const double want = expected.o[row * head_dim + d];
      if (std::isnan(value) || (masked && value != 0.0f)) row_bad = true;
      error_sq += (value - want) * (value - want);
      norm_sq += want * want;
    }
    if (row_bad) {
      if (bad_rows++ == 0) first_bad = "row " + std::to_string(row / config.num_qo_heads) + " head " +
                                       std::to_string(row % config.num_qo_heads);
    }
    if (config.return_lse) {
      const float lse = got.lse[row];
      const bool lse_ok = masked ? (std::isinf(lse) && lse < 0) : std::fabs(lse - expected.lse[row]) <= 2e-3 * std::max(1.0f, std::fabs(expected.lse[row]));
      if (!lse_ok && bad_lse++ == 0) {
        ADD_FAILURE() << config.Name() << ": lse of row " << row / config.num_qo_heads << " head "
                      << row % config.num_qo_heads << " is " << lse << ", want " << expected.lse[row];
      }
    }
  }
  EXPECT_EQ(bad_rows, 0) << config.Name() << ": rows with NaN, or nonzero where fully masked; first " << first_bad;
  EXPECT_EQ(bad_lse, 0) << config.Name() << ": rows with a wrong lse";
  const double relative = norm_sq > 0 ? std::sqrt(error_sq / norm_sq) : std::sqrt(error_sq);
  EXPECT_LE(relative, Tolerance(config)) << config.Name();
  std::printf("  %-60s relative error %.2e\n", config.Name().c_str(), relative);
}

}  // namespace attnd::prefill_test
