// Host conversions of attnd/kernels/dtype.h: exact decoding, round-to-nearest-even encoding,
// FP8 saturation, and the reference's fast row conversions (convert.h) agreeing code by code.
#include "attnd/kernels/dtype.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "reference/convert.h"
#include "reference/tile_kernels.h"

namespace attnd {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

bool SameFloat(float a, float b) {
  return (std::isnan(a) && std::isnan(b)) || FloatBits(a) == FloatBits(b);
}

// Brute-force nearest-even encoder over a table of every finite code's value: independent of
// the bit manipulation under test. `values[code]` for codes of one sign, ascending.
template <typename Decode>
int NearestEvenCode(double x, int num_codes, Decode decode) {
  int best = 0;
  double best_distance = std::numeric_limits<double>::infinity();
  for (int code = 0; code < num_codes; ++code) {
    const double distance = std::fabs(x - decode(code));
    if (distance < best_distance || (distance == best_distance && code % 2 == 0)) {
      best = code;
      best_distance = distance;
    }
  }
  return best;
}

// ---- FP8 E4M3 -------------------------------------------------------------------------------

TEST(Fp8E4M3, EveryCodeDecodesAndReencodesToItselfExceptNaN) {
  for (int code = 0; code < 256; ++code) {
    const float value = Fp8E4M3ToFloat(static_cast<uint8_t>(code));
    if ((code & 0x7f) == 0x7f) {
      EXPECT_TRUE(std::isnan(value)) << code;
      EXPECT_EQ(FloatToFp8E4M3(value) & 0x7f, 0x7f) << "NaN encodes as NaN";
      continue;
    }
    ASSERT_FALSE(std::isnan(value)) << code;
    EXPECT_EQ(FloatToFp8E4M3(value), code) << "value " << value;
  }
}

TEST(Fp8E4M3, DecodesKnownValues) {
  EXPECT_EQ(Fp8E4M3ToFloat(0x00), 0.0f);
  EXPECT_TRUE(std::signbit(Fp8E4M3ToFloat(0x80)));
  EXPECT_EQ(Fp8E4M3ToFloat(0x01), std::ldexp(1.0f, -9));  // smallest subnormal
  EXPECT_EQ(Fp8E4M3ToFloat(0x07), 7 * std::ldexp(1.0f, -9));
  EXPECT_EQ(Fp8E4M3ToFloat(0x08), std::ldexp(1.0f, -6));  // smallest normal
  EXPECT_EQ(Fp8E4M3ToFloat(0x38), 1.0f);
  EXPECT_EQ(Fp8E4M3ToFloat(0x3c), 1.5f);
  EXPECT_EQ(Fp8E4M3ToFloat(0x7e), 448.0f);
  EXPECT_EQ(Fp8E4M3ToFloat(0xfe), -448.0f);
  EXPECT_EQ(Fp8E4M3ToFloat(0x77), 240.0f);
}

TEST(Fp8E4M3, FlushesValuesBelowHalfTheSmallestSubnormalToSignedZero) {
  const float half_unit = std::ldexp(1.0f, -10);
  EXPECT_EQ(FloatToFp8E4M3(half_unit), 0x00);  // tie with 0: even
  EXPECT_EQ(FloatToFp8E4M3(std::nextafter(half_unit, 1.0f)), 0x01);
  EXPECT_EQ(FloatToFp8E4M3(std::nextafter(half_unit, 0.0f)), 0x00);
  EXPECT_EQ(FloatToFp8E4M3(-1e-30f), 0x80);
  EXPECT_EQ(FloatToFp8E4M3(std::numeric_limits<float>::denorm_min()), 0x00);
  EXPECT_EQ(FloatToFp8E4M3(-0.0f), 0x80);
}

TEST(Fp8E4M3, SaturatesLargeAndInfiniteValuesToPlusMinus448) {
  for (const float big : {448.0f, 449.0f, 464.0f, 479.0f, 480.0f, 1000.0f, 1e30f, kInf}) {
    EXPECT_EQ(FloatToFp8E4M3(big), 0x7e) << big;
    EXPECT_EQ(FloatToFp8E4M3(-big), 0xfe) << -big;
  }
  EXPECT_EQ(FloatToFp8E4M3(std::numeric_limits<float>::quiet_NaN()) & 0x7f, 0x7f);
}

TEST(Fp8E4M3, RoundsTiesToEvenBetweenEveryPairOfNeighbours) {
  for (int code = 0; code < 0x7e; ++code) {
    const float low = Fp8E4M3ToFloat(static_cast<uint8_t>(code));
    const float high = Fp8E4M3ToFloat(static_cast<uint8_t>(code + 1));
    const float middle = (low + high) / 2;  // exact in float
    const int even = code % 2 == 0 ? code : code + 1;
    EXPECT_EQ(FloatToFp8E4M3(middle), even) << "tie " << middle;
    EXPECT_EQ(FloatToFp8E4M3(-middle), 0x80 | even) << "tie " << -middle;
    EXPECT_EQ(FloatToFp8E4M3(std::nextafter(middle, 0.0f)), code) << middle;
    EXPECT_EQ(FloatToFp8E4M3(std::nextafter(middle, kInf)), code + 1) << middle;
  }
}

TEST(Fp8E4M3, EncodesRandomValuesToTheNearestCode) {
  std::mt19937 rng(5);
  // From far below the smallest subnormal (2^-9) to past the saturation point (448 < 2^9).
  std::uniform_real_distribution<double> log_magnitude(-14, 9.5);
  for (int i = 0; i < 100000; ++i) {
    const float x = static_cast<float>(std::exp2(log_magnitude(rng))) * (i % 2 ? -1 : 1);
    int want = NearestEvenCode(std::fabs(x), 0x7f, [](int code) {
      return double{Fp8E4M3ToFloat(static_cast<uint8_t>(code))};
    });
    if (x < 0) want |= 0x80;
    ASSERT_EQ(FloatToFp8E4M3(x), want) << x;
  }
}

// ---- float16 --------------------------------------------------------------------------------

TEST(Float16, EveryFiniteCodeRoundTrips) {
  for (int code = 0; code < 65536; ++code) {
    const float value = HalfToFloat(static_cast<uint16_t>(code));
    if ((code & 0x7c00) == 0x7c00 && (code & 0x3ff) != 0) {
      EXPECT_TRUE(std::isnan(value));
      EXPECT_TRUE(std::isnan(HalfToFloat(FloatToHalf(value))));
      continue;
    }
    ASSERT_EQ(FloatToHalf(value), code) << value;
  }
}

TEST(Float16, RoundsTiesToEvenBetweenEveryPairOfNeighbours) {
  for (int code = 0; code < 0x7bff; ++code) {
    const float low = HalfToFloat(static_cast<uint16_t>(code));
    const float high = HalfToFloat(static_cast<uint16_t>(code + 1));
    const float middle = (low + high) / 2;
    const int even = code % 2 == 0 ? code : code + 1;
    ASSERT_EQ(FloatToHalf(middle), even) << middle;
    ASSERT_EQ(FloatToHalf(-middle), 0x8000 | even) << middle;
    ASSERT_EQ(FloatToHalf(std::nextafter(middle, 0.0f)), code) << middle;
    ASSERT_EQ(FloatToHalf(std::nextafter(middle, kInf)), code + 1) << middle;
  }
}

TEST(Float16, SubnormalsAreExactAndRoundToEven) {
  const float tiny = std::ldexp(1.0f, -24);  // smallest subnormal
  EXPECT_EQ(FloatToHalf(tiny), 0x0001);
  EXPECT_EQ(HalfToFloat(0x0001), tiny);
  EXPECT_EQ(HalfToFloat(0x03ff), 1023 * tiny);  // largest subnormal
  EXPECT_EQ(FloatToHalf(tiny / 2), 0x0000);     // tie with 0: even
  EXPECT_EQ(FloatToHalf(-tiny / 2), 0x8000);
  EXPECT_EQ(FloatToHalf(3 * tiny / 2), 0x0002);  // tie between 1 and 2: even
  EXPECT_EQ(FloatToHalf(std::nextafter(tiny / 2, 1.0f)), 0x0001);
  EXPECT_EQ(FloatToHalf(1023.5f * tiny), 0x0400);  // rounds up into the smallest normal
  EXPECT_EQ(FloatToHalf(1e-10f), 0x0000);
}

TEST(Float16, OverflowsToInfinityOnlyPastTheRoundingBoundary) {
  EXPECT_EQ(FloatToHalf(65504.0f), 0x7bff);
  EXPECT_EQ(FloatToHalf(std::nextafter(65520.0f, 0.0f)), 0x7bff);
  EXPECT_EQ(FloatToHalf(65520.0f), 0x7c00);  // tie between max (odd) and 2^16: to "even" inf
  EXPECT_EQ(FloatToHalf(1e6f), 0x7c00);
  EXPECT_EQ(FloatToHalf(-1e6f), 0xfc00);
  EXPECT_EQ(FloatToHalf(kInf), 0x7c00);
  EXPECT_EQ(FloatToHalf(-kInf), 0xfc00);
  EXPECT_TRUE(std::isnan(HalfToFloat(FloatToHalf(std::numeric_limits<float>::quiet_NaN()))));
}

#ifdef __FLT16_MAX__
// The compiler's own _Float16 conversions (IEEE, round to nearest even) as a second opinion.
TEST(Float16, AgreesWithTheCompilersFloat16OnRandomBitPatterns) {
  std::mt19937 rng(17);
  for (int i = 0; i < 2'000'000; ++i) {
    const float x = BitsToFloat(static_cast<uint32_t>(rng()));
    if (std::isnan(x)) continue;
    const _Float16 h = static_cast<_Float16>(x);
    uint16_t bits;
    std::memcpy(&bits, &h, 2);
    ASSERT_EQ(FloatToHalf(x), bits) << x;
  }
}
#endif

// ---- bfloat16 -------------------------------------------------------------------------------

TEST(BFloat16, RoundsTiesToEvenAndToNearest) {
  std::mt19937 rng(23);
  for (int i = 0; i < 200000; ++i) {
    const uint16_t code = static_cast<uint16_t>(rng() % 0x7f7f);  // finite, below max
    const float low = BFloat16ToFloat(code);
    const float high = BFloat16ToFloat(static_cast<uint16_t>(code + 1));
    const float middle = BitsToFloat(FloatBits(low) + 0x8000);  // halfway, exact
    ASSERT_EQ(FloatToBFloat16(middle), code % 2 == 0 ? code : code + 1) << middle;
    ASSERT_EQ(FloatToBFloat16(std::nextafter(middle, 0.0f)), code);
    ASSERT_EQ(FloatToBFloat16(std::nextafter(middle, kInf)), code + 1);
    ASSERT_EQ(FloatToBFloat16(low), code);
    ASSERT_EQ(FloatToBFloat16(high), code + 1);
  }
}

TEST(BFloat16, KeepsInfinityAndNaNAndOverflowsPastMax) {
  EXPECT_EQ(FloatToBFloat16(kInf), 0x7f80);
  EXPECT_EQ(FloatToBFloat16(-kInf), 0xff80);
  EXPECT_TRUE(std::isnan(BFloat16ToFloat(FloatToBFloat16(std::numeric_limits<float>::quiet_NaN()))));
  // A NaN whose payload sits only in the dropped bits must not become infinity.
  EXPECT_TRUE(std::isnan(BFloat16ToFloat(FloatToBFloat16(BitsToFloat(0x7f800001)))));
  EXPECT_EQ(FloatToBFloat16(std::numeric_limits<float>::max()), 0x7f80);
  EXPECT_EQ(FloatToBFloat16(BFloat16ToFloat(0x7f7f)), 0x7f7f);
  EXPECT_EQ(FloatToBFloat16(1.0f), 0x3f80);
}

// ---- Load/Store and the reference's fast paths ----------------------------------------------

TEST(DTypeConversions, StoreThenLoadGivesTheRoundedValueForEveryDtype) {
  const float value = 1.7f;
  for (const DType dtype : {DType::kFloat16, DType::kBFloat16, DType::kFloat8E4M3, DType::kFloat32}) {
    uint8_t storage[8] = {};
    StoreFromFloat(dtype, storage, 1, value);
    const float loaded = LoadAsFloat(dtype, storage, 1);
    const float ulp_fraction = dtype == DType::kFloat32      ? 0
                               : dtype == DType::kFloat16    ? std::ldexp(1.0f, -11)
                               : dtype == DType::kBFloat16   ? std::ldexp(1.0f, -8)
                                                             : std::ldexp(1.0f, -4);
    EXPECT_NEAR(loaded, value, value * ulp_fraction) << DTypeName(dtype);
    for (int i = 0; i < DTypeBytes(dtype); ++i) EXPECT_EQ(storage[i], 0) << "element 0 untouched";
  }
}

// Both the CPU's chosen kernels and the portable ones decode exactly what dtype.h decodes.
template <typename T>
std::vector<const reference::TileKernels<T>*> KernelVariants();
template <>
std::vector<const reference::TileKernels<float>*> KernelVariants<float>() {
  return {&reference::FloatTileKernels(), &reference::GenericFloatTileKernels()};
}
template <>
std::vector<const reference::TileKernels<double>*> KernelVariants<double>() {
  return {&reference::DoubleTileKernels(), &reference::GenericDoubleTileKernels()};
}

template <typename T>
void ExpectConvertRowDecodesEveryCode(DType dtype) {
  const int codes = dtype == DType::kFloat8E4M3 ? 256 : 65536;
  std::vector<uint8_t> bytes(codes * DTypeBytes(dtype));
  for (int code = 0; code < codes; ++code) {
    if (DTypeBytes(dtype) == 1) {
      bytes[code] = static_cast<uint8_t>(code);
    } else {
      const uint16_t bits = static_cast<uint16_t>(code);
      std::memcpy(&bytes[code * 2], &bits, 2);
    }
  }
  for (const auto* kernels : KernelVariants<T>()) {
    // An odd count and offset exercise the vector body and the scalar tail.
    std::vector<T> out(codes + 1, T{-7});
    kernels->convert_row(dtype, bytes.data(), codes - 1, T{1}, out.data(),
                         reference::Fp8E4M3Table().data());
    for (int code = 0; code < codes - 1; ++code) {
      const float want = LoadAsFloat(dtype, bytes.data(), code);
      ASSERT_TRUE((std::isnan(want) && std::isnan(out[code])) ||
                  (out[code] == T{want} && std::signbit(out[code]) == std::signbit(want)))
          << kernels->isa << " " << DTypeName(dtype) << " code " << code;
    }
    EXPECT_EQ(out[codes - 1], T{-7}) << "wrote past the row";
  }
}

TEST(ReferenceConvert, ConvertRowDecodesEveryCodeExactlyInEveryVariant) {
  for (const DType dtype : {DType::kFloat16, DType::kBFloat16, DType::kFloat8E4M3}) {
    ExpectConvertRowDecodesEveryCode<float>(dtype);
    ExpectConvertRowDecodesEveryCode<double>(dtype);
  }
}

TEST(ReferenceConvert, ConvertRowMultipliesByTheScaleInTheAccumulationType) {
  std::mt19937 rng(3);
  for (const DType dtype : {DType::kFloat16, DType::kBFloat16, DType::kFloat8E4M3, DType::kFloat32}) {
    std::vector<uint8_t> bytes(37 * DTypeBytes(dtype));
    for (uint8_t& byte : bytes) byte = static_cast<uint8_t>(rng());
    std::vector<double> out_double(37);
    reference::ConvertRow<double>(dtype, bytes.data(), 37, 0.1, out_double.data());
    std::vector<float> out_float(37);
    reference::ConvertRow<float>(dtype, bytes.data(), 37, 0.1f, out_float.data());
    for (int i = 0; i < 37; ++i) {
      const float loaded = LoadAsFloat(dtype, bytes.data(), i);
      if (std::isnan(loaded)) continue;
      EXPECT_EQ(out_double[i], double{loaded} * 0.1) << i;
      EXPECT_EQ(out_float[i], loaded * 0.1f) << i;
    }
  }
}

TEST(ReferenceConvert, Fp8TableMatchesDecodeOnEveryCode) {
  for (int code = 0; code < 256; ++code) {
    EXPECT_TRUE(SameFloat(reference::Fp8E4M3Table()[code],
                          Fp8E4M3ToFloat(static_cast<uint8_t>(code))))
        << code;
  }
}

}  // namespace
}  // namespace attnd
