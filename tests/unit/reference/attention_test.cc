// BatchAttention against a plain float64 formula (reference_test_util_inl.h) over a sweep of
// shapes, masks and dtypes; poisoned outputs show any element left unwritten.
#include "reference/attention.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <tuple>

#include "reference_test_util.h"

namespace attnd::reference {
namespace {

using testing::DenseAttention;
using testing::DenseAttentionResult;
using testing::HostTensor;
using testing::PagedCache;
using testing::PagedCacheSpec;

constexpr uint32_t kLsePoisonBits = 0x7fc0dead;  // a NaN no computation produces

struct Problem {
  PagedCache cache;
  HostTensor q;
  std::vector<int32_t> qo_indptr;
  AttentionParams params;
  int64_t extra_rows = 0;  // q/o rows past qo_indptr.back(): no request owns them
};

Problem MakeProblem(const PagedCacheSpec& spec, const std::vector<int32_t>& q_lens,
                    int32_t num_qo_heads, AttentionParams params, DType q_dtype = DType::kFloat32,
                    double q_magnitude = 3.0, int64_t extra_rows = 0) {
  std::vector<int32_t> qo_indptr{0};
  for (int32_t len : q_lens) qo_indptr.push_back(qo_indptr.back() + len);
  std::mt19937 rng(spec.seed + 1000);
  // sm_scale left at its default of 1 means the usual 1/sqrt(head_dim).
  HostTensor q = HostTensor::Random(q_dtype, qo_indptr.back() + extra_rows, num_qo_heads,
                                    spec.head_dim, rng, q_magnitude);
  if (params.sm_scale == 1.0f) params.sm_scale = 1.0f / std::sqrt(float(spec.head_dim));
  return {PagedCache(spec), std::move(q), std::move(qo_indptr), params, extra_rows};
}

struct Output {
  HostTensor o;
  std::vector<float> lse;
};

Output RunAttention(Problem& problem, Accumulation accumulation, DType o_dtype = DType::kFloat32,
           bool with_lse = true) {
  Output out{HostTensor::Poisoned(o_dtype, problem.q.num_tokens, problem.q.num_heads,
                                  problem.q.head_dim),
             std::vector<float>(problem.q.num_tokens * problem.q.num_heads,
                                BitsToFloat(kLsePoisonBits))};
  BatchAttentionArgs args;
  args.q = problem.q.View();
  args.qo_indptr = problem.qo_indptr.data();
  args.pages = problem.cache.Table();
  args.k_cache = problem.cache.KView();
  args.v_cache = problem.cache.VView();
  args.params = problem.params;
  args.o = out.o.View();
  args.lse = with_lse ? out.lse.data() : nullptr;
  args.accumulation = accumulation;
  BatchAttention(args);
  return out;
}

DenseAttentionResult Oracle(const Problem& problem) {
  const HostTensor& q = problem.q;
  std::vector<double> dense_q(q.num_tokens * q.num_heads * q.head_dim);
  for (int64_t t = 0; t < q.num_tokens; ++t)
    for (int32_t h = 0; h < q.num_heads; ++h)
      for (int32_t d = 0; d < q.head_dim; ++d)
        dense_q[(t * q.num_heads + h) * q.head_dim + d] = q.At(t, h, d);
  const PagedCache& cache = problem.cache;
  const double k_scale = problem.params.k_scale;
  const double v_scale = problem.params.v_scale;
  return DenseAttention(
      dense_q, q.num_heads, cache.spec().num_heads, q.head_dim, q.head_dim, problem.qo_indptr,
      cache.spec().kv_lens, problem.params,
      [&](size_t b, int64_t t, int32_t h, int32_t d) { return cache.K(b, t, h, d) * k_scale; },
      [&](size_t b, int64_t t, int32_t h, int32_t d) { return cache.V(b, t, h, d) * v_scale; });
}

// Every owned element written and within atol + rtol * |expected|; lse likewise (exactly -inf
// where expected); rows no request owns still poisoned.
void ExpectMatches(const Problem& problem, const Output& out, const DenseAttentionResult& expected,
                   double atol, double rtol) {
  const int64_t owned_rows = problem.qo_indptr.back();
  const int32_t heads = out.o.num_heads;
  const int32_t dim = out.o.head_dim;
  int failures = 0;
  for (int64_t t = 0; t < out.o.num_tokens && failures < 10; ++t) {
    for (int32_t h = 0; h < heads && failures < 10; ++h) {
      const float lse = out.lse[t * heads + h];
      if (t >= owned_rows) {
        EXPECT_EQ(FloatBits(lse), kLsePoisonBits) << "lse of unowned row " << t;
        for (int32_t d = 0; d < dim; ++d)
          EXPECT_TRUE(out.o.IsPoisoned(t, h, d)) << "o of unowned row " << t;
        continue;
      }
      const double want_lse = expected.lse[t * heads + h];
      if (std::isinf(want_lse)) {
        EXPECT_EQ(lse, -std::numeric_limits<float>::infinity()) << "row " << t << " head " << h;
      } else {
        EXPECT_NEAR(lse, want_lse, atol + rtol * std::fabs(want_lse))
            << "row " << t << " head " << h;
      }
      for (int32_t d = 0; d < dim; ++d) {
        const double got = out.o.At(t, h, d);
        const double want = expected.o[(t * heads + h) * dim + d];
        if (!(std::fabs(got - want) <= atol + rtol * std::fabs(want))) {
          ADD_FAILURE() << "o[" << t << "][" << h << "][" << d << "] = " << got << ", want "
                        << want;
          if (++failures >= 10) break;
        }
      }
    }
  }
}

// head_dim, GQA group, page size, causal.
class AttentionSweep : public ::testing::TestWithParam<std::tuple<int, int, int, bool>> {};

TEST_P(AttentionSweep, MatchesDenseFloat64FormulaInBothAccumulations) {
  const auto [head_dim, group, page_size, causal] = GetParam();
  PagedCacheSpec spec;
  spec.num_heads = 2;
  spec.head_dim = head_dim;
  spec.page_size = page_size;
  // Empty, one token, page boundaries on both sides, several tiles of keys.
  spec.kv_lens = {0, 1, page_size, page_size + 1, 2 * page_size - 1, 2 * page_size, 300, 5};
  spec.seed = head_dim * 1000 + group * 100 + page_size + causal;
  // Decode rows, short prefills, a padding slot (q 0 with keys), and a chunked prefill.
  const std::vector<int32_t> q_lens = {1, 1, std::min(page_size, 3), 1,
                                       std::min(2 * page_size - 1, 5), 0, 11, 5};
  AttentionParams params;
  params.causal = causal;
  Problem problem = MakeProblem(spec, q_lens, 2 * group, params, DType::kFloat32, 3.0,
                                /*extra_rows=*/2);
  const DenseAttentionResult expected = Oracle(problem);
  ExpectMatches(problem, RunAttention(problem, Accumulation::kFloat64), expected, 1e-6, 1e-6);
  ExpectMatches(problem, RunAttention(problem, Accumulation::kFloat32), expected, 2e-5, 2e-5);
}

INSTANTIATE_TEST_SUITE_P(
    HeadDimsGroupsPagesMasks, AttentionSweep,
    ::testing::Combine(::testing::Values(64, 128, 256), ::testing::Values(1, 4, 8),
                       ::testing::Values(1, 16, 128), ::testing::Bool()),
    [](const auto& info) {
      return "D" + std::to_string(std::get<0>(info.param)) + "Group" +
             std::to_string(std::get<1>(info.param)) + "Page" +
             std::to_string(std::get<2>(info.param)) +
             (std::get<3>(info.param) ? "Causal" : "NonCausal");
    });

// KV dtype sweep: fp16 and fp8 go through their own conversions; q in bf16.
class AttentionKvDtype : public ::testing::TestWithParam<DType> {};

TEST_P(AttentionKvDtype, MatchesDenseFormulaWithScales) {
  PagedCacheSpec spec;
  spec.num_heads = 2;
  spec.head_dim = 128;
  spec.dtype = GetParam();
  spec.kv_lens = {37, 200, 1};
  spec.seed = 7;
  AttentionParams params;
  // Scales only make sense for fp8, but they apply whatever the dtype.
  params.k_scale = spec.dtype == DType::kFloat8E4M3 ? 0.25f : 1.0f;
  params.v_scale = spec.dtype == DType::kFloat8E4M3 ? 3.0f : 1.0f;
  Problem problem = MakeProblem(spec, {4, 9, 1}, 8, params, DType::kBFloat16, 6.0);
  const DenseAttentionResult expected = Oracle(problem);
  ExpectMatches(problem, RunAttention(problem, Accumulation::kFloat64), expected, 3e-6, 1e-6);
  ExpectMatches(problem, RunAttention(problem, Accumulation::kFloat32), expected, 5e-5, 2e-5);
}

INSTANTIATE_TEST_SUITE_P(Dtypes, AttentionKvDtype,
                         ::testing::Values(DType::kBFloat16, DType::kFloat16, DType::kFloat8E4M3,
                                           DType::kFloat32),
                         [](const auto& info) { return std::string(DTypeName(info.param)); });

TEST(BatchAttention, SoftCapMatchesFormula) {
  for (const float cap : {50.0f, 5.0f}) {
    PagedCacheSpec spec;
    spec.num_heads = 2;
    spec.head_dim = 64;
    spec.kv_lens = {150, 3};
    AttentionParams params;
    params.logits_soft_cap = cap;
    params.sm_scale = 0.5f;  // large logits, so the cap bites
    Problem problem = MakeProblem(spec, {6, 1}, 8, params);
    const DenseAttentionResult expected = Oracle(problem);
    ExpectMatches(problem, RunAttention(problem, Accumulation::kFloat64), expected, 1e-6, 1e-6);
    ExpectMatches(problem, RunAttention(problem, Accumulation::kFloat32), expected, 2e-5, 2e-5);
  }
}

TEST(BatchAttention, SlidingWindowWithAndWithoutCausal) {
  for (const bool causal : {true, false}) {
    for (const int32_t window : {0, 1, 17, 500}) {
      PagedCacheSpec spec;
      spec.num_heads = 1;
      spec.head_dim = 64;
      spec.kv_lens = {300, 20, 1};
      AttentionParams params;
      params.causal = causal;
      params.window_left = window;
      Problem problem = MakeProblem(spec, {40, 1, 1}, 4, params);
      const DenseAttentionResult expected = Oracle(problem);
      SCOPED_TRACE(::testing::Message() << "causal " << causal << " window " << window);
      ExpectMatches(problem, RunAttention(problem, Accumulation::kFloat64), expected, 1e-6, 1e-6);
      ExpectMatches(problem, RunAttention(problem, Accumulation::kFloat32), expected, 2e-5, 2e-5);
    }
  }
}

TEST(BatchAttention, FullyMaskedRowsGiveZeroOutputAndNegativeInfinityLse) {
  PagedCacheSpec spec;
  spec.num_heads = 1;
  spec.head_dim = 64;
  // Request 0 has no keys at all; request 1 has more causal rows than keys, so its first rows
  // sit before key 0.
  spec.kv_lens = {0, 3};
  AttentionParams params;
  params.causal = true;
  Problem problem = MakeProblem(spec, {2, 5}, 2, params);
  for (const Accumulation accumulation : {Accumulation::kFloat32, Accumulation::kFloat64}) {
    const Output out = RunAttention(problem, accumulation);
    for (int64_t row : {0, 1, 2, 3}) {
      for (int32_t h = 0; h < 2; ++h) {
        EXPECT_EQ(out.lse[row * 2 + h], -std::numeric_limits<float>::infinity());
        for (int32_t d = 0; d < 64; ++d) ASSERT_EQ(out.o.At(row, h, d), 0.0) << row;
      }
    }
    for (int32_t h = 0; h < 2; ++h) EXPECT_TRUE(std::isfinite(out.lse[4 * 2 + h]));
  }
}

void PutFloat(std::vector<uint8_t>& bytes, int64_t element, float value) {
  std::memcpy(bytes.data() + element * sizeof(float), &value, sizeof(float));
}

// NaN in, NaN out for the rows it touches (DESIGN 4): a row whose q, or the k or v of a key it
// sees, holds NaN or +-inf gets o = NaN in every dim and lse = NaN; every other row comes out
// bit for bit as without the bad value, with or without a soft cap (which would turn an
// infinite score finite).
TEST(BatchAttention, NonFiniteInputsGiveNaNRowsTheyTouchAndNoOthers) {
  constexpr float kInf = std::numeric_limits<float>::infinity();
  constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
  PagedCacheSpec spec;
  spec.num_heads = 1;
  spec.head_dim = 64;
  spec.dtype = DType::kFloat32;
  spec.page_size = 16;
  spec.kv_lens = std::vector<int64_t>(8, 20);  // 3 causal rows each, at positions 17..19
  spec.seed = 3;
  constexpr int32_t kHeads = 2;                // GQA group of 2
  for (const float soft_cap : {0.0f, 30.0f}) {
    AttentionParams params;
    params.causal = true;
    params.logits_soft_cap = soft_cap;
    Problem clean = MakeProblem(spec, std::vector<int32_t>(8, 3), kHeads, params);
    Problem bad = MakeProblem(spec, std::vector<int32_t>(8, 3), kHeads, params);
    // Rows are (request * 3 + i, head); `touched` lists what each poison must turn to NaN.
    std::vector<std::pair<int64_t, int32_t>> touched;
    auto q_element = [&](int64_t row, int32_t head, int32_t dim) {
      return (row * kHeads + head) * spec.head_dim + dim;
    };
    PutFloat(bad.q.bytes, q_element(1 * 3 + 2, 0, 5), kNaN);    // request 1: q NaN, row 2 head 0
    touched.push_back({5, 0});
    PutFloat(bad.q.bytes, q_element(2 * 3 + 0, 1, 63), -kInf);  // request 2: q -inf, row 0 head 1
    touched.push_back({6, 1});
    // request 3: k +inf at key 18, seen by rows 1 and 2 (positions 18, 19), not row 0.
    PutFloat(bad.cache.k_pool(), bad.cache.ElementOffset(3, 18, 0, 7, false), kInf);
    for (int32_t h = 0; h < kHeads; ++h) touched.insert(touched.end(), {{10, h}, {11, h}});
    // request 4: k -inf at key 3, seen by every row.
    PutFloat(bad.cache.k_pool(), bad.cache.ElementOffset(4, 3, 0, 0, false), -kInf);
    for (int32_t h = 0; h < kHeads; ++h)
      touched.insert(touched.end(), {{12, h}, {13, h}, {14, h}});
    // request 5: v NaN at key 18 (rows 1, 2); request 6: v +inf at key 19 (row 2 only).
    PutFloat(bad.cache.v_pool(), bad.cache.ElementOffset(5, 18, 0, 9, true), kNaN);
    for (int32_t h = 0; h < kHeads; ++h) touched.insert(touched.end(), {{16, h}, {17, h}});
    PutFloat(bad.cache.v_pool(), bad.cache.ElementOffset(6, 19, 0, 0, true), kInf);
    for (int32_t h = 0; h < kHeads; ++h) touched.push_back({20, h});
    // request 7, and the untouched rows of the others, stay as they were.

    for (const Accumulation accumulation : {Accumulation::kFloat32, Accumulation::kFloat64}) {
      SCOPED_TRACE(::testing::Message() << "soft cap " << soft_cap << ", float"
                                        << (accumulation == Accumulation::kFloat64 ? 64 : 32));
      const Output want = RunAttention(clean, accumulation);
      const Output got = RunAttention(bad, accumulation);
      for (int64_t row = 0; row < 24; ++row) {
        for (int32_t h = 0; h < kHeads; ++h) {
          const bool nan_row =
              std::find(touched.begin(), touched.end(), std::make_pair(row, h)) != touched.end();
          const float lse = got.lse[row * kHeads + h];
          if (nan_row) {
            EXPECT_TRUE(std::isnan(lse)) << "row " << row << " head " << h << " lse " << lse;
            for (int32_t d = 0; d < spec.head_dim; ++d)
              ASSERT_TRUE(std::isnan(got.o.At(row, h, d))) << "row " << row << " head " << h
                                                          << " dim " << d;
          } else {
            EXPECT_EQ(FloatBits(lse), FloatBits(want.lse[row * kHeads + h]))
                << "row " << row << " head " << h;
            for (int32_t d = 0; d < spec.head_dim; ++d)
              ASSERT_EQ(got.o.At(row, h, d), want.o.At(row, h, d))
                  << "row " << row << " head " << h << " dim " << d;
          }
        }
      }
    }
  }
}

TEST(BatchAttention, PaddingRequestsAndUnownedRowsAreNotWritten) {
  PagedCacheSpec spec;
  spec.num_heads = 2;
  spec.head_dim = 64;
  spec.kv_lens = {0, 40, 16, 0};
  Problem problem = MakeProblem(spec, {0, 3, 0, 0}, 4, AttentionParams{}, DType::kFloat32, 3.0,
                                /*extra_rows=*/3);
  const Output out = RunAttention(problem, Accumulation::kFloat32);
  ExpectMatches(problem, out, Oracle(problem), 2e-5, 2e-5);  // checks rows 3..5 untouched
}

TEST(BatchAttention, LseIsOptional) {
  PagedCacheSpec spec;
  spec.head_dim = 64;
  spec.kv_lens = {20};
  Problem problem = MakeProblem(spec, {2}, 1, AttentionParams{});
  const Output with = RunAttention(problem, Accumulation::kFloat32);
  const Output without = RunAttention(problem, Accumulation::kFloat32, DType::kFloat32, false);
  EXPECT_EQ(with.o.bytes, without.o.bytes);
}

TEST(BatchAttention, NhdAndHndLayoutsGiveIdenticalOutputs) {
  PagedCacheSpec spec;
  spec.num_heads = 4;
  spec.head_dim = 128;
  spec.page_size = 16;
  spec.kv_lens = {100, 33, 1};
  spec.layout = KvLayout::kNHD;
  Problem nhd = MakeProblem(spec, {5, 1, 1}, 16, AttentionParams{});
  spec.layout = KvLayout::kHND;
  Problem hnd = MakeProblem(spec, {5, 1, 1}, 16, AttentionParams{});
  ASSERT_EQ(nhd.q.bytes, hnd.q.bytes);
  ASSERT_NE(nhd.cache.k_pool(), hnd.cache.k_pool());  // same tokens, different byte order
  for (const Accumulation accumulation : {Accumulation::kFloat32, Accumulation::kFloat64}) {
    const Output a = RunAttention(nhd, accumulation);
    const Output b = RunAttention(hnd, accumulation);
    EXPECT_EQ(a.o.bytes, b.o.bytes);
    EXPECT_EQ(0, std::memcmp(a.lse.data(), b.lse.data(), a.lse.size() * sizeof(float)));
  }
  ExpectMatches(hnd, RunAttention(hnd, Accumulation::kFloat64), Oracle(hnd), 1e-6, 1e-6);
}

TEST(BatchAttention, SeparateKvTablesReadValuesThroughTheVTable) {
  PagedCacheSpec spec;
  spec.num_heads = 2;
  spec.head_dim = 64;
  spec.page_size = 4;
  spec.separate_kv = true;
  spec.kv_lens = {50, 9};
  Problem problem = MakeProblem(spec, {3, 1}, 4, AttentionParams{});
  ASSERT_NE(problem.cache.k_indices(), problem.cache.v_indices());
  ExpectMatches(problem, RunAttention(problem, Accumulation::kFloat64), Oracle(problem), 1e-6, 1e-6);
}

TEST(BatchAttention, LargeLogitsStayFiniteAndAccurate) {
  PagedCacheSpec spec;
  spec.num_heads = 1;
  spec.head_dim = 128;
  spec.kv_lens = {400};
  AttentionParams params;
  params.sm_scale = 1.5f;  // scores in the hundreds: exp overflows without max subtraction
  Problem problem = MakeProblem(spec, {8}, 2, params, DType::kFloat32, 30.0);
  const DenseAttentionResult expected = Oracle(problem);
  ExpectMatches(problem, RunAttention(problem, Accumulation::kFloat64), expected, 1e-6, 1e-6);
  ExpectMatches(problem, RunAttention(problem, Accumulation::kFloat32), expected, 1e-4, 1e-5);
}

TEST(BatchAttention, Bf16OutputIsTheFloat64ResultRounded) {
  PagedCacheSpec spec;
  spec.num_heads = 2;
  spec.head_dim = 128;
  spec.kv_lens = {70, 5};
  Problem problem = MakeProblem(spec, {3, 1}, 8, AttentionParams{}, DType::kBFloat16);
  // bf16 keeps 8 significant bits: half an ulp is at most 2^-8 of the value.
  ExpectMatches(problem, RunAttention(problem, Accumulation::kFloat64, DType::kBFloat16), Oracle(problem),
                1e-30, std::ldexp(1.0, -8) * 1.0001);
}

TEST(BatchAttention, RequestResultDoesNotDependOnTheRestOfTheBatch) {
  PagedCacheSpec alone_spec;
  alone_spec.num_heads = 8;
  alone_spec.head_dim = 128;
  alone_spec.kv_lens = {700};
  alone_spec.seed = 3;
  Problem alone = MakeProblem(alone_spec, {90}, 32, AttentionParams{});
  const Output alone_out = RunAttention(alone, Accumulation::kFloat32);

  // The same request after other traffic: copy its q rows and keys into a bigger batch.
  PagedCacheSpec batch_spec = alone_spec;
  batch_spec.kv_lens = {50, 1, 700};
  Problem batch = MakeProblem(batch_spec, {1, 1, 90}, 32, AttentionParams{});
  const int64_t row_bytes = 32 * 128 * 4;
  std::memcpy(batch.q.bytes.data() + 2 * row_bytes, alone.q.bytes.data(), 90 * row_bytes);
  for (int64_t t = 0; t < 700; ++t) {
    for (int32_t h = 0; h < 8; ++h) {
      for (int32_t d = 0; d < 128; ++d) {
        const auto copy = [&](std::vector<uint8_t>& to, const std::vector<int32_t>& to_ids,
                              const std::vector<uint8_t>& from,
                              const std::vector<int32_t>& from_ids, int32_t to_request) {
          const auto offset = [](const std::vector<int32_t>& ids, int32_t first_page, int64_t t,
                                 int32_t h, int32_t d) {
            return (((int64_t{ids[first_page + t / 16]} * 16 + t % 16) * 8 + h) * 128 + d) * 2;
          };
          const int64_t to_offset = offset(to_ids, batch.cache.indptr()[to_request], t, h, d);
          const int64_t from_offset = offset(from_ids, 0, t, h, d);
          std::memcpy(&to[to_offset], &from[from_offset], 2);
        };
        copy(batch.cache.k_pool(), batch.cache.k_indices(), alone.cache.k_pool(),
             alone.cache.k_indices(), 2);
        copy(batch.cache.v_pool(), batch.cache.v_indices(), alone.cache.v_pool(),
             alone.cache.v_indices(), 2);
      }
    }
  }
  const Output batch_out = RunAttention(batch, Accumulation::kFloat32);
  EXPECT_EQ(0, std::memcmp(batch_out.o.bytes.data() + 2 * row_bytes, alone_out.o.bytes.data(),
                           90 * row_bytes));
  EXPECT_EQ(0, std::memcmp(batch_out.lse.data() + 2 * 32, alone_out.lse.data(),
                           90 * 32 * sizeof(float)));
}

TEST(BatchAttention, Float32ModeAgreesWithFloat64ModeOnATypicalCpuBackendShape) {
  PagedCacheSpec spec;
  spec.num_heads = 8;
  spec.head_dim = 128;
  spec.page_size = 16;
  spec.kv_lens = {2000, 1300, 64, 900};
  AttentionParams params;
  Problem problem = MakeProblem(spec, {1, 150, 1, 1}, 32, params, DType::kBFloat16, 4.0);
  const Output f64 = RunAttention(problem, Accumulation::kFloat64);
  const Output f32 = RunAttention(problem, Accumulation::kFloat32);
  // Relative to the largest element of each output row: an element that nearly cancels to 0
  // carries the absolute rounding of its row, not a relative one of its own.
  double worst = 0;
  for (int64_t row = 0; row < f64.o.num_tokens * 32; ++row) {
    double row_max = 0;
    for (int32_t d = 0; d < 128; ++d)
      row_max = std::max(row_max, std::fabs(double{LoadAsFloat(DType::kFloat32, f64.o.bytes.data(),
                                                                row * 128 + d)}));
    for (int32_t d = 0; d < 128; ++d) {
      const double want = LoadAsFloat(DType::kFloat32, f64.o.bytes.data(), row * 128 + d);
      const double got = LoadAsFloat(DType::kFloat32, f32.o.bytes.data(), row * 128 + d);
      worst = std::max(worst, std::fabs(got - want) / row_max);
    }
  }
  EXPECT_LT(worst, 1e-5);
  for (size_t i = 0; i < f64.lse.size(); ++i)
    EXPECT_NEAR(f32.lse[i], f64.lse[i], 1e-5 * std::fabs(f64.lse[i]) + 1e-6);
}

TEST(BatchAttention, ManyDecodeRequestsMatchFormula) {
  PagedCacheSpec spec;
  spec.num_heads = 2;
  spec.head_dim = 64;
  spec.page_size = 8;
  std::vector<int32_t> q_lens;
  for (int i = 0; i < 64; ++i) {
    spec.kv_lens.push_back(1 + (i * 37) % 150);
    q_lens.push_back(1);
  }
  Problem problem = MakeProblem(spec, q_lens, 8, AttentionParams{});
  ExpectMatches(problem, RunAttention(problem, Accumulation::kFloat32), Oracle(problem), 2e-5, 2e-5);
}

}  // namespace
}  // namespace attnd::reference
