// Batch prefill attention over the paged KV cache (DESIGN 4.3): the kernel template.
//
// One CTA (4 warps) computes one query tile of packed rows (token, head-in-group) of one request
// against one KV head, streaming the request's keys in tiles of kTileKv through shared memory:
//   S = Q K^T (mma.sync m16n8k16, fp32), online softmax (m, d, o) in the log2 domain,
//   O += P V (P rounded to the MMA type).
// Warps split the query rows (tiles of 64 and 128 rows: 4 x 1) or the keys of each KV tile
// (tile of 16 rows: 1 x 4, merged through shared memory at the end, in warp order).
//
// Shared memory holds Q [kTileRows][D], K [kTileKv][D], V [kTileKv][D], all in the MMA type,
// rows of D/8 16-byte chunks with chunk c of row r stored at c ^ (r % 8), so that the 8 row
// addresses of every ldmatrix phase and of every cp.async wave hit distinct banks.
//
// Pipeline, two barriers per KV tile: K of tile j+1 loads while P V of tile j runs, V of tile
// j+1 while Q K^T and the softmax of tile j+1 run, both with cp.async. Caches of another type than q (fp8, or the other 16-bit type) land
// raw and are converted in shared memory by the threads that loaded them (KvTileLoader).
#pragma once

#include <cstdint>
#include <type_traits>
#include <utility>

#include "cp_async.cuh"
#include "fp8.cuh"
#include "math.cuh"
#include "mma.cuh"
#include "prefill_keys.cuh"
#include "prefill_kv_loader.cuh"
#include "prefill_params.h"
#include "softmax.cuh"

namespace attnd::cuda::prefill {


constexpr int KvBlocksPerWarp(int tile_rows, int head_dim) {
  // 16-key blocks each warp multiplies per KV tile. Bounded by registers: a thread holds
  // kMmaQ * kMmaKv * 8 scores and kMmaQ * D / 2 output accumulators.
  if (tile_rows == 16) return head_dim == 256 ? 1 : 2;
  if (tile_rows == 64) return head_dim == 64 ? 8 : 4;
  return 4;  // 128 rows, head_dim 64 or 128
}

// kRawKvBytes: bytes per element of a cache that lands raw beside the tiles (fp8: 1), else 0.
template <int kTileRowsArg, int kHeadDimArg, int kRawKvBytes>
struct TileShape {
  static constexpr int kTileRows = kTileRowsArg;
  static constexpr int kHeadDim = kHeadDimArg;
  static constexpr int kWarpsQ = kTileRows == 16 ? 1 : 4;
  static constexpr int kWarpsKv = 4 / kWarpsQ;
  static constexpr int kMmaQ = kTileRows / (16 * kWarpsQ);  // 16-row blocks per warp
  static constexpr int kMmaD = kHeadDim / 16;
  static constexpr int kMmaKv = KvBlocksPerWarp(kTileRows, kHeadDim);
  static constexpr int kTileKv = 16 * kMmaKv * kWarpsKv;
  static constexpr int kChunks = kHeadDim / 8;  // 16-byte chunks per row in shared memory
  static constexpr int kQElements = kTileRows * kHeadDim;
  static constexpr int kKvElements = kTileKv * kHeadDim;
  static constexpr int kRawBytes = kRawKvBytes * kKvElements;  // per raw tile (K, V)
  static constexpr int kTableBytes = 8 * 2 * 2 * kTileKv;  // KvOffsetTable, two tiles
  // Keys of tiles that hide keys, 1 where V held a non-finite value: the causal range, then the
  // window range (see PrefillCta).
  static constexpr int kFlagRange = kTileRows + 2 * kTileKv;
  static constexpr int kFlagBytes = 2 * kFlagRange;
  static constexpr int kLoopBytes =
      2 * (kQElements + 2 * kKvElements) + 2 * kRawBytes + kTableBytes + kFlagBytes;
  // Cross-warp merge of the 1 x 4 layout: o [4][16][D + 8] floats (padded against bank
  // conflicts), then m and d [4][16].
  static constexpr int kMergeStride = kHeadDim + 8;
  static constexpr int kMergeBytes = kWarpsKv == 1 ? 0 : 4 * (4 * 16 * kMergeStride + 2 * 4 * 16);
  static constexpr int kSmemBytes = kLoopBytes > kMergeBytes ? kLoopBytes : kMergeBytes;
  // The row flags are read after the loop, while other warps may already write the merge.
  static_assert(kMergeBytes <= kLoopBytes - kFlagBytes, "row flags overlap the 1 x 4 merge");

  static_assert(kMmaQ >= 1 && kMmaQ * 16 * kWarpsQ == kTileRows, "query tile");
  static_assert(kHeadDim >= 64, "the swizzle needs at least 8 chunks per row");
};

// Byte offset, within a swizzled tile, of chunk 2 * step + (lane bit) of a row whose low three
// bits are the lane's: with z = lane bit ^ (row & 7), the chunk lands at
// 8 * (step / 4) + ((2 * (step % 4)) ^ z). Written this way the compiler keeps four per-lane
// registers and folds the rest into ldmatrix immediates instead of hoisting one address per
// (step, block) pair.
template <int kStep>
__device__ __forceinline__ uint32_t SwizzledStepBytes(uint32_t z) {
  return 128u * (kStep / 4) + ((static_cast<uint32_t>(2 * (kStep % 4)) ^ z) << 4);
}

// Calls f(std::integral_constant<int, i>) for i in [0, n), so the index is a template constant.
template <int kCount, typename F, int... kIndices>
__device__ __forceinline__ void StaticForImpl(F&& f, std::integer_sequence<int, kIndices...>) {
  (f(std::integral_constant<int, kIndices>{}), ...);
}
template <int kCount, typename F>
__device__ __forceinline__ void StaticFor(F&& f) {
  StaticForImpl<kCount>(f, std::make_integer_sequence<int, kCount>{});
}

// Pairwise reduction of values[0..kCount) in a fixed tree order.
template <int kCount, typename Op>
__device__ __forceinline__ float TreeReduce(float (&values)[kCount], Op op) {
#pragma unroll
  for (int stride = 1; stride < kCount; stride *= 2) {
#pragma unroll
    for (int i = 0; i + stride < kCount; i += 2 * stride) values[i] = op(values[i], values[i + stride]);
  }
  return values[0];
}




// One CTA's work: logical CTA `cta` of the launch whose work list is `items` (item cta /
// num_kv_heads, KV head cta % num_kv_heads), in the dynamic shared memory (Shape::kSmemBytes).
// BatchPrefillKernel runs it with cta = blockIdx.x; the POD kernel (pod.cuh) with the logical
// block id its scheduler hands out. `items` is a reference into the kernel's parameters, so the
// pointer is read where it is used (late, as before this was a function) and no register holds
// it through the KV loop.
// QO: the type of q and o in memory. T: the MMA type (QO, except bf16 q over an fp16 cache,
// which multiplies in fp16: K stays exact and bf16 q converts exactly below 65504).
// Stored: the cache's type.
template <typename Shape, typename QO, typename T, typename Stored>
__device__ __forceinline__ void PrefillCta(const KernelParams& params, const WorkItem* const& items, uint32_t cta) {
  constexpr int kHeadDim = Shape::kHeadDim;
  constexpr int kTileRows = Shape::kTileRows;
  constexpr int kTileKv = Shape::kTileKv;
  constexpr int kMmaQ = Shape::kMmaQ;
  constexpr int kMmaD = Shape::kMmaD;
  constexpr int kMmaKv = Shape::kMmaKv;
  constexpr int kChunks = Shape::kChunks;
  using Table = KvOffsetTable<Shape>;
  using Loader = KvTileLoader<Shape, T, Stored>;

  extern __shared__ __align__(128) uint8_t shared_bytes[];
  T* q_tile = reinterpret_cast<T*>(shared_bytes);  // [kTileRows][D] swizzled
  T* k_tile = q_tile + Shape::kQElements;          // [kTileKv][D] swizzled
  T* v_tile = k_tile + Shape::kKvElements;         // [kTileKv][D] swizzled
  // fp8 caches: raw [kTileKv][D] bytes of K, then of V, unswizzled.
  uint8_t* k_raw = reinterpret_cast<uint8_t*>(v_tile + Shape::kKvElements);
  uint8_t* v_raw = k_raw + Shape::kRawBytes;
  int64_t* offset_table = reinterpret_cast<int64_t*>(v_raw + Shape::kRawBytes);  // KvOffsetTable
  // 1 where a key of a tile that hides keys had a non-finite V (written in the loop, read after
  // it). A tile that hides keys from causal rows covers keys (first_position - kTileKv,
  // last_position + kTileKv), one that hides keys left of the window keys [first_position -
  // window_left, last_position - window_left + kTileKv): each range is under kFlagRange keys,
  // and each key is written once, into the range its tile is counted in (causal first).
  uint8_t* bad_v_causal = reinterpret_cast<uint8_t*>(offset_table) + Shape::kTableBytes;  // [kFlagRange]
  uint8_t* bad_v_window = bad_v_causal + Shape::kFlagRange;                                  // [kFlagRange]
  for (int i = threadIdx.x; i < Shape::kFlagBytes; i += kThreads) bad_v_causal[i] = 0;  // before the first barrier

  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const int warp_q = Shape::kWarpsQ == 1 ? 0 : warp;
  const int warp_kv = Shape::kWarpsKv == 1 ? 0 : warp;
  const int kv_head = cta % params.num_kv_heads;
  const WorkItem item = items[cta / params.num_kv_heads];

  const int request = item.request;
  const int qo_start = params.qo_indptr[request];
  const int q_len = params.qo_indptr[request + 1] - qo_start;
  const int page_begin = params.page_indptr[request];
  const int num_pages = params.page_indptr[request + 1] - page_begin;
  const int kv_len =
      num_pages == 0 ? 0 : ((num_pages - 1) << params.page_size_log2) + params.last_page_len[request];
  const int group = params.group_size;
  const int row_start = item.packed_row_start;
  const int row_end = min(row_start + kTileRows, q_len * group);
  // Query token i of the request sits at position kv_len - q_len + i (bottom-right aligned).
  const int position_offset = kv_len - q_len;
  const int first_position = position_offset + row_start / group;
  const int last_position = position_offset + (row_end - 1) / group;

  // Keys this CTA must visit: the chunk, cut by the causal limit of its last row and the
  // window of its first row. Rows that see fewer keys are masked per element.
  int kv_begin = item.kv_chunk_start;
  int kv_end = min(item.kv_chunk_end, kv_len);
  if (params.causal) kv_end = min(kv_end, last_position + 1);
  if (params.window_left >= 0) kv_begin = max(kv_begin, first_position - params.window_left);
  const int num_kv_tiles = kv_end > kv_begin ? (kv_end - kv_begin + kTileKv - 1) / kTileKv : 0;

  // --- Q tile: packed rows past the request's end are zero-filled and never stored.
  constexpr int kQPasses = kTileRows * kChunks / kThreads;
  {
    const QO* q = static_cast<const QO*>(params.q);
    const int chunk = threadIdx.x % kChunks;
#pragma unroll
    for (int pass = 0; pass < kQPasses; ++pass) {
      const int row = threadIdx.x / kChunks + pass * (kThreads / kChunks);
      const int packed = row_start + row;
      const bool valid = packed < row_end;
      const QO* source = q;
      if (valid) {
        const int token = packed / group;
        const int head = kv_head * group + (packed - token * group);
        source += (static_cast<int64_t>(qo_start + token) * params.num_qo_heads + head) * kHeadDim +
                  chunk * 8;
      }
      CpAsync16(SharedAddress(q_tile + Swizzle<kHeadDim>(row, chunk)), source, valid);
    }
  }
  CpAsyncCommit();

  const Stored* k_pool = static_cast<const Stored*>(params.k_pool) + kv_head * params.kv_head_stride;
  const Stored* v_pool = static_cast<const Stored*>(params.v_pool) + kv_head * params.kv_head_stride;
  const int32_t* k_page_ids = params.k_page_ids + page_begin;
  const int32_t* v_page_ids = params.v_page_ids + page_begin;

  int32_t next_ids[Table::kPerThread];
  if (num_kv_tiles > 0) {
    Table::LoadIds(next_ids, k_page_ids, v_page_ids, params, kv_begin, kv_end);
    Table::StoreOffsets(offset_table, next_ids, params, kv_begin);
  }
  __syncthreads();
  if (num_kv_tiles > 0) Loader::Issue(k_tile, k_raw, k_pool, offset_table);
  CpAsyncCommit();
  if (num_kv_tiles > 0) Loader::Issue(v_tile, v_raw, v_pool, offset_table + kTileKv);
  CpAsyncCommit();
  CpAsyncWait<1>();  // Q and the first K tile have landed; the first V tile may be in flight
  Loader::Convert(k_tile, k_raw);
  if constexpr (!std::is_same_v<QO, T>) {
    // q converts in place: each thread rewrites the chunks it loaded.
    const int chunk = threadIdx.x % kChunks;
#pragma unroll
    for (int pass = 0; pass < kQPasses; ++pass) {
      const int row = threadIdx.x / kChunks + pass * (kThreads / kChunks);
      uint4* bits = reinterpret_cast<uint4*>(q_tile + Swizzle<kHeadDim>(row, chunk));
      const uint4 value = *bits;
      *bits = make_uint4(ConvertPair<T, QO>(value.x), ConvertPair<T, QO>(value.y), ConvertPair<T, QO>(value.z),
                         ConvertPair<T, QO>(value.w));
    }
  }
  __syncthreads();

  // Positions of this thread's rows: block mq, half h holds row 16 * mq + 8 * h + lane / 4.
  int row_position[kMmaQ][2];
#pragma unroll
  for (int mq = 0; mq < kMmaQ; ++mq) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = warp_q * 16 * kMmaQ + mq * 16 + h * 8 + lane / 4;
      row_position[mq][h] = position_offset + (row_start + row) / group;
    }
  }

  const bool soft_cap = params.soft_cap > 0.0f;
  // Without a cap, scores stay raw and exp2(s * scale_log2 - m) folds the scale into one FFMA.
  const float scale_log2 = soft_cap ? 1.0f : params.score_scale * kLog2e;
  const float cap_input_scale = soft_cap ? params.score_scale / params.soft_cap : 0.0f;
  const float cap_log2 = params.soft_cap * kLog2e;

  float o[kMmaQ][kMmaD][8];
  float row_max[kMmaQ][2];  // log2 domain; -inf until a row sees a key
  float row_sum[kMmaQ][2];  // this thread's share; summed over the quad at the end
#pragma unroll
  for (int mq = 0; mq < kMmaQ; ++mq) {
#pragma unroll
    for (int db = 0; db < kMmaD; ++db) {
#pragma unroll
      for (int e = 0; e < 8; ++e) o[mq][db][e] = 0.0f;
    }
    row_max[mq][0] = row_max[mq][1] = -INFINITY;
    row_sum[mq][0] = row_sum[mq][1] = 0.0f;
  }

  // ldmatrix lane addresses (see SwizzledStepBytes). Q and V lanes 0-7/8-15/16-23/24-31 give
  // rows 0-7/8-15/0-7/8-15 at chunks +0/+0/+1/+1; K lanes give rows 0-7/0-7/8-15/8-15 at
  // chunks +0/+1/+0/+1, so x4 returns (b0, b1) of two n8 key blocks.
  constexpr int kRowBytes = 2 * kHeadDim;
  const int warp_key_base = warp_kv * 16 * kMmaKv;
  const uint32_t q_lane = SharedAddress(q_tile) +
                          (warp_q * 16 * kMmaQ + (lane % 8) + 8 * ((lane / 8) % 2)) * kRowBytes;
  const uint32_t k_lane = SharedAddress(k_tile) + (warp_key_base + (lane % 8) + 8 * (lane / 16)) * kRowBytes;
  const uint32_t v_lane =
      SharedAddress(v_tile) + (warp_key_base + (lane % 8) + 8 * ((lane / 8) % 2)) * kRowBytes;
  const uint32_t q_z = (lane / 16) ^ (lane % 8);
  const uint32_t k_z = ((lane / 8) % 2) ^ (lane % 8);
  const uint32_t v_z = q_z;
  const int causal_base = first_position - kTileKv + 1;  // key of bad_v_causal[0]
  const int window_base = first_position - params.window_left;
  bool saw_bad_v = false;  // this thread zeroed a non-finite V value

  for (int tile = 0; tile < num_kv_tiles; ++tile) {
    const int tile_start = kv_begin + tile * kTileKv;
    const bool has_next = tile + 1 < num_kv_tiles;
    // The table holds two tiles' offsets: the next one is written while threads behind may
    // still read this one for their V issue.
    int64_t* next_table = offset_table + ((tile + 1) % 2) * Table::kEntries;
    // The next tile's page ids load while Q K^T runs.
    if (has_next) Table::LoadIds(next_ids, k_page_ids, v_page_ids, params, tile_start + kTileKv, kv_end);

    // S = Q K^T. s[mq][jb]: [0,1] row g keys 2t,2t+1; [2,3] row g+8; [4..7] the same, keys +8,
    // with g = lane / 4, t = lane % 4 (the m16n8k16 accumulator layout, two n8 blocks).
    float s[kMmaQ][kMmaKv][8];
#pragma unroll
    for (int mq = 0; mq < kMmaQ; ++mq) {
#pragma unroll
      for (int jb = 0; jb < kMmaKv; ++jb) {
#pragma unroll
        for (int e = 0; e < 8; ++e) s[mq][jb][e] = 0.0f;
      }
    }
    StaticFor<kMmaD>([&](auto ks_constant) {
      constexpr int ks = decltype(ks_constant)::value;
      uint32_t qa[kMmaQ][4];
#pragma unroll
      for (int mq = 0; mq < kMmaQ; ++mq) {
        LdMatrixX4(q_lane + mq * 16 * kRowBytes + SwizzledStepBytes<ks>(q_z), qa[mq]);
      }
#pragma unroll
      for (int jb = 0; jb < kMmaKv; ++jb) {
        uint32_t kb[4];
        LdMatrixX4(k_lane + jb * 16 * kRowBytes + SwizzledStepBytes<ks>(k_z), kb);
#pragma unroll
        for (int mq = 0; mq < kMmaQ; ++mq) {
          Mma16816<T>(s[mq][jb], qa[mq], kb[0], kb[1]);
          Mma16816<T>(s[mq][jb] + 4, qa[mq], kb[2], kb[3]);
        }
      }
    });

    // Non-finite inputs (q, or a key's k) make a score NaN or +-inf: s * 0 + s turns both into
    // NaN and leaves finite scores unchanged, before the cap could map inf to a finite value and
    // before -inf could read as a masked key. Masking below overwrites the scores of keys a row
    // does not see; a NaN left makes p, the row's sum and o NaN (reported at the end).
#pragma unroll
    for (int mq = 0; mq < kMmaQ; ++mq) {
#pragma unroll
      for (int jb = 0; jb < kMmaKv; ++jb) {
#pragma unroll
        for (int e = 0; e < 8; ++e) s[mq][jb][e] = fmaf(s[mq][jb][e], 0.0f, s[mq][jb][e]);
      }
    }
    if (soft_cap) {
#pragma unroll
      for (int mq = 0; mq < kMmaQ; ++mq) {
#pragma unroll
        for (int jb = 0; jb < kMmaKv; ++jb) {
#pragma unroll
          for (int e = 0; e < 8; ++e) s[mq][jb][e] = SoftCapLog2(s[mq][jb][e], cap_input_scale, cap_log2);
        }
      }
    }

    // Per-element masking only where some row of the tile can see a masked key.
    const int tile_end = tile_start + kTileKv;
    const bool needs_mask = tile_end > kv_end || (params.causal && tile_end - 1 > first_position) ||
                            (params.window_left >= 0 && tile_start < last_position - params.window_left);
    if (needs_mask) {
      // Per row the keys it sees (VisibleKeys), as offsets from this thread's first key of the
      // tile: two compares with constants per element.
      const int base = tile_start + warp_key_base + 2 * (lane % 4);
#pragma unroll
      for (int mq = 0; mq < kMmaQ; ++mq) {
        const KeyRange rows[2] = {VisibleKeys(params, kv_end, row_position[mq][0], base),
                                  VisibleKeys(params, kv_end, row_position[mq][1], base)};
#pragma unroll
        for (int jb = 0; jb < kMmaKv; ++jb) {
#pragma unroll
          for (int e = 0; e < 8; ++e) {
            const int offset = jb * 16 + (e / 4) * 8 + (e % 2);
            const KeyRange& row = rows[(e / 2) % 2];
            if (offset >= row.high || offset < row.low) s[mq][jb][e] = -INFINITY;
          }
        }
      }
    }

    // Online softmax: new row max, rescale o and d, s -> p.
    float subtract[kMmaQ][2];
    float rescale[kMmaQ][2];
    bool any_rescale = false;
#pragma unroll
    for (int mq = 0; mq < kMmaQ; ++mq) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        // Tree-shaped (short dependency chains: fixed-latency waits are the top stall).
        float block_max[kMmaKv];
#pragma unroll
        for (int jb = 0; jb < kMmaKv; ++jb) {
          block_max[jb] = fmaxf(fmaxf(s[mq][jb][2 * h], s[mq][jb][2 * h + 1]),
                                fmaxf(s[mq][jb][4 + 2 * h], s[mq][jb][4 + 2 * h + 1]));
        }
        float tile_max = TreeReduce<kMmaKv>(block_max, [](float a, float b) { return fmaxf(a, b); });
        tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
        tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
        const float new_max = fmaxf(row_max[mq][h], tile_max * scale_log2);
        // A row with no visible key yet keeps m = -inf; subtract 0 so exp2 gives 0, not NaN.
        subtract[mq][h] = new_max == -INFINITY ? 0.0f : new_max;
        rescale[mq][h] = FastExp2(row_max[mq][h] - subtract[mq][h]);
        any_rescale |= new_max != row_max[mq][h];
        row_max[mq][h] = new_max;
        row_sum[mq][h] *= rescale[mq][h];
      }
    }
    // Once the running maxima settle, most tiles change none of the warp's rows: skip the
    // multiply of every accumulator by exactly 1 (bitwise the same result).
    if (__any_sync(0xffffffffu, any_rescale)) {
#pragma unroll
      for (int mq = 0; mq < kMmaQ; ++mq) {
#pragma unroll
        for (int db = 0; db < kMmaD; ++db) {
#pragma unroll
          for (int e = 0; e < 8; ++e) o[mq][db][e] *= rescale[mq][(e / 2) % 2];
        }
      }
    }
    // P as the A operand of m16n8k16, packed now so the fp32 scores die before P V.
    uint32_t p_frag[kMmaQ][kMmaKv][4];
#pragma unroll
    for (int mq = 0; mq < kMmaQ; ++mq) {
      float block_sum[2][kMmaKv];
#pragma unroll
      for (int jb = 0; jb < kMmaKv; ++jb) {
        float p[8];
#pragma unroll
        for (int e = 0; e < 8; ++e) p[e] = FastExp2(fmaf(s[mq][jb][e], scale_log2, -subtract[mq][(e / 2) % 2]));
        block_sum[0][jb] = (p[0] + p[1]) + (p[4] + p[5]);
        block_sum[1][jb] = (p[2] + p[3]) + (p[6] + p[7]);
#pragma unroll
        for (int i = 0; i < 4; ++i) p_frag[mq][jb][i] = PackFloat2<T>(p[2 * i], p[2 * i + 1]);
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        row_sum[mq][h] += TreeReduce<kMmaKv>(block_sum[h], [](float a, float b) { return a + b; });
      }
    }

    // One barrier: every warp is done reading this K tile, this V tile and the next offsets are
    // visible. Then the next K tile loads while P V runs. (Issuing it before the softmax instead
    // costs registers while the fp32 scores are live: the 128-row tile then spills.)
    if (has_next) Table::StoreOffsets(next_table, next_ids, params, tile_start + kTileKv);
    CpAsyncWait<0>();  // this V tile (the only group in flight)
    Loader::Convert(v_tile, v_raw);
    // P V multiplies every row's p by every key's v: a key masked for a row has p = 0, and
    // 0 * NaN = NaN. In a tile where some row does not see some key (causal, window; keys past
    // kv_end are zero-filled already), non-finite V values are zeroed and their keys flagged;
    // the epilogue makes the rows that see a flagged key NaN.
    const bool causal_hides = params.causal && min(tile_end, kv_end) - 1 > first_position;
    if (causal_hides || (params.window_left >= 0 && tile_start < last_position - params.window_left)) {
      uint8_t* flags = causal_hides ? bad_v_causal + (tile_start - causal_base) : bad_v_window + (tile_start - window_base);
      saw_bad_v |= Loader::ZeroNonFinite(v_tile, flags);
    }
    __syncthreads();
    if (has_next) Loader::Issue(k_tile, k_raw, k_pool, next_table);
    CpAsyncCommit();

    // O += P V.
#pragma unroll
    for (int jb = 0; jb < kMmaKv; ++jb) {
      StaticFor<kMmaD>([&](auto db_constant) {
        constexpr int db = decltype(db_constant)::value;
        uint32_t vb[4];
        LdMatrixX4Trans(v_lane + jb * 16 * kRowBytes + SwizzledStepBytes<db>(v_z), vb);
#pragma unroll
        for (int mq = 0; mq < kMmaQ; ++mq) {
          Mma16816<T>(o[mq][db], p_frag[mq][jb], vb[0], vb[1]);
          Mma16816<T>(o[mq][db] + 4, p_frag[mq][jb], vb[2], vb[3]);
        }
      });
    }

    // One barrier: every warp is done with this V tile and the next K tile is visible. Then the
    // next V tile loads while the next Q K^T and softmax run.
    CpAsyncWait<0>();  // the next K tile (the only group in flight)
    Loader::Convert(k_tile, k_raw);
    __syncthreads();
    if (has_next) Loader::Issue(v_tile, v_raw, v_pool, next_table + kTileKv);
    CpAsyncCommit();
  }

  CpAsyncWait<0>();
  // The loop's tiles are free for the epilogue; and was any non-finite V value zeroed?
  const bool cta_saw_bad_v = __syncthreads_or(saw_bad_v) != 0;

  // A non-finite v of a key a row saw left a NaN or inf in its o (o * 0 adds NaN to the row's
  // sum then, exactly 0 otherwise), or, where the tile hid keys, a row flag. From here on a NaN
  // sum means the row read a non-finite input (NaN in, NaN out: o and lse NaN); 0 means it saw
  // no key.
#pragma unroll
  for (int mq = 0; mq < kMmaQ; ++mq) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      if (!cta_saw_bad_v) continue;  // the common case
      // Rare: the keys this row sees, in this CTA's chunk, within each flag range.
      const KeyRange row = VisibleKeys(params, kv_end, row_position[mq][h], 0);
      const int first = max(kv_begin, row.low);
      const int last = row.high - 1;
      bool sees_bad_v = false;
#pragma unroll 1
      for (int key = max(first, causal_base); key <= min(last, causal_base + Shape::kFlagRange - 1); ++key) {
        sees_bad_v |= bad_v_causal[key - causal_base] != 0;
      }
      if (params.window_left >= 0) {
#pragma unroll 1
        for (int key = max(first, window_base); key <= min(last, window_base + Shape::kFlagRange - 1); ++key) {
          sees_bad_v |= bad_v_window[key - window_base] != 0;
        }
      }
      if (sees_bad_v) row_sum[mq][h] = NAN;
    }
#pragma unroll
    for (int db = 0; db < kMmaD; ++db) {
#pragma unroll
      for (int e = 0; e < 8; ++e) row_sum[mq][(e / 2) % 2] = fmaf(o[mq][db][e], 0.0f, row_sum[mq][(e / 2) % 2]);
    }
  }
  // Row sums over the quad, in a fixed order.
#pragma unroll
  for (int mq = 0; mq < kMmaQ; ++mq) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      row_sum[mq][h] += __shfl_xor_sync(0xffffffffu, row_sum[mq][h], 1);
      row_sum[mq][h] += __shfl_xor_sync(0xffffffffu, row_sum[mq][h], 2);
    }
  }

  QO* o_out = static_cast<QO*>(params.o);
  QO* o_stage = reinterpret_cast<QO*>(q_tile);  // the Q tile, reused as [kTileRows][D] of QO
  // A split item writes fp32 partials (normalised by its own sum, lse -inf when its chunk held
  // no visible key) for MergeStates. Read late: no register holds it through the loop.
  const WorkItem* my_item = items + cta / params.num_kv_heads;
  const int partial_first = __ldcg(&my_item->partial_first);
  const int partial_stride = __ldcg(&my_item->partial_stride);
  if (partial_first >= 0) {
    if constexpr (Shape::kWarpsKv == 1) {
#pragma unroll
      for (int mq = 0; mq < kMmaQ; ++mq) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const float sum = row_sum[mq][h];
          const float inverse = sum != 0.0f ? params.v_scale / sum : 0.0f;
          const int packed_row = row_start + warp_q * 16 * kMmaQ + mq * 16 + h * 8 + lane / 4;
          if (packed_row < row_end) {
            const int token = packed_row / group;
            const int head = kv_head * group + (packed_row - token * group);
            const int64_t slot_row =
                (static_cast<int64_t>(partial_first) + static_cast<int64_t>(token) * partial_stride) *
                    params.num_qo_heads + head;
            float* out = params.partial_o + slot_row * kHeadDim;
#pragma unroll
            for (int db = 0; db < kMmaD; ++db) {
#pragma unroll
              for (int half = 0; half < 2; ++half) {
                *reinterpret_cast<float2*>(out + 16 * db + 8 * half + 2 * (lane % 4)) =
                    make_float2(o[mq][db][4 * half + 2 * h] * inverse, o[mq][db][4 * half + 2 * h + 1] * inverse);
              }
            }
            if (lane % 4 == 0) {
              params.partial_lse[slot_row] = sum != 0.0f ? (row_max[mq][h] + FastLog2(sum)) * kLn2 : -INFINITY;
            }
          }
        }
      }
      return;
    }
  }
  if constexpr (Shape::kWarpsKv == 1) {
    // Each warp owns its rows: stage them in its own rows of the Q tile, then store 16-byte
    // chunks. A row that saw no key has d = 0 and o = 0: it stores 0 and lse = -inf.
#pragma unroll
    for (int mq = 0; mq < kMmaQ; ++mq) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float sum = row_sum[mq][h];
        const float inverse = sum != 0.0f ? params.v_scale / sum : 0.0f;
        const int row = warp_q * 16 * kMmaQ + mq * 16 + h * 8 + lane / 4;
#pragma unroll
        for (int db = 0; db < kMmaD; ++db) {
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            const int chunk = 2 * db + half;
            const uint32_t packed = PackFloat2<QO>(o[mq][db][4 * half + 2 * h] * inverse,
                                                   o[mq][db][4 * half + 2 * h + 1] * inverse);
            *reinterpret_cast<uint32_t*>(o_stage + Swizzle<kHeadDim>(row, chunk) + 2 * (lane % 4)) = packed;
          }
        }
        if (params.lse != nullptr && lane % 4 == 0 && row_start + row < row_end) {
          const int packed_row = row_start + row;
          const int token = packed_row / group;
          const int head = kv_head * group + (packed_row - token * group);
          params.lse[static_cast<int64_t>(qo_start + token) * params.num_qo_heads + head] =
              sum != 0.0f ? (row_max[mq][h] + FastLog2(sum)) * kLn2 : -INFINITY;
        }
      }
    }
    __syncwarp();
    constexpr int kWarpRows = 16 * kMmaQ;
#pragma unroll
    for (int i = lane; i < kWarpRows * kChunks; i += 32) {
      const int row = warp_q * kWarpRows + i / kChunks;
      const int chunk = i % kChunks;
      const int packed_row = row_start + row;
      if (packed_row < row_end) {
        const int token = packed_row / group;
        const int head = kv_head * group + (packed_row - token * group);
        *reinterpret_cast<uint4*>(o_out + (static_cast<int64_t>(qo_start + token) * params.num_qo_heads + head) *
                                              kHeadDim + chunk * 8) =
            *reinterpret_cast<const uint4*>(o_stage + Swizzle<kHeadDim>(row, chunk));
      }
    }
  } else {
    // 1 x 4 warps: each warp holds (m, d, o) over its quarter of every KV tile. Merge them in
    // warp order (deterministic) through shared memory.
    constexpr int kStride = Shape::kMergeStride;
    float* merge_o = reinterpret_cast<float*>(shared_bytes);  // [4][16][kStride]
    float* merge_m = merge_o + 4 * 16 * kStride;              // [4][16]
    float* merge_d = merge_m + 4 * 16;                        // [4][16]
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = h * 8 + lane / 4;
      if (lane % 4 == 0) {
        merge_m[warp * 16 + row] = row_max[0][h];
        merge_d[warp * 16 + row] = row_sum[0][h];
      }
#pragma unroll
      for (int db = 0; db < kMmaD; ++db) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int dim = 16 * db + 8 * half + 2 * (lane % 4);
          *reinterpret_cast<float2*>(merge_o + (warp * 16 + row) * kStride + dim) =
              make_float2(o[0][db][4 * half + 2 * h], o[0][db][4 * half + 2 * h + 1]);
        }
      }
    }
    __syncthreads();
    constexpr int kDimsPerThread = kHeadDim / 8;
    const int row = threadIdx.x / 8;
    const int dim_begin = (threadIdx.x % 8) * kDimsPerThread;
    float merged_max = -INFINITY;
#pragma unroll
    for (int w = 0; w < 4; ++w) merged_max = fmaxf(merged_max, merge_m[w * 16 + row]);
    const float subtract = merged_max == -INFINITY ? 0.0f : merged_max;
    float weight[4];
    float sum = 0.0f;
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      weight[w] = FastExp2(merge_m[w * 16 + row] - subtract);
      sum += weight[w] * merge_d[w * 16 + row];
    }
    const float inverse = sum != 0.0f ? params.v_scale / sum : 0.0f;
    const int packed_row = row_start + row;
    if (packed_row < row_end && partial_first >= 0) {
      const int token = packed_row / group;
      const int head = kv_head * group + (packed_row - token * group);
      const int64_t slot_row =
          (static_cast<int64_t>(partial_first) + static_cast<int64_t>(token) * partial_stride) * params.num_qo_heads +
          head;
      float* out = params.partial_o + slot_row * kHeadDim + dim_begin;
#pragma unroll
      for (int c = 0; c < kDimsPerThread / 4; ++c) {
        float value[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int dim = dim_begin + 4 * c + j;
          float accumulated = 0.0f;
#pragma unroll
          for (int w = 0; w < 4; ++w) accumulated += weight[w] * merge_o[(w * 16 + row) * kStride + dim];
          value[j] = accumulated * inverse;
        }
        *reinterpret_cast<float4*>(out + 4 * c) = make_float4(value[0], value[1], value[2], value[3]);
      }
      if (threadIdx.x % 8 == 0) params.partial_lse[slot_row] = sum != 0.0f ? (merged_max + FastLog2(sum)) * kLn2 : -INFINITY;
    } else if (packed_row < row_end) {
      const int token = packed_row / group;
      const int head = kv_head * group + (packed_row - token * group);
      const int64_t out_row = static_cast<int64_t>(qo_start + token) * params.num_qo_heads + head;
#pragma unroll
      for (int c = 0; c < kDimsPerThread / 8; ++c) {
        uint32_t words[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          float value[2];
#pragma unroll
          for (int j = 0; j < 2; ++j) {
            const int dim = dim_begin + 8 * c + 2 * i + j;
            float accumulated = 0.0f;
#pragma unroll
            for (int w = 0; w < 4; ++w) accumulated += weight[w] * merge_o[(w * 16 + row) * kStride + dim];
            value[j] = accumulated * inverse;
          }
          words[i] = PackFloat2<QO>(value[0], value[1]);
        }
        *reinterpret_cast<uint4*>(o_out + out_row * kHeadDim + dim_begin + 8 * c) =
            make_uint4(words[0], words[1], words[2], words[3]);
      }
      if (params.lse != nullptr && threadIdx.x % 8 == 0) {
        params.lse[out_row] = sum != 0.0f ? (merged_max + FastLog2(sum)) * kLn2 : -INFINITY;
      }
    }
  }
}

template <typename Shape, typename QO, typename T, typename Stored>
__global__ void __launch_bounds__(kThreads)
    BatchPrefillKernel(const __grid_constant__ KernelParams params) {
  PrefillCta<Shape, QO, T, Stored>(params, params.items, blockIdx.x);
}

// Launches one instantiation; opts the kernel into the dynamic shared memory it needs.
template <int kTileRows, int kHeadDim, typename QO, typename Stored>
cudaError_t LaunchTile(const KernelParams& params, int32_t num_ctas, cudaStream_t stream, int* ctas_per_sm) {
  using Shape = TileShape<kTileRows, kHeadDim, sizeof(Stored) == 1 ? 1 : 0>;
  using Mma = std::conditional_t<std::is_same_v<QO, __nv_bfloat16> && std::is_same_v<Stored, __half>, __half, QO>;
  auto* kernel = &BatchPrefillKernel<Shape, QO, Mma, Stored>;
  cudaError_t error =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Shape::kSmemBytes);
  if (error != cudaSuccess) return error;
  if (ctas_per_sm != nullptr) {
    return cudaOccupancyMaxActiveBlocksPerMultiprocessor(ctas_per_sm, kernel, kThreads, Shape::kSmemBytes);
  }
  kernel<<<num_ctas, kThreads, Shape::kSmemBytes, stream>>>(params);
  return cudaGetLastError();
}

// Dispatches the dtype pair for one (tile, head_dim).
template <int kTileRows, int kHeadDim>
cudaError_t LaunchTileForTypes(const KernelParams& params, DType q_dtype, DType kv_dtype,
                               int32_t num_ctas, cudaStream_t stream, int* ctas_per_sm) {
  if (q_dtype == DType::kFloat16) {
    switch (kv_dtype) {
      case DType::kFloat16: return LaunchTile<kTileRows, kHeadDim, __half, __half>(params, num_ctas, stream, ctas_per_sm);
      case DType::kBFloat16: return LaunchTile<kTileRows, kHeadDim, __half, __nv_bfloat16>(params, num_ctas, stream, ctas_per_sm);
      case DType::kFloat8E4M3: return LaunchTile<kTileRows, kHeadDim, __half, __nv_fp8_e4m3>(params, num_ctas, stream, ctas_per_sm);
      default: break;
    }
  } else if (q_dtype == DType::kBFloat16) {
    switch (kv_dtype) {
      case DType::kFloat16: return LaunchTile<kTileRows, kHeadDim, __nv_bfloat16, __half>(params, num_ctas, stream, ctas_per_sm);
      case DType::kBFloat16: return LaunchTile<kTileRows, kHeadDim, __nv_bfloat16, __nv_bfloat16>(params, num_ctas, stream, ctas_per_sm);
      case DType::kFloat8E4M3: return LaunchTile<kTileRows, kHeadDim, __nv_bfloat16, __nv_fp8_e4m3>(params, num_ctas, stream, ctas_per_sm);
      default: break;
    }
  }
  return cudaErrorInvalidValue;
}

}  // namespace attnd::cuda::prefill
