// Fast conversions of contiguous cache/tensor rows to float or double (reference internals).
// They give exactly the values of attnd::LoadAsFloat, which the unit tests check code by code;
// they exist because a per-element switch and call made CPU attention conversion-bound.
#pragma once

#include <array>
#include <cstdint>
#include <cstring>

#include "attnd/kernels/dtype.h"

namespace attnd::reference {

// Exact binary16 -> float without branches on the common path: the 15 magnitude bits shifted
// into a float's position give the value times 2^-112 (normals and subnormals alike).
inline float HalfToFloatFast(uint16_t bits) {
  uint32_t magnitude = uint32_t{bits & 0x7fffu} << 13;
  float value = BitsToFloat(magnitude) * 0x1p112f;
  if ((bits & 0x7c00u) == 0x7c00u) value = BitsToFloat(0x7f800000u | magnitude);  // inf, NaN
  return (bits & 0x8000u) ? -value : value;
}

const std::array<float, 256>& Fp8E4M3Table();

// dst[i * dst_stride] = T(element i of src) * scale for i in [0, count). The product is taken
// in T, so the float64 oracle dequantises in double.
template <typename T>
void ConvertRow(DType dtype, const void* src, int64_t count, T scale, T* dst,
                int64_t dst_stride = 1) {
  switch (dtype) {
    case DType::kBFloat16: {
      const auto* in = static_cast<const uint16_t*>(src);
      for (int64_t i = 0; i < count; ++i)
        dst[i * dst_stride] = static_cast<T>(BFloat16ToFloat(in[i])) * scale;
      return;
    }
    case DType::kFloat16: {
      const auto* in = static_cast<const uint16_t*>(src);
      for (int64_t i = 0; i < count; ++i)
        dst[i * dst_stride] = static_cast<T>(HalfToFloatFast(in[i])) * scale;
      return;
    }
    case DType::kFloat8E4M3: {
      const auto* in = static_cast<const uint8_t*>(src);
      const std::array<float, 256>& table = Fp8E4M3Table();
      for (int64_t i = 0; i < count; ++i)
        dst[i * dst_stride] = static_cast<T>(table[in[i]]) * scale;
      return;
    }
    case DType::kFloat32: {
      const auto* in = static_cast<const float*>(src);
      for (int64_t i = 0; i < count; ++i) dst[i * dst_stride] = static_cast<T>(in[i]) * scale;
      return;
    }
  }
}

}  // namespace attnd::reference
