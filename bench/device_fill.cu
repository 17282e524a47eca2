#include "device_fill.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <algorithm>

namespace attnd::bench {
namespace {

__device__ __forceinline__ uint64_t SplitMix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

__global__ void FillKernel(void* data, DType dtype, int64_t count, uint64_t seed, float range) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += stride) {
    const uint64_t bits = SplitMix64(seed * 0x100000001b3ull + static_cast<uint64_t>(i));
    const float unit = static_cast<float>(bits >> 40) * (1.0f / 16777216.0f);  // [0, 1)
    const float value = (2.0f * unit - 1.0f) * range;
    switch (dtype) {
      case DType::kFloat16:
        static_cast<__half*>(data)[i] = __float2half_rn(value);
        break;
      case DType::kBFloat16:
        static_cast<__nv_bfloat16*>(data)[i] = __float2bfloat16_rn(value);
        break;
      case DType::kFloat8E4M3:
        static_cast<__nv_fp8_e4m3*>(data)[i] = __nv_fp8_e4m3(value);
        break;
      case DType::kFloat32:
        static_cast<float*>(data)[i] = value;
        break;
    }
  }
}

__global__ void CopyKernel(uint4* __restrict__ target, const uint4* __restrict__ source, int64_t count) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (; i + 3 * stride < count; i += 4 * stride) {
    uint4 values[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) values[u] = source[i + u * stride];
#pragma unroll
    for (int u = 0; u < 4; ++u) target[i + u * stride] = values[u];
  }
  for (; i < count; i += stride) target[i] = source[i];
}

__global__ void OccupyKernel(uint64_t nanoseconds) {
  extern __shared__ uint8_t held[];  // only holds the SM
  uint64_t start, now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do {
    __nanosleep(1000);
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  } while (now - start < nanoseconds);
  if (threadIdx.x == 0 && now == 0) held[0] = 0;  // never true: keeps the shared memory claimed
}

}  // namespace

cudaError_t OccupySms(int ctas, int microseconds, cudaStream_t stream) {
  if (ctas <= 0) return cudaSuccess;
  int device = 0, smem = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  cudaError_t error = cudaFuncSetAttribute(OccupyKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (error != cudaSuccess) return error;
  OccupyKernel<<<ctas, 32, smem, stream>>>(uint64_t{1000} * microseconds);
  return cudaGetLastError();
}

cudaError_t CopyWithKernel(void* target, const void* source, size_t bytes, cudaStream_t stream) {
  int device = 0, sms = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  CopyKernel<<<sms * 8, 256, 0, stream>>>(static_cast<uint4*>(target), static_cast<const uint4*>(source),
                                          static_cast<int64_t>(bytes / 16));
  return cudaGetLastError();
}

cudaError_t FillRandom(void* data, DType dtype, int64_t count, uint64_t seed, float range,
                       cudaStream_t stream) {
  if (count <= 0) return cudaSuccess;
  const int64_t blocks = std::min<int64_t>((count + 255) / 256, 132 * 16);
  FillKernel<<<static_cast<unsigned>(blocks), 256, 0, stream>>>(data, dtype, count, seed, range);
  return cudaGetLastError();
}

}  // namespace attnd::bench
