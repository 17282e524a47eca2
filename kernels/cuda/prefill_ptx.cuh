// Thin wrappers over the sm_80+ instructions the prefill kernel is built from: cp.async (global
// to shared, 16 bytes, zero-fill), ldmatrix (x4, plain and transposed) and mma.sync m16n8k16
// with fp32 accumulators. Device-only; no state.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

namespace attnd::cuda::prefill {

__device__ __forceinline__ uint32_t SharedAddress(const void* pointer) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(pointer));
}

// Copies 16 bytes global -> shared, bypassing L1. When `valid` is false nothing is read and the
// 16 destination bytes are zero-filled (the source address must still be a legal pointer value).
__device__ __forceinline__ void CpAsync16(uint32_t shared_address, const void* global, bool valid) {
  const int source_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(shared_address),
               "l"(global), "r"(source_bytes)
               : "memory");
}

__device__ __forceinline__ void CpAsyncCommit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

// Waits until at most `kPending` of the most recent commit groups are still in flight.
template <int kPending>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

__device__ __forceinline__ void LdMatrixX4(uint32_t shared_address, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(shared_address));
}

__device__ __forceinline__ void LdMatrixX4Trans(uint32_t shared_address, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(shared_address));
}

// d[0..3] += A(16x16, row) * B(16x8, col); a[4], b0/b1 as ldmatrix returns them.
template <typename T>
__device__ __forceinline__ void Mma16816(float* d, const uint32_t* a, uint32_t b0, uint32_t b1);

template <>
__device__ __forceinline__ void Mma16816<__half>(float* d, const uint32_t* a, uint32_t b0,
                                                 uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <>
__device__ __forceinline__ void Mma16816<__nv_bfloat16>(float* d, const uint32_t* a, uint32_t b0,
                                                        uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two floats -> one register of two 16-bit values (lo = first), round to nearest even.
template <typename T>
__device__ __forceinline__ uint32_t PackFloat2(float lo, float hi);

template <>
__device__ __forceinline__ uint32_t PackFloat2<__half>(float lo, float hi) {
  __half2 packed = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&packed);
}

template <>
__device__ __forceinline__ uint32_t PackFloat2<__nv_bfloat16>(float lo, float hi) {
  __nv_bfloat162 packed = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&packed);
}

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

}  // namespace attnd::cuda::prefill
