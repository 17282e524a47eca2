// The CPU attention inner loops (reference/tile_kernels.h): the CPU's chosen variant and the
// portable one both compute the plain sums, and a row's result does not depend on the rows
// batched with it.
#include "reference/tile_kernels.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

namespace attnd::reference {
namespace {

template <typename T>
std::vector<const TileKernels<T>*> Variants();
template <>
std::vector<const TileKernels<float>*> Variants<float>() {
  return {&FloatTileKernels(), &GenericFloatTileKernels()};
}
template <>
std::vector<const TileKernels<double>*> Variants<double>() {
  return {&DoubleTileKernels(), &GenericDoubleTileKernels()};
}

template <typename T>
std::vector<T> RandomValues(size_t count, std::mt19937& rng) {
  std::uniform_real_distribution<double> uniform(-1, 1);
  std::vector<T> values(count);
  for (T& value : values) value = static_cast<T>(uniform(rng));
  return values;
}

template <typename T>
class TileKernelsTest : public ::testing::Test {};
using Precisions = ::testing::Types<float, double>;
TYPED_TEST_SUITE(TileKernelsTest, Precisions);

TYPED_TEST(TileKernelsTest, TransposeKeysMovesEveryElement) {
  using T = TypeParam;
  std::mt19937 rng(1);
  for (const int64_t keys : {1, 7, 8, 13, 128}) {
    for (const int32_t dim : {3, 8, 64, 67}) {
      const std::vector<T> rows = RandomValues<T>(keys * (dim + 2), rng);
      for (const auto* kernels : Variants<T>()) {
        std::vector<T> kt(dim * (keys + 5), T{-9});
        kernels->transpose_keys(rows.data(), dim + 2, keys, dim, kt.data(), keys + 5);
        for (int32_t d = 0; d < dim; ++d) {
          for (int64_t k = 0; k < keys + 5; ++k) {
            ASSERT_EQ(kt[d * (keys + 5) + k], k < keys ? rows[k * (dim + 2) + d] : T{-9})
                << kernels->isa << " keys " << keys << " dim " << dim;
          }
        }
      }
    }
  }
}

TYPED_TEST(TileKernelsTest, ScoreBlockIsTheDotProductOfEachRowAndKey) {
  using T = TypeParam;
  std::mt19937 rng(2);
  const int32_t dim = 72;
  const int64_t stride = 64 + 16;
  const std::vector<T> kt = RandomValues<T>(dim * stride, rng);
  const std::vector<T> q = RandomValues<T>(kBlockRows * dim, rng);
  const T tolerance = std::is_same_v<T, float> ? 2e-5 : 1e-12;
  for (const auto* kernels : Variants<T>()) {
    std::vector<T> scores(kBlockRows * 64, T{0});
    const T* q_rows[kBlockRows];
    T* score_rows[kBlockRows];
    for (int r = 0; r < kBlockRows; ++r) {
      q_rows[r] = q.data() + r * dim;
      score_rows[r] = scores.data() + r * 64;
    }
    kernels->score_block(q_rows, dim, kt.data(), stride, 16, 64, score_rows);
    for (int r = 0; r < kBlockRows; ++r) {
      for (int64_t j = 0; j < 64; ++j) {
        double want = 0;
        for (int32_t d = 0; d < dim; ++d) want += double{q[r * dim + d]} * kt[d * stride + j];
        if (j < 16) {
          EXPECT_EQ(scores[r * 64 + j], T{0}) << "outside [key_begin, key_end)";
        } else {
          EXPECT_NEAR(scores[r * 64 + j], want, tolerance) << kernels->isa << " " << r << " " << j;
        }
      }
    }
    // Row 2 alone (the others repeating row 2) scores bit for bit as it did in the block.
    std::vector<T> alone(kBlockRows * 64, T{0});
    for (int r = 0; r < kBlockRows; ++r) {
      q_rows[r] = q.data() + 2 * dim;
      score_rows[r] = alone.data() + r * 64;
    }
    kernels->score_block(q_rows, dim, kt.data(), stride, 16, 64, score_rows);
    for (int64_t j = 16; j < 64; ++j) EXPECT_EQ(alone[j], scores[2 * 64 + j]) << kernels->isa;
  }
}

TYPED_TEST(TileKernelsTest, AccumulateBlockAddsWeightedValueRowsInOrder) {
  using T = TypeParam;
  std::mt19937 rng(3);
  const int32_t v_dim = 48;
  const int64_t keys = 40;
  const std::vector<T> v = RandomValues<T>(keys * v_dim, rng);
  const std::vector<T> p = RandomValues<T>(kBlockRows * keys, rng);
  const std::vector<T> start = RandomValues<T>(kBlockRows * v_dim, rng);
  const T tolerance = std::is_same_v<T, float> ? 1e-5 : 1e-12;
  for (const auto* kernels : Variants<T>()) {
    std::vector<T> block = start;
    std::vector<T> single = start;
    const T* p_rows[kBlockRows];
    T* block_rows[kBlockRows];
    T* single_rows[kBlockRows];
    for (int r = 0; r < kBlockRows; ++r) {
      p_rows[r] = p.data() + r * keys;
      block_rows[r] = block.data() + r * v_dim;
      single_rows[r] = single.data() + r * v_dim;
    }
    kernels->accumulate_block(kBlockRows, p_rows, v.data(), v_dim, 3, keys, v_dim, block_rows);
    for (int r = 0; r < kBlockRows; ++r) {
      kernels->accumulate_block(1, p_rows + r, v.data(), v_dim, 3, keys, v_dim, single_rows + r);
    }
    for (int r = 0; r < kBlockRows; ++r) {
      for (int32_t d = 0; d < v_dim; ++d) {
        double want = start[r * v_dim + d];
        for (int64_t j = 3; j < keys; ++j) want += double{p[r * keys + j]} * v[j * v_dim + d];
        EXPECT_NEAR(block[r * v_dim + d], want, tolerance) << kernels->isa;
        EXPECT_EQ(single[r * v_dim + d], block[r * v_dim + d]) << "block-independent";
      }
    }
  }
}

TYPED_TEST(TileKernelsTest, ScaleScoresScalesCapsAndReturnsTheMaximumOfTheRangeOnly) {
  using T = TypeParam;
  std::mt19937 rng(4);
  const std::vector<T> raw = RandomValues<T>(40, rng);
  for (const auto* kernels : Variants<T>()) {
    for (const T cap : {T{0}, T{0.3}}) {
      std::vector<T> scores = raw;
      const T max_score = kernels->scale_scores(scores.data(), 3, 37, T{2.5}, cap);
      T want_max = -INFINITY;
      for (int j = 0; j < 40; ++j) {
        if (j < 3 || j >= 37) {
          EXPECT_EQ(scores[j], raw[j]) << "outside the range";
          continue;
        }
        const double scaled = 2.5 * double{raw[j]};
        const double want = cap > 0 ? double{cap} * std::tanh(scaled / double{cap}) : scaled;
        EXPECT_NEAR(scores[j], want, (std::is_same_v<T, float> ? 1e-6 : 1e-15)) << kernels->isa;
        want_max = std::max(want_max, scores[j]);
      }
      EXPECT_EQ(max_score, want_max) << kernels->isa;
    }
    T empty = 5;
    EXPECT_EQ(kernels->scale_scores(&empty, 0, 0, T{1}, T{0}), -INFINITY);
  }
}

TYPED_TEST(TileKernelsTest, ExponentiateMatchesExpAndReturnsTheSum) {
  using T = TypeParam;
  std::vector<T> scores;
  for (int i = 0; i <= 400; ++i) scores.push_back(static_cast<T>(-0.25 * i));  // 0 .. -100
  scores.push_back(-INFINITY);
  scores.push_back(static_cast<T>(-1e-30));
  const T max_score = 0.5;
  for (const auto* kernels : Variants<T>()) {
    std::vector<T> probs(scores.size(), T{-1});
    const T sum = kernels->exponentiate(scores.data(), 1, static_cast<int64_t>(scores.size()),
                                        max_score, probs.data());
    EXPECT_EQ(probs[0], T{-1}) << "outside the range";
    double want_sum = 0;
    for (size_t j = 1; j < scores.size(); ++j) {
      const double want = std::exp(double{scores[j]} - double{max_score});
      want_sum += want;
      if (want < std::numeric_limits<float>::min()) {
        // Below float's normal range the vector exp gives 0.
        EXPECT_LE(probs[j], std::numeric_limits<float>::min()) << kernels->isa << " " << scores[j];
      } else {
        EXPECT_NEAR(probs[j], want, (want * (std::is_same_v<T, float> ? 3e-7 : 1e-15)))
            << kernels->isa << " " << scores[j];
      }
    }
    EXPECT_NEAR(sum, want_sum, (want_sum * (std::is_same_v<T, float> ? 1e-6 : 1e-14)));
  }
}

#if defined(__x86_64__) && defined(__GNUC__)
TEST(TileKernels, UsesTheAvx2VariantWhereTheCpuHasIt) {
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                    __builtin_cpu_supports("f16c");
  EXPECT_STREQ(FloatTileKernels().isa, avx2 ? "avx2" : "generic");
  EXPECT_STREQ(DoubleTileKernels().isa, avx2 ? "avx2" : "generic");
}
#endif

}  // namespace
}  // namespace attnd::reference
