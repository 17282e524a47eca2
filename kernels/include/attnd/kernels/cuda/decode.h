// Batch decode over the paged cache with split-KV (DESIGN 4.2): one query row per request
// (times the GQA group) against the request's keys, chunked by a plan::DecodePlan. One CTA per
// (work item, KV head) serves every query head of the group from one read of K and V; requests
// split into several chunks write fp32 partials that MergeStates combines.
//
// Typical use (per cache, then per step, then per layer):
//   ctas = DecodeCtasPerWave(config)                      // once per cache
//   plan = plan::PlanBatchDecode(qo_indptr, kv_lengths, {.num_kv_heads, .ctas_per_wave = ctas})
//   upload plan.Pack() once per step; work = plan.View(device_copy)
//   BatchDecode({..., work, workspace of BatchDecodeWorkspaceBytes(plan.num_partials, ...)}, s)
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "attnd/kernels/attention_params.h"
#include "attnd/kernels/cuda/grid_signal.h"
#include "attnd/kernels/views.h"
#include "plan/decode_work.h"

namespace attnd::cuda {

// What selects a decode kernel: supported are fp16/bf16 q, fp16/bf16/fp8_e4m3 KV, head_dim 64,
// 128 or 256, group_size (num_qo_heads / num_kv_heads) 1..8. Page size and layout are runtime.
struct DecodeKernelConfig {
  DType q_dtype = DType::kBFloat16;
  DType kv_dtype = DType::kBFloat16;
  int32_t head_dim = 128;
  int32_t group_size = 1;
};

// True when BatchDecode has a CUDA-core kernel for `config`.
bool DecodeSupports(const DecodeKernelConfig& config);

// CTAs of the CUDA-core decode kernel for `config` the current device runs at once: resident
// CTAs per SM (cudaOccupancyMaxActiveBlocksPerMultiprocessor) x SMs. Feed it to
// plan::DecodePlanOptions::ctas_per_wave; it is fixed per device and config, so query it once.
absl::StatusOr<int32_t> DecodeCtasPerWave(const DecodeKernelConfig& config);

// The tensor-core kernel (plans with kernel kTensorCore): q fp16 or bf16 over a cache of q's type
// (head_dim 64/128/256) or of fp8 e4m3 (head_dim 128/256; fp16 MMAs, each q row scaled by a power
// of two into fp16's range), group_size 1..16. Other mixed-type caches, and fp8 at head_dim 64,
// stay on the CUDA-core kernel. Its wave goes to plan::DecodePlanOptions::tensor_core_ctas_per_wave; it is 0
// where the device cannot hold one of its CTAs (head_dim 256 needs 200 KB of shared memory, more
// than an A100 gives): then the kernel is not to be used there.
bool TensorCoreDecodeSupports(const DecodeKernelConfig& config);
absl::StatusOr<int32_t> TensorCoreDecodeCtasPerWave(const DecodeKernelConfig& config);

// Device workspace BatchDecode needs for a plan with `num_partials` partial slots (0 when the
// plan does not split). Partials are fp32 [num_partials][num_qo_heads][head_dim] plus lse.
int64_t BatchDecodeWorkspaceBytes(int32_t num_partials, int32_t num_qo_heads, int32_t head_dim);

// All pointers are device memory, valid until the launched work completes on the stream.
struct BatchDecodeArgs {
  TokenHeadsView q;      // [T_q][num_qo_heads][head_dim], fp16/bf16, already rotated
  PageTableView pages;   // indptr, k_indices, v_indices read; the plan carries the lengths
  PagedKvView k_cache;   // the layer's K pool (NHD or HND)
  PagedKvView v_cache;   // the layer's V pool, same geometry
  // causal is moot for one row per request; window_left must be the one the plan was cut for
  // (the plan already limits each item's key range to the window).
  AttentionParams params;
  plan::DecodeWorkView work;  // an uploaded plan::DecodePlan
  TokenHeadsView o;           // [T_q][num_qo_heads][head_dim], fp16/bf16; rows the plan names
  float* lse = nullptr;       // [T_q][num_qo_heads] natural log, or null
  void* workspace = nullptr;  // 256-byte aligned, BatchDecodeWorkspaceBytes(work.num_partials..)
  int64_t workspace_bytes = 0;
  // Optional: the launch's last grid (the merge where the plan splits, else the decode) sets
  // done.word to done.value itself once o and lse are stored (grid_signal.h); a plan with no
  // item sets it with a one-thread kernel after the stream's earlier work.
  GridSignal done;
};

// Launches the plan's decode kernel (work.kernel), then MergeStates when the plan splits, on
// `stream`. Allocates nothing and
// does not synchronise. Fully masked rows (no key) get o = 0, lse = -inf. Deterministic plans
// give each request bitwise identical o and lse in any batch at any position.
absl::Status BatchDecode(const BatchDecodeArgs& args, cudaStream_t stream);

}  // namespace attnd::cuda
