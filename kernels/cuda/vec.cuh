// Small device primitives shared by the kernels: packed element conversions (cp.async is
// cp_async.cuh's).
// Conversions round to nearest even (FP8: saturating to +-448), like attnd/kernels/dtype.h, so a
// kernel stores the bytes the reference stores for the same float.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

namespace attnd::cuda {

// Eight elements of T in raw storage: 16 bytes for 16-bit types, 8 bytes for FP8.
template <typename T>
struct Raw8;
template <>
struct Raw8<__half> {
  using type = uint4;
};
template <>
struct Raw8<__nv_bfloat16> {
  using type = uint4;
};
template <>
struct Raw8<__nv_fp8_e4m3> {
  using type = uint2;
};

__device__ __forceinline__ float2 Bf16x2ToFloat2(uint32_t word) {
  // A bfloat16 is the top half of a float: shifting is exact and cheaper than cvt.
  return make_float2(__uint_as_float(word << 16), __uint_as_float(word & 0xffff0000u));
}

__device__ __forceinline__ float2 Fp16x2ToFloat2(uint32_t word) {
  __half2 pair;
  memcpy(&pair, &word, sizeof pair);
  return __half22float2(pair);
}

// Two E4M3 values (low byte first) to float, through an exact E4M3 -> f16 conversion.
__device__ __forceinline__ float2 Fp8x2ToFloat2(uint16_t bits) {
  const __half2_raw raw = __nv_cvt_fp8x2_to_halfraw2(bits, __NV_E4M3);
  __half2 pair;
  memcpy(&pair, &raw, sizeof pair);
  return __half22float2(pair);
}

template <typename T>
__device__ __forceinline__ void Raw8ToFloat(const typename Raw8<T>::type& raw, float* out);

template <>
__device__ __forceinline__ void Raw8ToFloat<__nv_bfloat16>(const uint4& raw, float* out) {
  const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 pair = Bf16x2ToFloat2(words[i]);
    out[2 * i] = pair.x;
    out[2 * i + 1] = pair.y;
  }
}

template <>
__device__ __forceinline__ void Raw8ToFloat<__half>(const uint4& raw, float* out) {
  const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 pair = Fp16x2ToFloat2(words[i]);
    out[2 * i] = pair.x;
    out[2 * i + 1] = pair.y;
  }
}

template <>
__device__ __forceinline__ void Raw8ToFloat<__nv_fp8_e4m3>(const uint2& raw, float* out) {
  const uint32_t words[2] = {raw.x, raw.y};
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const float2 low = Fp8x2ToFloat2(static_cast<uint16_t>(words[i] & 0xffffu));
    const float2 high = Fp8x2ToFloat2(static_cast<uint16_t>(words[i] >> 16));
    out[4 * i] = low.x;
    out[4 * i + 1] = low.y;
    out[4 * i + 2] = high.x;
    out[4 * i + 3] = high.y;
  }
}

// Two floats -> one register of two 16-bit values of T (a in the low half), round to nearest
// even: an MMA operand register, or two elements of a stored row.
template <typename T>
__device__ __forceinline__ uint32_t PackFloat2(float a, float b);

template <>
__device__ __forceinline__ uint32_t PackFloat2<__nv_bfloat16>(float a, float b) {
  const __nv_bfloat162 pair = __floats2bfloat162_rn(a, b);
  uint32_t word;
  memcpy(&word, &pair, sizeof word);
  return word;
}

template <>
__device__ __forceinline__ uint32_t PackFloat2<__half>(float a, float b) {
  const __half2 pair = __floats2half2_rn(a, b);
  uint32_t word;
  memcpy(&word, &pair, sizeof word);
  return word;
}

// Eight floats rounded to T, as raw storage.
template <typename T>
__device__ __forceinline__ typename Raw8<T>::type FloatToRaw8(const float* in) {
  uint4 raw;
  raw.x = PackFloat2<T>(in[0], in[1]);
  raw.y = PackFloat2<T>(in[2], in[3]);
  raw.z = PackFloat2<T>(in[4], in[5]);
  raw.w = PackFloat2<T>(in[6], in[7]);
  return raw;
}

template <>
__device__ __forceinline__ uint2 FloatToRaw8<__nv_fp8_e4m3>(const float* in) {
  uint32_t words[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const uint32_t low =
        __nv_cvt_float2_to_fp8x2(make_float2(in[4 * i], in[4 * i + 1]), __NV_SATFINITE, __NV_E4M3);
    const uint32_t high = __nv_cvt_float2_to_fp8x2(make_float2(in[4 * i + 2], in[4 * i + 3]),
                                                   __NV_SATFINITE, __NV_E4M3);
    words[i] = low | (high << 16);
  }
  return make_uint2(words[0], words[1]);
}

}  // namespace attnd::cuda
