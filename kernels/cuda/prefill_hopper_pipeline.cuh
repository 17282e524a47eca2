// The Hopper prefill kernel's (prefill_hopper_kernel.cuh) fixed shapes, shared memory layout,
// the decoding of a CTA's work item, and its producer: paged K/V tiles copied with cp.async into
// 128-byte-swizzled stages that complete on mbarriers. sm_90a only.
#pragma once

#include <cstdint>
#include <type_traits>

#include "cp_async.cuh"
#include "hopper_ptx.cuh"
#include "math.cuh"
#include "prefill_params.h"

namespace attnd::cuda::prefill::hopper {

inline constexpr int kConsumers = 2;
inline constexpr int kThreads = 128 * (1 + kConsumers);
inline constexpr int kTileRows = 64 * kConsumers;
inline constexpr int kTileKv = 128;
inline constexpr int kProducerRegisters = 56;
inline constexpr int kConsumerRegisters = 224;
static_assert(kProducerRegisters + kConsumers * kConsumerRegisters <= 512, "65536 registers per SM");

// Named barrier ids (0 is __syncthreads): the consumers' turn-taking pair, then one per consumer.
inline constexpr uint32_t kTurnBarrier = 1;       // + consumer index
inline constexpr uint32_t kConsumerBarrier = 3;   // + consumer index


template <int kHeadDimArg, int kStagesArg>
struct HopperShape {
  static constexpr int kHeadDim = kHeadDimArg;
  static constexpr int kStages = kStagesArg;
  static constexpr int kBlocks = kHeadDim / 64;      // 128-byte column blocks per row
  static constexpr int kChunks = kHeadDim / 8;       // 16-byte chunks per row
  static constexpr int kQBlockBytes = 64 * 128;      // one column block of one consumer's Q
  static constexpr int kQBytes = kBlocks * kQBlockBytes;
  static constexpr int kKvBlockBytes = kTileKv * 128;
  static constexpr int kKvBytes = kBlocks * kKvBlockBytes;
  static constexpr int kQOffset = 0;
  static constexpr int kKOffset = kQOffset + kConsumers * kQBytes;
  static constexpr int kVOffset = kKOffset + kStages * kKvBytes;
  static constexpr int kBarrierOffset = kVOffset + kStages * kKvBytes;
  // [kStages][kTileKv bits]: set where a V row of a tile that hides keys held a non-finite value.
  static constexpr int kFlagOffset = kBarrierOffset + 4 * kStages * 8;
  static constexpr int kFlagBytes = kTileKv / 8;
  static constexpr int kSmemBytes = kFlagOffset + kStages * kFlagBytes + 1024;  // + alignment slack
  static_assert(kHeadDim == 64 || kHeadDim == 128, "head_dim");
};

// Byte offset of 16-byte chunk `chunk` of row `row` in a swizzled tile of `kRows` rows.
template <int kRows>
__device__ __forceinline__ uint32_t SwizzledChunk(int row, int chunk) {
  return (chunk / 8) * (kRows * 128) + row * 128 + (((chunk % 8) ^ (row % 8)) << 4);
}

// The work of one CTA, decoded from its item the same way in every thread.
struct CtaWork {
  int index;  // into the launch's work: item index / num_kv_heads, kv head index % num_kv_heads
  int kv_head;
  int qo_start;
  int row_start;  // first packed row of the tile
  int row_end;    // one past the request's last packed row
  int page_begin;
  int position_offset;  // kv_len - q_len: query token i sits at key position offset + i
  int first_position;
  int last_position;
  int kv_begin;
  int kv_end;
  int num_kv_tiles;
};

__device__ __forceinline__ CtaWork DecodeWork(const KernelParams& params, int index) {
  CtaWork work;
  work.index = index;
  work.kv_head = index % params.num_kv_heads;
  const WorkItem item = params.items[index / params.num_kv_heads];
  const int request = item.request;
  work.qo_start = params.qo_indptr[request];
  const int q_len = params.qo_indptr[request + 1] - work.qo_start;
  work.page_begin = params.page_indptr[request];
  const int num_pages = params.page_indptr[request + 1] - work.page_begin;
  const int kv_len = num_pages == 0 ? 0 : ((num_pages - 1) << params.page_size_log2) + params.last_page_len[request];
  const int group = params.group_size;
  work.row_start = item.packed_row_start;
  work.row_end = min(work.row_start + kTileRows, q_len * group);
  work.position_offset = kv_len - q_len;
  work.first_position = work.position_offset + work.row_start / group;
  work.last_position = work.position_offset + (work.row_end - 1) / group;
  // Keys the CTA visits: the chunk, cut by the causal limit of its last row and the window of
  // its first row; rows that see fewer keys are masked per element.
  work.kv_begin = item.kv_chunk_start;
  work.kv_end = min(item.kv_chunk_end, kv_len);
  if (params.causal) work.kv_end = min(work.kv_end, work.last_position + 1);
  if (params.window_left >= 0) work.kv_begin = max(work.kv_begin, work.first_position - params.window_left);
  work.num_kv_tiles = work.kv_end > work.kv_begin ? (work.kv_end - work.kv_begin + kTileKv - 1) / kTileKv : 0;
  return work;
}

// --- Producer ---------------------------------------------------------------------------------

// Copies KV tiles into the stages. Warp w copies rows [32w, 32w + 32) of each tile as two sets
// of 16 rows; a lane pair shares a row, the lanes taking its even and odd 16-byte chunks, so one
// warp instruction moves 32 contiguous bytes (a whole L2 sector) of each of 16 rows. Each lane
// looks up its two rows' pages itself, and every copy after that costs one XOR: the swizzled
// chunk (2k + b) ^ (row % 8) is the compile-time 2k XOR the lane's (b ^ row % 8), and the source
// offset 32k is an immediate. (The first version shuffled each row's page id across the warp and
// redid the 64-bit address math per copy: ~22 instructions per cp.async, which starved the
// consumers: ncu showed them waiting on full stages with the tensor pipe 28% busy.)
// `first` counts the tiles this CTA loaded for earlier work: tile t of this work is the CTA's
// (first + t)-th, which fixes its stage and phase.
template <typename Shape, typename T>
__device__ __forceinline__ void ProduceKv(const KernelParams& params, const CtaWork& work, uint32_t smem, int first) {
  constexpr int kChunks = Shape::kChunks;
  constexpr int kSets = 2;  // row sets of 16 per warp
  const int warp = (threadIdx.x / 32) % 4;
  const int lane = threadIdx.x % 32;
  const int odd = lane % 2;
  const int page_mask = (1 << params.page_size_log2) - 1;
  const int64_t head_offset = static_cast<int64_t>(work.kv_head) * params.kv_head_stride + odd * 8;
  const T* k_pool = static_cast<const T*>(params.k_pool) + head_offset;
  const T* v_pool = static_cast<const T*>(params.v_pool) + head_offset;
  const int32_t* k_ids = params.k_page_ids + work.page_begin;
  const int32_t* v_ids = params.v_page_ids + work.page_begin;
  const uint32_t barriers = smem + Shape::kBarrierOffset;

  // `flags`: for V, this stage's row flags; null for K.
  auto load = [&](const T* pool, const int32_t* ids, int tile, uint32_t tile_smem, uint32_t empty, uint32_t full,
                  uint32_t empty_parity, uint32_t flags) {
    const int tile_start = work.kv_begin + tile * kTileKv;
    const T* source[kSets];
    bool valid[kSets];
    uint32_t row_smem[kSets];  // the row's address XOR the lane's chunk swizzle
#pragma unroll
    for (int set = 0; set < kSets; ++set) {
      const int row = 32 * warp + 16 * set + lane / 2;
      const int token = tile_start + row;
      valid[set] = token < work.kv_end;
      // Looked up before the wait, so the page id's latency hides behind it.
      const int page = valid[set] ? __ldg(ids + (token >> params.page_size_log2)) : 0;
      source[set] = pool + static_cast<int64_t>(page) * params.kv_page_stride + (token & page_mask) * params.kv_entry_stride;
      row_smem[set] = (tile_smem + row * 128) ^ ((odd ^ (row % 8)) << 4);
    }
    MbarrierWait(empty, empty_parity);
#pragma unroll
    for (int set = 0; set < kSets; ++set) {
#pragma unroll
      for (int k = 0; k < kChunks / 2; ++k) {
        // Chunk 2k + odd: column block k / 4, position (2k % 8) ^ odd ^ (row % 8) in the row.
        // Rows past the keys are zero-filled: V must be, since P = 0 times stale memory could
        // be NaN.
        const uint32_t destination = (row_smem[set] ^ (((2 * k) % 8) << 4)) + (k / 4) * Shape::kKvBlockBytes;
        CpAsync16(destination, valid[set] ? source[set] + 16 * k : pool, valid[set]);
      }
    }
    // P V adds p = 0 times V for keys a row does not see, and 0 * NaN would make a row NaN that
    // never saw the key. In a V tile where some row does not see some key (keys past kv_end are
    // zero-filled already), wait for this thread's copies, zero the non-finite values (exponent
    // all ones) and flag the rows (a bit each, one word per warp); the consumers make the rows
    // that see a flagged key NaN.
    const bool hides_keys =
        flags != 0 && ((params.causal && min(tile_start + kTileKv, work.kv_end) - 1 > work.first_position) ||
                       (params.window_left >= 0 && tile_start < work.last_position - params.window_left));
    if (!hides_keys) {
      CpAsyncArriveNoinc(full);
      return;
    }
    CpAsyncWaitAll();
    constexpr uint32_t kExponent = std::is_same_v<T, __half> ? 0x7c007c00u : 0x7f807f80u;
    uint32_t warp_bits = 0;  // bit r: row 32 * warp + r held a non-finite value
#pragma unroll
    for (int set = 0; set < kSets; ++set) {
      uint32_t found = 0;
#pragma unroll
      for (int k = 0; k < kChunks / 2; ++k) {
        const uint32_t address = (row_smem[set] ^ (((2 * k) % 8) << 4)) + (k / 4) * Shape::kKvBlockBytes;
        uint4* chunk = static_cast<uint4*>(__cvta_shared_to_generic(address));
        const uint4 bits = *chunk;
        const uint32_t bad[4] = {__vcmpeq2(bits.x & kExponent, kExponent), __vcmpeq2(bits.y & kExponent, kExponent),
                                 __vcmpeq2(bits.z & kExponent, kExponent), __vcmpeq2(bits.w & kExponent, kExponent)};
        const uint32_t any = bad[0] | bad[1] | bad[2] | bad[3];
        if (any != 0) *chunk = make_uint4(bits.x & ~bad[0], bits.y & ~bad[1], bits.z & ~bad[2], bits.w & ~bad[3]);
        found |= any;
      }
      // Lane pair p (lanes 2p, 2p + 1) holds row 16 * set + p: its votes are bits 2p and 2p + 1,
      // folded onto bit 2p, then the even bits gathered into the low 16.
      const uint32_t votes = __ballot_sync(0xffffffffu, found != 0);
      uint32_t pairs = (votes | (votes >> 1)) & 0x55555555u;
      pairs = (pairs | (pairs >> 1)) & 0x33333333u;
      pairs = (pairs | (pairs >> 2)) & 0x0f0f0f0fu;
      pairs = (pairs | (pairs >> 4)) & 0x00ff00ffu;
      pairs = (pairs | (pairs >> 8)) & 0x0000ffffu;
      warp_bits |= pairs << (16 * set);
    }
    if (lane == 0) *static_cast<uint32_t*>(__cvta_shared_to_generic(flags + 4 * warp)) = warp_bits;
    FenceProxyAsync();  // generic-proxy writes, read next by wgmma (the async proxy)
    MbarrierArrive(full);
  };

  const int n = work.num_kv_tiles;
  constexpr int kStages = Shape::kStages;
  // Fill u of a stage waits for the consumers' release of fill u - 1: parity (u & 1) ^ 1.
  auto load_k = [&](int tile) {
    const int stage = (first + tile) % kStages;
    load(k_pool, k_ids, tile, smem + Shape::kKOffset + stage * Shape::kKvBytes, barriers + 8 * (kStages + stage),
         barriers + 8 * stage, (((first + tile) / kStages) & 1) ^ 1, 0);
  };
  auto load_v = [&](int tile) {
    const int stage = (first + tile) % kStages;
    load(v_pool, v_ids, tile, smem + Shape::kVOffset + stage * Shape::kKvBytes,
         barriers + 8 * (3 * kStages + stage), barriers + 8 * (2 * kStages + stage),
         (((first + tile) / kStages) & 1) ^ 1, smem + Shape::kFlagOffset + stage * Shape::kFlagBytes);
  };
  // The consumers need K_j before V_{j-1}: that is the order of issue.
  if (n > 0) load_k(0);
  for (int tile = 1; tile < n; ++tile) {
    load_k(tile);
    load_v(tile - 1);
  }
  if (n > 0) load_v(n - 1);
}

}  // namespace attnd::cuda::prefill::hopper
