// Conversion of stored KV values (fp8 e4m3, or the other 16-bit type) into the MMA type, pair
// by pair and 16 fp8 bytes (a landed cp.async chunk) at a time: the fp8 tile conversion of the
// prefill, POD and MLA kernels. Device-only; no state.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "vec.cuh"  // PackFloat2

namespace attnd::cuda {

// Converts a register of two stored KV values (the low 16 bits of `bits` for fp8) to two values
// of the MMA type T. Every conversion here is exact except fp16 <-> bf16 across types.
template <typename T, typename Stored>
__device__ __forceinline__ uint32_t ConvertPair(uint32_t bits);

template <>
__device__ __forceinline__ uint32_t ConvertPair<__half, __nv_fp8_e4m3>(uint32_t bits) {
  __half2_raw raw = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(bits), __NV_E4M3);
  return static_cast<uint32_t>(raw.x) | (static_cast<uint32_t>(raw.y) << 16);
}

template <>
__device__ __forceinline__ uint32_t ConvertPair<__nv_bfloat16, __nv_fp8_e4m3>(uint32_t bits) {
  // e4m3 -> fp16 is exact, and every fp16 made from e4m3 is exact in bf16 too.
  __half2_raw raw = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(bits), __NV_E4M3);
  const float2 value = __half22float2(*reinterpret_cast<__half2*>(&raw));
  return PackFloat2<__nv_bfloat16>(value.x, value.y);
}

template <>
__device__ __forceinline__ uint32_t ConvertPair<__half, __nv_bfloat16>(uint32_t bits) {
  const float2 value = __bfloat1622float2(*reinterpret_cast<__nv_bfloat162*>(&bits));
  return PackFloat2<__half>(value.x, value.y);
}

template <>
__device__ __forceinline__ uint32_t ConvertPair<__nv_bfloat16, __half>(uint32_t bits) {
  const float2 value = __half22float2(*reinterpret_cast<__half2*>(&bits));
  return PackFloat2<__nv_bfloat16>(value.x, value.y);
}

// 16 stored fp8 values (`bits`, lowest byte first) -> 16 values of T: the first 8 in `low`, the
// next 8 in `high` (two 16-byte chunks of an MMA tile row). Exact (see ConvertPair).
template <typename T, typename Stored>
__device__ __forceinline__ void ConvertFp8x16(uint4 bits, uint4& low, uint4& high) {
  const uint32_t words[4] = {bits.x, bits.y, bits.z, bits.w};
  uint32_t out[8];
#pragma unroll
  for (int w = 0; w < 4; ++w) {
    out[2 * w] = ConvertPair<T, Stored>(words[w] & 0xffffu);
    out[2 * w + 1] = ConvertPair<T, Stored>(words[w] >> 16);
  }
  low = make_uint4(out[0], out[1], out[2], out[3]);
  high = make_uint4(out[4], out[5], out[6], out[7]);
}

}  // namespace attnd::cuda
