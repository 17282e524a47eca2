// Element types and exact host conversions between them and float.
//
// The conversions round to nearest even, as the GPU's conversion instructions do, so the CPU
// reference and the CUDA kernels store identical bytes for identical float inputs.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string_view>

namespace attnd {

// Values match attnd.v1.DType on the wire.
enum class DType : int32_t {
  kFloat16 = 1,
  kBFloat16 = 2,
  kFloat8E4M3 = 3,  // OCP E4M3 ("fn"): finite only, max 448, 0x7F/0xFF are NaN.
  kFloat32 = 4,
};

constexpr int DTypeBytes(DType dtype) {
  switch (dtype) {
    case DType::kFloat16:
    case DType::kBFloat16:
      return 2;
    case DType::kFloat8E4M3:
      return 1;
    case DType::kFloat32:
      return 4;
  }
  return 0;
}

const char* DTypeName(DType dtype);

// Largest finite E4M3 value; stores saturate to it.
inline constexpr float kFp8E4M3Max = 448.0f;

inline uint32_t FloatBits(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  return bits;
}

inline float BitsToFloat(uint32_t bits) {
  float value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
}

inline float BFloat16ToFloat(uint16_t bits) { return BitsToFloat(uint32_t{bits} << 16); }

inline uint16_t FloatToBFloat16(float value) {
  uint32_t bits = FloatBits(value);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);  // quiet NaN
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

float HalfToFloat(uint16_t bits);
uint16_t FloatToHalf(float value);  // round to nearest even; overflow gives +-inf
float Fp8E4M3ToFloat(uint8_t bits);
uint8_t FloatToFp8E4M3(float value);  // round to nearest even, saturating to +-448; NaN -> 0x7F

// Reads element `index` of a dense array of `dtype` as float.
inline float LoadAsFloat(DType dtype, const void* base, int64_t index) {
  switch (dtype) {
    case DType::kFloat16:
      return HalfToFloat(static_cast<const uint16_t*>(base)[index]);
    case DType::kBFloat16:
      return BFloat16ToFloat(static_cast<const uint16_t*>(base)[index]);
    case DType::kFloat8E4M3:
      return Fp8E4M3ToFloat(static_cast<const uint8_t*>(base)[index]);
    case DType::kFloat32:
      return static_cast<const float*>(base)[index];
  }
  return NAN;
}

// Writes `value` rounded to `dtype` into element `index` of a dense array.
inline void StoreFromFloat(DType dtype, void* base, int64_t index, float value) {
  switch (dtype) {
    case DType::kFloat16:
      static_cast<uint16_t*>(base)[index] = FloatToHalf(value);
      return;
    case DType::kBFloat16:
      static_cast<uint16_t*>(base)[index] = FloatToBFloat16(value);
      return;
    case DType::kFloat8E4M3:
      static_cast<uint8_t*>(base)[index] = FloatToFp8E4M3(value);
      return;
    case DType::kFloat32:
      static_cast<float*>(base)[index] = value;
      return;
  }
}

}  // namespace attnd
