// Division of non-negative ints by a divisor fixed for a kernel launch (a GQA group size, a KV
// head count): one multiply-high and one correction instead of the ~25 instructions of a signed
// integer division by a runtime value. Plain C++ that also compiles as CUDA device code, so a CPU
// unit test checks exactly what the kernel computes (tests/unit/reference/fast_divider_test.cc).
//
// With m = ceil(2^32 / d) (d >= 2), floor(n * m / 2^32) = floor(n / d + n * e / (d * 2^32)) for
// some 0 <= e < d, and the added term is below 1 for n < 2^32: the estimate is the quotient or
// one more. For d = 1, m = 2^32 - 1 gives n - 1 for n >= 1. The remainder's sign and size fix
// either case, so the quotient is exact for every n in [0, 2^31) and d in [1, 2^31).
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define ATTND_DIVIDER_FUNCTION __host__ __device__ __forceinline__
#else
#define ATTND_DIVIDER_FUNCTION inline
#endif

namespace attnd::cuda {

struct FastDivider {
  int32_t divisor;
  uint32_t multiplier;

  // The multiplier for divisor d >= 1 (a kernel's host side computes it once per launch).
  ATTND_DIVIDER_FUNCTION static uint32_t MultiplierOf(int32_t d) {
    return d > 1 ? 0xffffffffu / static_cast<uint32_t>(d) + 1u : 0xffffffffu;
  }

  ATTND_DIVIDER_FUNCTION explicit FastDivider(int32_t d) : divisor(d), multiplier(MultiplierOf(d)) {}
  ATTND_DIVIDER_FUNCTION FastDivider(int32_t d, uint32_t m) : divisor(d), multiplier(m) {}

  // n / divisor for 0 <= n < 2^31.
  ATTND_DIVIDER_FUNCTION int32_t Divide(int32_t n) const {
    int32_t quotient =
        static_cast<int32_t>((static_cast<uint64_t>(static_cast<uint32_t>(n)) * multiplier) >> 32);
    const int32_t remainder = n - quotient * divisor;
    if (remainder < 0) {
      --quotient;
    } else if (remainder >= divisor) {
      ++quotient;
    }
    return quotient;
  }
};

}  // namespace attnd::cuda

#undef ATTND_DIVIDER_FUNCTION
