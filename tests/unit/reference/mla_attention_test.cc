// MlaAttention (absorbed form) against the plain float64 formula with keys [ckv, kpe] and
// values ckv, DeepSeek shapes: 16 heads, kv_lora_rank 512, rope_dim 64.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "reference/attention.h"
#include "reference_test_util.h"

namespace attnd::reference {
namespace {

using testing::DenseAttention;
using testing::DenseAttentionResult;
using testing::HostTensor;
using testing::PagedCache;
using testing::PagedCacheSpec;

constexpr int32_t kHeads = 16;
constexpr int32_t kLatent = 512;
constexpr int32_t kRope = 64;

struct MlaProblem {
  PagedCache cache;  // K pool: ckv [512]; V pool: kpe [64]
  HostTensor q_nope;
  HostTensor q_pe;
  std::vector<int32_t> qo_indptr;
  AttentionParams params;
};

MlaProblem MakeMla(int32_t page_size, DType kv_dtype, const std::vector<int64_t>& kv_lens,
                   const std::vector<int32_t>& q_lens, AttentionParams params, uint32_t seed) {
  PagedCacheSpec spec;
  spec.num_heads = 1;
  spec.head_dim = kLatent;
  spec.v_head_dim = kRope;
  spec.page_size = page_size;
  spec.dtype = kv_dtype;
  spec.kv_lens = kv_lens;
  spec.separate_kv = true;  // ckv and kpe pages are looked up through their own ids
  spec.seed = seed;
  std::vector<int32_t> qo_indptr{0};
  for (int32_t len : q_lens) qo_indptr.push_back(qo_indptr.back() + len);
  std::mt19937 rng(seed + 99);
  HostTensor q_nope =
      HostTensor::Random(DType::kBFloat16, qo_indptr.back(), kHeads, kLatent, rng, 2.0);
  HostTensor q_pe = HostTensor::Random(DType::kBFloat16, qo_indptr.back(), kHeads, kRope, rng, 2.0);
  params.sm_scale = 1.0f / std::sqrt(192.0f);
  return {PagedCache(spec), std::move(q_nope), std::move(q_pe), std::move(qo_indptr), params};
}

struct MlaOutput {
  HostTensor o;
  std::vector<float> lse;
};

MlaOutput RunMla(MlaProblem& problem, Accumulation accumulation) {
  const int64_t rows = problem.qo_indptr.back();
  MlaOutput out{HostTensor::Poisoned(DType::kFloat32, rows, kHeads, kLatent),
                std::vector<float>(rows * kHeads, std::numeric_limits<float>::quiet_NaN())};
  MlaAttentionArgs args;
  args.q_nope = problem.q_nope.View();
  args.q_pe = problem.q_pe.View();
  args.qo_indptr = problem.qo_indptr.data();
  args.pages = problem.cache.Table();
  args.ckv_cache = problem.cache.KView();
  args.kpe_cache = problem.cache.VView();
  args.params = problem.params;
  args.o = out.o.View();
  args.lse = out.lse.data();
  args.accumulation = accumulation;
  MlaAttention(args);
  return out;
}

DenseAttentionResult MlaOracle(const MlaProblem& problem) {
  const int64_t rows = problem.qo_indptr.back();
  std::vector<double> q(rows * kHeads * (kLatent + kRope));
  for (int64_t t = 0; t < rows; ++t) {
    for (int32_t h = 0; h < kHeads; ++h) {
      double* row = &q[(t * kHeads + h) * (kLatent + kRope)];
      for (int32_t d = 0; d < kLatent; ++d) row[d] = problem.q_nope.At(t, h, d);
      for (int32_t d = 0; d < kRope; ++d) row[kLatent + d] = problem.q_pe.At(t, h, d);
    }
  }
  const PagedCache& cache = problem.cache;
  const double ckv_scale = problem.params.k_scale;
  const double kpe_scale = problem.params.v_scale;
  return DenseAttention(
      q, kHeads, 1, kLatent + kRope, kLatent, problem.qo_indptr, cache.spec().kv_lens,
      problem.params,
      [&](size_t b, int64_t t, int32_t, int32_t d) {
        return d < kLatent ? cache.K(b, t, 0, d) * ckv_scale : cache.V(b, t, 0, d - kLatent) * kpe_scale;
      },
      [&](size_t b, int64_t t, int32_t, int32_t d) { return cache.K(b, t, 0, d) * ckv_scale; });
}

void ExpectMlaMatches(const MlaOutput& out, const DenseAttentionResult& expected, double atol,
                      double rtol) {
  int failures = 0;
  for (int64_t t = 0; t < out.o.num_tokens; ++t) {
    for (int32_t h = 0; h < kHeads; ++h) {
      const double want_lse = expected.lse[t * kHeads + h];
      const float lse = out.lse[t * kHeads + h];
      if (std::isinf(want_lse)) {
        EXPECT_EQ(lse, -std::numeric_limits<float>::infinity());
      } else {
        EXPECT_NEAR(lse, want_lse, atol + rtol * std::fabs(want_lse)) << t << " " << h;
      }
      for (int32_t d = 0; d < kLatent; ++d) {
        const double got = out.o.At(t, h, d);
        const double want = expected.o[(t * kHeads + h) * kLatent + d];
        if (!(std::fabs(got - want) <= atol + rtol * std::fabs(want)) && ++failures <= 10) {
          ADD_FAILURE() << "o[" << t << "][" << h << "][" << d << "] = " << got << ", want "
                        << want;
        }
      }
    }
  }
}

class MlaPageSize : public ::testing::TestWithParam<int> {};

TEST_P(MlaPageSize, DecodeMatchesDenseFormula) {
  const int32_t page = GetParam();
  MlaProblem problem = MakeMla(page, DType::kBFloat16, {0, 1, page, page + 1, 300},
                               {1, 1, 1, 1, 1}, AttentionParams{}, 11 + page);
  const DenseAttentionResult expected = MlaOracle(problem);
  ExpectMlaMatches(RunMla(problem, Accumulation::kFloat64), expected, 1e-6, 1e-6);
  ExpectMlaMatches(RunMla(problem, Accumulation::kFloat32), expected, 2e-5, 2e-5);
}

TEST_P(MlaPageSize, CausalPrefillMatchesDenseFormula) {
  const int32_t page = GetParam();
  AttentionParams params;
  params.causal = true;
  MlaProblem problem = MakeMla(page, DType::kBFloat16, {90, 12, 5}, {20, 12, 0}, params, 3 + page);
  const DenseAttentionResult expected = MlaOracle(problem);
  ExpectMlaMatches(RunMla(problem, Accumulation::kFloat64), expected, 1e-6, 1e-6);
  ExpectMlaMatches(RunMla(problem, Accumulation::kFloat32), expected, 2e-5, 2e-5);
}

INSTANTIATE_TEST_SUITE_P(Pages, MlaPageSize, ::testing::Values(1, 16, 64));

TEST(MlaAttention, Fp8CacheDequantisesCkvAndKpeWithTheirOwnScales) {
  AttentionParams params;
  params.k_scale = 0.5f;   // ckv
  params.v_scale = 4.0f;   // kpe
  MlaProblem problem = MakeMla(16, DType::kFloat8E4M3, {70, 2}, {3, 1}, params, 5);
  const DenseAttentionResult expected = MlaOracle(problem);
  ExpectMlaMatches(RunMla(problem, Accumulation::kFloat64), expected, 2e-6, 1e-6);
  ExpectMlaMatches(RunMla(problem, Accumulation::kFloat32), expected, 5e-5, 2e-5);
}

TEST(MlaAttention, SoftCapAndWindowApplyAsForMha) {
  AttentionParams params;
  params.causal = true;
  params.window_left = 10;
  params.logits_soft_cap = 3.0f;
  MlaProblem problem = MakeMla(16, DType::kBFloat16, {60}, {7}, params, 9);
  ExpectMlaMatches(RunMla(problem, Accumulation::kFloat64), MlaOracle(problem), 1e-6, 1e-6);
}

TEST(MlaAttention, ManyHeadsSplitAcrossTasksMatchFormula) {
  // 128 heads x 3 rows is several row chunks of one request.
  AttentionParams params;
  params.causal = true;
  MlaProblem problem = MakeMla(64, DType::kBFloat16, {130}, {3}, params, 21);
  // Widen q to 128 heads by rebuilding it; the oracle reads whatever the problem holds.
  std::mt19937 rng(4);
  problem.q_nope = HostTensor::Random(DType::kBFloat16, 3, 128, kLatent, rng, 2.0);
  problem.q_pe = HostTensor::Random(DType::kBFloat16, 3, 128, kRope, rng, 2.0);
  MlaAttentionArgs args;
  HostTensor o = HostTensor::Poisoned(DType::kFloat32, 3, 128, kLatent);
  std::vector<float> lse(3 * 128);
  args.q_nope = problem.q_nope.View();
  args.q_pe = problem.q_pe.View();
  args.qo_indptr = problem.qo_indptr.data();
  args.pages = problem.cache.Table();
  args.ckv_cache = problem.cache.KView();
  args.kpe_cache = problem.cache.VView();
  args.params = problem.params;
  args.o = o.View();
  args.lse = lse.data();
  args.accumulation = Accumulation::kFloat64;
  MlaAttention(args);
  // Head h of row t against a direct sum.
  for (int64_t t = 0; t < 3; ++t) {
    for (int32_t h = 0; h < 128; h += 9) {
      const int64_t visible = 130 - 3 + t + 1;
      std::vector<double> scores(visible);
      double max_score = -std::numeric_limits<double>::infinity();
      for (int64_t k = 0; k < visible; ++k) {
        double dot = 0;
        for (int32_t d = 0; d < kLatent; ++d)
          dot += problem.q_nope.At(t, h, d) * problem.cache.K(0, k, 0, d);
        for (int32_t d = 0; d < kRope; ++d)
          dot += problem.q_pe.At(t, h, d) * problem.cache.V(0, k, 0, d);
        scores[k] = dot * problem.params.sm_scale;
        max_score = std::max(max_score, scores[k]);
      }
      double sum = 0;
      for (double s : scores) sum += std::exp(s - max_score);
      for (int32_t d = 0; d < kLatent; d += 37) {
        double want = 0;
        for (int64_t k = 0; k < visible; ++k)
          want += std::exp(scores[k] - max_score) / sum * problem.cache.K(0, k, 0, d);
        EXPECT_NEAR(o.At(t, h, d), want, 1e-6) << t << " " << h << " " << d;
      }
      EXPECT_NEAR(lse[t * 128 + h], max_score + std::log(sum), 1e-5);
    }
  }
}

}  // namespace
}  // namespace attnd::reference
