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

uint8_t FloatToFp8E4M3(float value) {
  if (std::isnan(value)) return 0x7f;
  const uint8_t sign = std::signbit(value) ? 0x80 : 0x00;
  const float magnitude = std::fabs(value);
  if (magnitude >= kFp8E4M3Max) return sign | 0x7e;
  if (magnitude < 0.015625f) {
    // Subnormal: a multiple of 2^-9; 8 * 2^-9 is the smallest normal, whose code is also 8.
    return sign | static_cast<uint8_t>(std::nearbyint(magnitude * 512.0f));
  }
  int exponent;
  std::frexp(magnitude, &exponent);  // magnitude = f * 2^exponent, f in [0.5, 1)
  int unbiased = exponent - 1;
  int significand = static_cast<int>(std::nearbyint(std::ldexp(magnitude, 3 - unbiased)));
  if (significand == 16) {
    significand = 8;
    ++unbiased;
  }
  const int code = ((unbiased + 7) << 3) | (significand - 8);
  return sign | static_cast<uint8_t>(code > 0x7e ? 0x7e : code);
}

}  // namespace attnd
