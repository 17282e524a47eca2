// The Hopper prefill kernel's division by its GQA group and KV head count
// (kernels/cuda/fast_divider.h, compiled here for the CPU) against plain integer division: every
// numerator below 2^18 for small divisors, the ends of the range, and random pairs.
#include "fast_divider.h"

#include <cstdint>
#include <random>

#include "gtest/gtest.h"

namespace attnd::cuda {
namespace {

TEST(FastDividerTest, MatchesIntegerDivisionForEveryNumeratorBelow2To18) {
  for (int32_t d = 1; d <= 130; ++d) {
    const FastDivider divider(d);
    for (int32_t n = 0; n < (1 << 18); ++n) {
      ASSERT_EQ(divider.Divide(n), n / d) << n << " / " << d;
    }
  }
}

TEST(FastDividerTest, MatchesIntegerDivisionAtTheEndsAndOnRandomPairs) {
  const int32_t max = INT32_MAX;
  for (int32_t d : {1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 31, 64, 100, 128, 1000, 65535, 65536, 1 << 30, max - 1, max}) {
    const FastDivider divider(d);
    for (int32_t n : {0, 1, d - 1, d, max - 2, max - 1, max}) {
      if (n < 0) continue;
      ASSERT_EQ(divider.Divide(n), n / d) << n << " / " << d;
    }
    // Near every multiple of d close to the top of the range.
    for (int64_t k = static_cast<int64_t>(max) / d; k > static_cast<int64_t>(max) / d - 64 && k > 0; --k) {
      for (int64_t offset : {-1, 0, 1}) {
        const int64_t n = k * d + offset;
        if (n < 0 || n > max) continue;
        ASSERT_EQ(divider.Divide(static_cast<int32_t>(n)), static_cast<int32_t>(n / d)) << n << " / " << d;
      }
    }
  }
  std::mt19937 rng(7);
  std::uniform_int_distribution<int32_t> numerator(0, max);
  std::uniform_int_distribution<int32_t> divisor(1, max);
  for (int i = 0; i < 2000000; ++i) {
    const int32_t n = numerator(rng);
    const int32_t d = i % 2 == 0 ? divisor(rng) : 1 + divisor(rng) % 4096;
    ASSERT_EQ(FastDivider(d).Divide(n), n / d) << n << " / " << d;
  }
}

}  // namespace
}  // namespace attnd::cuda
