#include "attnd/kernels/dtype.h"

namespace attnd {

const char* DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kFloat16:
      return "float16";
    case DType::kBFloat16:
      return "bfloat16";
    case DType::kFloat8E4M3:
      return "float8_e4m3";
    case DType::kFloat32:
      return "float32";
  }
  return "unknown";
}

float HalfToFloat(uint16_t bits) {
  const uint32_t sign = uint32_t{bits & 0x8000u} << 16;
  const uint32_t exponent = (bits >> 10) & 0x1fu;
  const uint32_t mantissa = bits & 0x3ffu;
  if (exponent == 0x1f) return BitsToFloat(sign | 0x7f800000u | (mantissa << 13));
  if (exponent != 0) return BitsToFloat(sign | ((exponent + 112) << 23) | (mantissa << 13));
  // Subnormal or zero: mantissa * 2^-24, exact in float.
  const float magnitude = std::ldexp(static_cast<float>(mantissa), -24);
  return sign ? -magnitude : magnitude;
}

uint16_t FloatToHalf(float value) {
  const uint32_t bits = FloatBits(value);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t magnitude_bits = bits & 0x7fffffffu;
  if (magnitude_bits > 0x7f800000u) return sign | 0x7e00u;  // NaN
  const float magnitude = BitsToFloat(magnitude_bits);
  if (magnitude >= 65520.0f) return sign | 0x7c00u;  // rounds to infinity
  if (magnitude < 6.103515625e-05f) {
    // Subnormal half: a multiple of 2^-24; nearbyint rounds half to even.
    return sign | static_cast<uint16_t>(std::nearbyint(magnitude * 16777216.0f));
  }
  // Normal: drop 13 mantissa bits with round to nearest even, carrying into the exponent.
  uint32_t rounded = magnitude_bits + 0xfffu + ((magnitude_bits >> 13) & 1u);
  return sign | static_cast<uint16_t>((rounded >> 13) - (112u << 10));
}

float Fp8E4M3ToFloat(uint8_t bits) {
  const bool negative = bits & 0x80u;
  const int exponent = (bits >> 3) & 0xf;
  const int mantissa = bits & 0x7;
  float magnitude;
  if (exponent == 0xf && mantissa == 0x7) {
    magnitude = NAN;
  } else if (exponent == 0) {
    magnitude = std::ldexp(static_cast<float>(mantissa), -9);
  } else {
    magnitude = std::ldexp(static_cast<float>(8 + mantissa), exponent - 10);
  }
  return negative ? -magnitude : magnitude;
}

// Integer-only: the append path encodes every cached element, and the frexp/ldexp/nearbyint
// version spent most of its time in libm.
uint8_t FloatToFp8E4M3(float value) {
  const uint32_t bits = FloatBits(value);
  const uint8_t sign = static_cast<uint8_t>((bits >> 24) & 0x80u);
  const uint32_t magnitude = bits & 0x7fffffffu;
  if (magnitude > 0x7f800000u) return 0x7f;            // NaN
  if (magnitude >= 0x43e00000u) return sign | 0x7e;    // >= 448, infinity included: saturate
  if (magnitude >= 0x3c800000u) {
    // Normal E4M3 (>= 2^-6): keep 3 of the 23 mantissa bits, rounding to nearest even; a carry
    // moves into the exponent, and nothing below 448 rounds past 0x7e.
    const uint32_t rounded = magnitude + 0x7ffffu + ((magnitude >> 20) & 1u);
    return sign | static_cast<uint8_t>((rounded >> 20) - (120u << 3));
  }
  // Subnormal E4M3: the value in units of 2^-9, rounded to nearest even (8 units is the
  // smallest normal, whose code is also 8).
  const uint32_t exponent = magnitude >> 23;
  if (exponent == 0) return sign;  // float subnormals are far below half a unit
  const uint32_t significand = (magnitude & 0x7fffffu) | 0x800000u;  // value = sig * 2^(e-150)
  const uint32_t shift = 141 - exponent;                              // >= 21 here
  if (shift > 24) return sign;                                        // below half a unit
  const uint32_t units = significand >> shift;
  const uint32_t remainder = significand & ((1u << shift) - 1);
  const uint32_t half = 1u << (shift - 1);
  const bool round_up = remainder > half || (remainder == half && (units & 1u));
  return sign | static_cast<uint8_t>(units + (round_up ? 1 : 0));
}

}  // namespace attnd
