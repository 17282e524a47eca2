// MLA decode over the paged latent cache (DESIGN 2 "MLA", 4.4, 4.6), absorbed form:
//   score = sm_scale * (q_nope . ckv * ckv_scale + q_pe . kpe * kpe_scale)
//   o     = sum_keys softmax(score) * ckv * ckv_scale       (kv_lora_rank wide, latent space)
// Every query head of a token reads the same latent row, so one CTA computes 64 rows
// (query token, head) of one request against one chunk of its keys with tensor cores
// (mma.sync m16n8k16, fp32 accumulate): the rows are the MMA M dimension. Causal among a
// request's new tokens (bottom-right aligned). Chunks of a split request write fp32 partials
// that MergeStates combines per (token, head) in chunk order.
//
// Typical use (per cache, then per step, then per layer):
//   ctas = MlaDecodeCtasPerWave(config)                          // once per cache
//   plan = plan::PlanMlaDecode(qo_indptr, kv_lengths, {.num_heads, .ctas_per_wave = ctas})
//   upload plan.Pack() once per step (16-byte aligned); work = plan.View(device_copy)
//   MlaDecode({..., work, workspace of MlaDecodeWorkspaceBytes(plan.num_partials, ...)}, s)
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "attnd/kernels/attention_params.h"
#include "attnd/kernels/views.h"
#include "plan/mla_work.h"

namespace attnd::cuda {

// What selects an MLA decode kernel. Supported: q fp16/bf16; latent cache fp16, bf16 or
// fp8_e4m3 (ckv and kpe pools of one dtype); kv_lora_rank 512 or 256; rope_dim 64. The MMA runs
// in the cache's type (16-bit caches; q converts once per CTA) or in q's type (fp8 caches,
// dequantised exactly in shared memory). fp16 q over a bf16 cache is therefore rounded to bf16
// (3 mantissa bits; lse moves by ~1e-3). kpe_scale / ckv_scale is folded into q_pe (exact when
// a power of two). Page size (any power of two) is a runtime value.
// Which kernel runs. kAuto: the wide-tile Hopper kernel (kHopperWide) where a Hopper kernel
// applies (compute capability 9.0, a build with sm_90a code, q and cache of one 16-bit type,
// kpe_scale == ckv_scale), the mma.sync kernel elsewhere. kHopper: the first Hopper kernel (each
// request's heads as two 64-row CTAs, 32-key tiles, S split across the consumer warpgroups);
// kHopperWide: 64-key tiles, one warpgroup computing all of S and sharing P with the other
// (issue 15), ~20% faster on the H100. Each is deterministic on its own; kAuto's choice depends
// on the cache and device alone.
enum class MlaKernel : int32_t { kAuto = 0, kMmaSync = 1, kHopper = 2, kHopperWide = 3 };

struct MlaDecodeConfig {
  DType q_dtype = DType::kBFloat16;
  DType kv_dtype = DType::kBFloat16;
  int32_t kv_lora_rank = 512;
  int32_t rope_dim = 64;
  MlaKernel kernel = MlaKernel::kAuto;
};

bool MlaDecodeSupports(const MlaDecodeConfig& config);

// CTAs of the kernel for `config` the current device runs at once (occupancy x SMs, measured
// with cudaOccupancyMaxActiveBlocksPerMultiprocessor; for the wide-tile kernel on 16-bit caches
// at most twice the clusters of two that cudaOccupancyMaxActiveClusters counts). Feed it to
// plan::MlaPlanOptions.
absl::StatusOr<int32_t> MlaDecodeCtasPerWave(const MlaDecodeConfig& config);

// Device workspace for a plan with `num_partials` partial slots (0 when nothing splits):
// fp32 [num_partials][num_heads][kv_lora_rank], then [num_partials][num_heads] lse.
int64_t MlaDecodeWorkspaceBytes(int32_t num_partials, int32_t num_heads, int32_t kv_lora_rank);

// All pointers are device memory, 16-byte aligned, valid until the launched work completes.
struct MlaDecodeArgs {
  TokenHeadsView q_nope;  // [T_q][num_heads][kv_lora_rank], fp16/bf16
  TokenHeadsView q_pe;    // [T_q][num_heads][rope_dim], q_nope's dtype, already rotated
  // indptr and k_indices (ckv pages) and v_indices (kpe pages; == k_indices for SHARED) are
  // read; lengths come from the plan.
  PageTableView pages;
  PagedKvView ckv_cache;  // num_heads 1, head_dim kv_lora_rank (NHD and HND coincide)
  PagedKvView kpe_cache;  // num_heads 1, head_dim rope_dim, ckv's dtype and page size
  // causal, sm_scale, logits_soft_cap, window_left; k_scale dequantises ckv, v_scale kpe.
  AttentionParams params;
  plan::MlaWorkView work;   // an uploaded plan::MlaPlan
  TokenHeadsView o;         // [T_q][num_heads][kv_lora_rank], fp16/bf16; rows the plan names
  float* lse = nullptr;     // [T_q][num_heads] natural log, or null
  void* workspace = nullptr;  // 256-byte aligned, MlaDecodeWorkspaceBytes(work.num_partials..)
  int64_t workspace_bytes = 0;
  MlaKernel kernel = MlaKernel::kAuto;  // kHopper(Wide) where it does not apply: INVALID_ARGUMENT
  // The wide-tile kernel loads whole 64-key tiles of 16-bit caches with pages of 64+ keys by TMA
  // (false, or ATTND_MLA_TMA=0 in the environment: cp.async for every tile; same results).
  bool allow_tma = true;
  // With TMA and num_heads a multiple of 128, the wide-tile kernel runs in clusters of two CTAs
  // that fetch each tile once for both halves of a token's heads (false, or ATTND_MLA_CLUSTER=0
  // in the environment: each CTA loads its own; same results).
  bool allow_cluster = true;
};

// Launches the decode, then MergeStates when the plan splits, on `stream`. Allocates nothing,
// does not synchronise. Rows that see no key get o = 0 and lse = -inf. Plans made with
// deterministic = true give a request bitwise identical o and lse in any batch, at any position.
absl::Status MlaDecode(const MlaDecodeArgs& args, cudaStream_t stream);

}  // namespace attnd::cuda
