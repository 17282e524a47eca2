// What one launch of the POD kernel reads (DESIGN 4.5): the batch prefill parameters both roles
// share, each role's work list, and the scheduler's counters. Built by the launcher (pod.cc);
// shared by the kernel template (pod.cuh) and the per-head-dim instantiation files.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "attnd/kernels/dtype.h"
#include "prefill_params.h"

namespace attnd::cuda::pod {

// Per-SM counters are indexed by %smid modulo this (a power of two above any SM count).
inline constexpr int32_t kSmSlots = 1024;
// counters: [0] next prefill-role block, [1] next decode-role block, [2, 2 + kSmSlots) CTAs
// started per SM. Zeroed on the stream before every launch (cudaMemsetAsync).
inline constexpr int32_t kCounterWords = 2 + kSmSlots;

struct PodKernelParams {
  prefill::KernelParams base;            // base.items is unused: each role has its own list
  const prefill::WorkItem* prefill_items;  // the prefill role's launch items
  const prefill::WorkItem* decode_items;   // the decode role's (16-row) launch items
  int32_t num_prefill_ctas;              // items x KV heads of each role; the grid is their sum
  int32_t num_decode_ctas;
  int32_t* counters;                     // [kCounterWords], zero at launch
};

// Launches the POD kernel of one (head_dim, prefill tile, q dtype, kv dtype) on `num_ctas`
// CTAs (num_prefill_ctas + num_decode_ctas), or, when `ctas_per_sm` is set, only reports how
// many of its CTAs one SM holds. prefill_tile_rows: 64 or 128 (64 only at head_dim 256).
cudaError_t LaunchPodD64(const PodKernelParams& params, int32_t prefill_tile_rows, DType q_dtype, DType kv_dtype,
                         int32_t num_ctas, cudaStream_t stream, int* ctas_per_sm);
cudaError_t LaunchPodD128(const PodKernelParams& params, int32_t prefill_tile_rows, DType q_dtype, DType kv_dtype,
                          int32_t num_ctas, cudaStream_t stream, int* ctas_per_sm);
cudaError_t LaunchPodD256(const PodKernelParams& params, int32_t prefill_tile_rows, DType q_dtype, DType kv_dtype,
                          int32_t num_ctas, cudaStream_t stream, int* ctas_per_sm);

}  // namespace attnd::cuda::pod
