// POD attention (DESIGN 4.5): prefill and decode CTAs of a mixed batch in one grid.
//
// Every CTA runs the batch prefill tile code (prefill_kernel.cuh, PrefillCta) in one of two
// roles: the prefill role with its large query tile (64 or 128 packed rows, compute-bound), the
// decode role with 16-row tiles (one token per request, its GQA group stacked into the MMA's M
// dimension, memory-bound). Roles are taken at run time, not from blockIdx: thread 0 reads the
// SM id, counts the CTAs started on that SM, and takes the prefill role in the global ratio
// (plan::PodTakesPrefillRole), so every SM runs both kinds at once instead of the grid's first
// CTAs all being prefill; it then takes the next block id of its role from the role's global
// counter, and the other role's when its own has run out. The grid has exactly as many CTAs as
// both roles' blocks and each CTA takes one block, so every block runs exactly once.
//
// A block's numerics do not depend on its role assignment or order: it is the same PrefillCta
// over the same item as in the separate launches (bitwise the same as BatchPrefill's kernel of
// that tile), so deterministic plans stay deterministic.
//
// Shared memory is the larger role's, plus 16 bytes at its end for the scheduler's answer.
#pragma once

#include <climits>
#include <cstdint>
#include <type_traits>

#include "plan/pod_schedule.h"
#include "pod_params.h"
#include "prefill_kernel.cuh"

namespace attnd::cuda::pod {

template <typename PrefillShape, typename DecodeShape>
struct PodShape {
  static constexpr int kTileBytes =
      PrefillShape::kSmemBytes > DecodeShape::kSmemBytes ? PrefillShape::kSmemBytes : DecodeShape::kSmemBytes;
  static constexpr int kSchedulerOffset = (kTileBytes + 15) / 16 * 16;
  static constexpr int kSmemBytes = kSchedulerOffset + 16;
};

__device__ __forceinline__ uint32_t SmId() {
  uint32_t id;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(id));
  return id;
}

template <typename PrefillShape, typename DecodeShape, typename QO, typename T, typename Stored>
__global__ void __launch_bounds__(prefill::kThreads) PodKernel(const __grid_constant__ PodKernelParams params) {
  using Shape = PodShape<PrefillShape, DecodeShape>;
  extern __shared__ __align__(128) uint8_t shared_bytes[];
  // >= 0: prefill block; < 0 and != INT_MIN: decode block -(word + 1); INT_MIN: none (cannot
  // happen with a grid of exactly both roles' blocks; kept so a bad launch idles, not overruns).
  int32_t* assignment = reinterpret_cast<int32_t*>(shared_bytes + Shape::kSchedulerOffset);
  if (threadIdx.x == 0) {
    const int32_t started = atomicAdd(params.counters + 2 + (SmId() % kSmSlots), 1);
    bool prefill_role = plan::PodTakesPrefillRole(started, params.num_prefill_ctas, params.num_decode_ctas);
    int32_t word = INT_MIN;
    for (int attempt = 0; attempt < 2; ++attempt, prefill_role = !prefill_role) {
      const int32_t limit = prefill_role ? params.num_prefill_ctas : params.num_decode_ctas;
      const int32_t block = atomicAdd(params.counters + (prefill_role ? 0 : 1), 1);
      if (block < limit) {
        word = prefill_role ? block : -(block + 1);
        break;
      }
    }
    *assignment = word;
  }
  __syncthreads();
  const int32_t word = *assignment;
  // The tiles end before the scheduler's word, so it needs no second barrier.
  if (word >= 0) {
    prefill::PrefillCta<PrefillShape, QO, T, Stored>(params.base, params.prefill_items, static_cast<uint32_t>(word));
  } else if (word != INT_MIN) {
    prefill::PrefillCta<DecodeShape, QO, T, Stored>(params.base, params.decode_items, static_cast<uint32_t>(-(word + 1)));
  }
}

// Launches one instantiation; opts the kernel into the dynamic shared memory it needs.
template <int kPrefillRows, int kHeadDim, typename QO, typename Stored>
cudaError_t LaunchPodTile(const PodKernelParams& params, int32_t num_ctas, cudaStream_t stream, int* ctas_per_sm) {
  constexpr int kRaw = sizeof(Stored) == 1 ? 1 : 0;
  using PrefillShape = prefill::TileShape<kPrefillRows, kHeadDim, kRaw>;
  using DecodeShape = prefill::TileShape<16, kHeadDim, kRaw>;
  using Shape = PodShape<PrefillShape, DecodeShape>;
  // The MMA type as in prefill::LaunchTile: bf16 q over an fp16 cache multiplies in fp16.
  using Mma = std::conditional_t<std::is_same_v<QO, __nv_bfloat16> && std::is_same_v<Stored, __half>, __half, QO>;
  auto* kernel = &PodKernel<PrefillShape, DecodeShape, QO, Mma, Stored>;
  cudaError_t error = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Shape::kSmemBytes);
  if (error != cudaSuccess) return error;
  if (ctas_per_sm != nullptr) {
    return cudaOccupancyMaxActiveBlocksPerMultiprocessor(ctas_per_sm, kernel, prefill::kThreads, Shape::kSmemBytes);
  }
  kernel<<<num_ctas, prefill::kThreads, Shape::kSmemBytes, stream>>>(params);
  return cudaGetLastError();
}

// Dispatches the dtype pair for one (prefill tile, head_dim).
template <int kPrefillRows, int kHeadDim>
cudaError_t LaunchPodForTypes(const PodKernelParams& params, DType q_dtype, DType kv_dtype, int32_t num_ctas,
                              cudaStream_t stream, int* ctas_per_sm) {
  if (q_dtype == DType::kFloat16) {
    switch (kv_dtype) {
      case DType::kFloat16: return LaunchPodTile<kPrefillRows, kHeadDim, __half, __half>(params, num_ctas, stream, ctas_per_sm);
      case DType::kBFloat16: return LaunchPodTile<kPrefillRows, kHeadDim, __half, __nv_bfloat16>(params, num_ctas, stream, ctas_per_sm);
      case DType::kFloat8E4M3: return LaunchPodTile<kPrefillRows, kHeadDim, __half, __nv_fp8_e4m3>(params, num_ctas, stream, ctas_per_sm);
      default: break;
    }
  } else if (q_dtype == DType::kBFloat16) {
    switch (kv_dtype) {
      case DType::kFloat16: return LaunchPodTile<kPrefillRows, kHeadDim, __nv_bfloat16, __half>(params, num_ctas, stream, ctas_per_sm);
      case DType::kBFloat16: return LaunchPodTile<kPrefillRows, kHeadDim, __nv_bfloat16, __nv_bfloat16>(params, num_ctas, stream, ctas_per_sm);
      case DType::kFloat8E4M3: return LaunchPodTile<kPrefillRows, kHeadDim, __nv_bfloat16, __nv_fp8_e4m3>(params, num_ctas, stream, ctas_per_sm);
      default: break;
    }
  }
  return cudaErrorInvalidValue;
}

}  // namespace attnd::cuda::pod
