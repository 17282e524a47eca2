// Split-KV planning of batch decode (DESIGN 4.2, 4.4): which CTA reads which tokens of which
// request, and how the partial results merge. Built once per step on the host, uploaded once
// (Pack), and read by every layer's decode launch (View). Plain data: print it, test it.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "plan/decode_work.h"

namespace attnd::plan {

// Chunk size of deterministic decode when the caller pins none. Fixed in tokens so that a
// request's chunking, and with it its reduction order, depends on the request alone.
inline constexpr int32_t kDeterministicChunkTokens = 512;

// Planner-chosen chunk sizes are multiples of this (the decode kernel's smallest KV tile), so no
// chunk ends in a mostly empty tile.
inline constexpr int32_t kChunkGranularityTokens = 16;

// Which decode kernel a plan asks for: the planner's choice (kAuto), or forced (tests, benchmarks).
enum class DecodeKernelChoice : int32_t { kAuto = 0, kCudaCore = 1, kTensorCore = 2 };

struct DecodePlanOptions {
  int32_t num_kv_heads = 0;        // one CTA per work item and KV head
  // CTAs of the CUDA-core decode kernel the device runs at once: resident CTAs per SM (from
  // cudaOccupancyMaxActiveBlocksPerMultiprocessor) x SMs. Measured by the launcher
  // (attnd::cuda::DecodeCtasPerWave), not assumed. Unused when the chunk is pinned.
  int32_t ctas_per_wave = 0;
  // Which kernels the launcher has for the cache (attnd::cuda::DecodeSupports and
  // TensorCoreDecodeSupports) and the tensor-core kernel's wave
  // (attnd::cuda::TensorCoreDecodeCtasPerWave).
  bool cuda_core_supported = true;
  bool tensor_core_supported = false;
  int32_t tensor_core_ctas_per_wave = 0;
  // The tensor-core kernel's chunk: the smallest whose CTAs fit in its wave divided by
  // tensor_core_wave_divisor, capped at tensor_core_max_chunk_tokens (instead of
  // max_chunk_tokens, the CUDA-core kernel's cap). Fewer, longer chunks than a full wave: each
  // CTA's fixed costs (Q, the pipeline's fill, the partial's write, the merge) weigh on short
  // chunks. Measured on an H100 (docs/benchmarks.md, 2026-11-27, Hq 32 / Hkv 8 / D 128 bf16):
  // 1 x 4096 keys 11.57 us in 128 CTAs of 256 keys against 12.46 in 256 of 128; 1 x 8192 17.64
  // (chunks of 512) against 18.00 (256); 16 x 4096 94.5 (2048) against 97.5 (1024); 64 x 4096
  // 359.2 (2048) against 364.9 (1024).
  int32_t tensor_core_wave_divisor = 2;
  int32_t tensor_core_max_chunk_tokens = 2048;
  // ... and, when the requests' lengths are within 25% of each other and unsplit they fill more
  // than half the tensor-core wave, a chunk of 1, 2, 4 or 8 pieces per request chosen by a model
  // of the wave's quantisation (decode_plan.cc, UniformChunkTokens), at most this cap: the 2048
  // cap is there to balance mixed lengths, and equal ones stream faster in longer chunks unless
  // their last wave is mostly empty (same H100 run: 64 x 4096 357.2 us against 364.7 at 2048,
  // 128 x 32768 5584 against 5633, 256 x 32768 11146 against 11246; mixed lengths 1..8192 x 64
  // requests 354 us at 2048 against 387 at 8192; the H200's figures for the model are in
  // docs/benchmarks.md).
  int32_t tensor_core_uniform_max_chunk_tokens = 8192;
  DecodeKernelChoice kernel_choice = DecodeKernelChoice::kAuto;
  // kAuto picks the tensor-core kernel (when both exist) for batches of at least this many
  // requests with at least this many keys in all. Measured on an H100 (docs/benchmarks.md,
  // Hq 32 / Hkv 8 / D 128 bf16, page 16) it won on every shape of issue 14 from batch 1 x 4096
  // keys up (12.5 vs 14.9 us there), and on short contexts too (`attnd_bench --e2e`, 2026-11-28):
  // 1 x 512 6.7 against 7.8 us, 16 x 128 6.7 against 9.7, 32 x 117 8.9 against 13.0, 128 x 117
  // 31.7 against 34.0; only 128 x 65 ran 3% slower (25.4 against 24.7). So no floor by default.
  // Deterministic plans always take the CUDA-core kernel when it exists: the kernel must not
  // depend on the rest of the batch.
  int32_t tensor_core_min_requests = 1;
  int64_t tensor_core_min_total_kv_tokens = 0;
  // Floor of the chunk. DESIGN 4.2 suggests ~128; 64 measured 21% faster for one request of
  // 1024 keys on an H100 (docs/benchmarks.md).
  int32_t min_chunk_tokens = 64;
  // Cap of the planner's chunk (0: none), so mixed lengths balance and long requests stream in
  // several waves; measured on an H100 (docs/benchmarks.md).
  int32_t max_chunk_tokens = 1024;
  int32_t fixed_split_tokens = 0;  // > 0 pins the chunk size (tokens)
  bool disable_split_kv = false;   // one chunk per request (e.g. for graph capture)
  bool deterministic = false;      // chunk fixed in tokens (fixed_split_tokens or the default)
  int32_t window_left = -1;        // >= 0: only the last window_left + 1 keys are read
};

// The plan: work items in request order, a request's chunks in token order. A request with
// one item writes o and lse itself; a request with several writes fp32 partials (slots
// numbered in item order), merged per request in slot order.
struct DecodePlan {
  DecodeKernel kernel = DecodeKernel::kCudaCore;
  int32_t kv_chunk_tokens = 0;  // chunk size chosen; 0 when the batch has no rows
  bool split_kv = false;        // some request has more than one chunk
  int32_t window_left = -1;
  std::vector<int32_t> item_request;
  std::vector<int32_t> item_q_row;
  std::vector<int32_t> item_kv_begin;
  std::vector<int32_t> item_kv_end;
  std::vector<int32_t> item_partial;
  std::vector<int32_t> merge_indptr{0};
  std::vector<int32_t> merge_q_row;
  int32_t num_partials = 0;

  int32_t num_items() const { return static_cast<int32_t>(item_request.size()); }
  int32_t num_merge_rows() const { return static_cast<int32_t>(merge_q_row.size()); }

  // All arrays in one buffer, for one upload per step: Pack() returns it, PackInto writes its
  // PackedWords() words to `out` (e.g. straight into pinned staging).
  std::vector<int32_t> Pack() const;
  int64_t PackedWords() const;
  void PackInto(int32_t* out) const;
  // Pointers into `packed`, a copy of Pack() (typically in device memory).
  DecodeWorkView View(const int32_t* packed) const;
  std::string DebugString() const;
};

// A part of a decode plan's rows: rows [row_begin, row_end), the items that compute them
// [item_begin, item_end) and their merge rows [merge_begin, merge_end) (SliceDecodeWork).
struct DecodePlanPart {
  int64_t row_begin = 0;
  int64_t row_end = 0;
  int32_t item_begin = 0;
  int32_t item_end = 0;
  int32_t merge_begin = 0;
  int32_t merge_end = 0;
};

// The plan's `num_rows` rows cut into up to `parts` consecutive ranges of nearly equal size
// (fewer when there are fewer rows), each with its own items and merge rows, so that a layer can
// run part by part (a HOST_SHM layer copies part p + 1 in while part p computes). Running every
// part's slice runs every item once with its own partial slot and every merge over the same
// slots in the same order: the same bits as the whole plan. One part (the whole plan) when
// parts <= 1 or when the plan's rows are not in item order.
std::vector<DecodePlanPart> SplitDecodePlanByRows(const DecodePlan& plan, int64_t num_rows,
                                                  int32_t parts);

// Plans a decode batch. Request b has kv_lengths[b] keys (this step's token included) and
// qo_indptr[b + 1] - qo_indptr[b] query rows: 1 for decode, 0 for a padding slot (no work, no
// output). INVALID_ARGUMENT for more than one row, negative lengths, bad options or a forced
// kernel the cache lacks.
absl::StatusOr<DecodePlan> PlanBatchDecode(std::span<const int32_t> qo_indptr,
                                           std::span<const int64_t> kv_lengths,
                                           const DecodePlanOptions& options);

}  // namespace attnd::plan
