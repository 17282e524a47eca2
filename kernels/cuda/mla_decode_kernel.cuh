// MLA decode (DESIGN 4.6): the kernel template. One CTA (8 warps) computes 64 rows (query
// token, head) of one request against one chunk of its latent keys, streamed in tiles of 32
// tokens through a 3-stage cp.async pipeline. Per tile:
//   1. S = Q [64 x D] K^T [D x 32], D = kv_lora_rank + rope_dim (ckv and kpe side by side in one
//      shared row). Split-K: warp w multiplies k-steps of quarter w / 2 for rows 32 * (w % 2)..,
//      all 32 keys (32 x 32 warp tiles: each ldmatrix'd fragment feeds four MMAs), and writes an
//      fp32 partial S; the four partials are summed in a fixed order by the softmax threads.
//   2. Online softmax, 4 threads per row (m, d in their registers): P (MMA type) and each row's
//      rescale factor to shared memory.
//   3. O [64 x rank] += P [64 x 32] V [32 x rank], V = the ckv part of the same tile. Warp w owns
//      rank / 8 output columns of all 64 rows (64 x 64 warp tiles for rank 512: 128 fp32
//      accumulators per thread), so each P and V fragment feeds 8 or 4 MMAs.
// Shared tiles (Q, K/V) are rows of D/8 16-byte chunks, chunk c of row r stored at c ^ (r % 8),
// so every ldmatrix phase and cp.async wave touches 8 distinct bank groups. fp8 caches land raw
// and are converted (exactly) into one tile of the MMA type by all threads after the barrier.
//
// The CTA's work depends on its unit alone (the rows of one request, a key range, fixed tile
// and split-K order), so a request's result is the same in any batch for the same chunking.
#pragma once

#include <cuda.h>  // CUtensorMap (a type only: nothing links libcuda)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "attnd/kernels/dtype.h"
#include "cp_async.cuh"
#include "fp8.cuh"
#include "math.cuh"
#include "mma.cuh"
#include "non_finite.cuh"
#include "plan/mla_work.h"
#include "softmax.cuh"
#include "vec.cuh"

namespace attnd::cuda::mla {

inline constexpr int kThreads = 256;
inline constexpr int kRows = plan::kMlaRowsPerCta;   // 64
inline constexpr int kTile = plan::kMlaTileTokens;   // 32
inline constexpr int kStages = 3;
inline constexpr int kRopeDim = 64;

// What one launch reads, resolved by the launcher (mla_decode.cu).
struct MlaParams {
  const void* q_nope;  // [T_q][num_heads][rank], q dtype
  const void* q_pe;    // [T_q][num_heads][64], q dtype
  void* o;             // [T_q][num_heads][rank], o dtype
  float* lse;          // [T_q][num_heads] or null
  const uint8_t* ckv_pool;  // [pages][page_size][rank], cache dtype
  const uint8_t* kpe_pool;  // [pages][page_size][64]
  int64_t ckv_page_bytes;
  int64_t kpe_page_bytes;
  const int32_t* page_indptr;   // [batch + 1]
  const int32_t* ckv_page_ids;  // k_indices
  const int32_t* kpe_page_ids;  // v_indices
  const plan::MlaWorkUnit* units;
  float* partial_o;    // [num_partials][num_heads][rank]
  float* partial_lse;  // [num_partials][num_heads]
  int32_t num_heads;
  int32_t page_size_log2;
  int32_t window_left;  // -1: none
  float score_scale_log2;  // sm_scale * ckv_scale * log2(e)
  float cap_input_scale;   // sm_scale * ckv_scale / soft_cap (soft cap only)
  float cap_log2;          // soft_cap * log2(e); 0: no soft cap
  float pe_ratio;          // kpe_scale / ckv_scale, folded into q_pe
  float o_scale;           // ckv_scale
  bool q_bf16;
  bool o_bf16;
  bool causal;
  // The wide-tile Hopper kernel's TMA loads (16-bit caches, pages of 64+ keys): each pool as a 2D
  // tensor [pages x page_size rows][rank or 64 columns], boxes of 64 x 64 with the 128-byte
  // swizzle of its shared-memory tiles. tma false: cp.async only.
  bool tma;
  // The wide-tile kernel (16-bit caches, with tma) launched in clusters of two CTAs: the two
  // 64-row halves of a request's rows over one chunk (consecutive units) fetch each TMA tile once
  // for both. Set where every token's rows are whole pairs of units (num_heads % 128 == 0).
  bool cluster_pairs;
  CUtensorMap ckv_map;
  CUtensorMap kpe_map;
};

template <int kRankArg, typename T, typename Stored>
struct MlaShape {
  static constexpr int kRank = kRankArg;
  static constexpr int kDim = kRank + kRopeDim;       // 576 or 320
  static constexpr int kChunks = kDim / 8;            // 16-byte chunks of T per row
  static constexpr int kRankChunks = kRank / 8;
  static constexpr int kRowBytes = 2 * kDim;
  static constexpr int kStepsPerWarp = kDim / 16 / 4;  // QK k-steps of a quarter: 9 or 5
  static constexpr int kWarpCols = kRank / 8;          // O columns of a warp: 64 or 32
  static constexpr int kWarpNTiles = kWarpCols / 8;
  static constexpr bool kRaw = sizeof(Stored) == 1;
  static constexpr int kTileBytes = kTile * kRowBytes;
  static constexpr int kRawTileBytes = kTile * kDim;  // fp8: one byte per element
  static constexpr int kLoopStageBytes =
      kRaw ? kStages * kRawTileBytes + kTileBytes : kStages * kTileBytes;
  static constexpr int kSBytes = 4 * kRows * kTile * 4;  // four fp32 partial S [64][32]
  static constexpr int kOStride = kRank + 8;             // fp32 staging row (8 mod 32 banks)
  static constexpr int kOStageBytes = kRows * kOStride * 4;
  // The epilogue stages O over the pipeline tiles and the S partials.
  static constexpr int kStageRegion =
      kLoopStageBytes > kOStageBytes - kSBytes ? kLoopStageBytes : kOStageBytes - kSBytes;
  static constexpr int kPStride = kTile + 8;  // elements: 80-byte rows, conflict-free ldmatrix
  static constexpr int kPBytes = kRows * kPStride * 2;
  static constexpr int kQBytes = kRows * kRowBytes;
  static constexpr int kSOffset = kStageRegion;
  static constexpr int kPOffset = kSOffset + kSBytes;
  static constexpr int kQOffset = kPOffset + kPBytes;
  static constexpr int kRowStateOffset = kQOffset + kQBytes;  // rescale, inverse, lse [64] each
  static constexpr int kTableOffset = kRowStateOffset + 3 * kRows * 4;
  static constexpr int kSmemBytes = kTableOffset + kStages * 2 * kTile * 8;

  static_assert(kChunks % 8 == 0 && kRankChunks % 8 == 0, "swizzle groups of 8 chunks");
  static_assert(kDim % 64 == 0, "four quarters of whole k-steps");
  static_assert(kStageRegion % 16 == 0 && kRawTileBytes % 16 == 0, "alignment");
};

// Element offset of 16-byte chunk `chunk` of row `row` in a swizzled [rows][kDim] tile.
template <int kDim>
__device__ __forceinline__ int Swizzle(int row, int chunk) {
  return row * kDim + ((chunk ^ (row & 7)) << 3);
}

// Eight 16-bit q values (bf16 or fp16 by `bf16`) times `scale`, rounded to T.
template <typename T>
__device__ __forceinline__ uint4 ConvertQ(uint4 raw, bool bf16, float scale) {
  const uint32_t in[4] = {raw.x, raw.y, raw.z, raw.w};
  uint32_t out[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float2 value;
    if (bf16) {
      value = make_float2(__uint_as_float(in[i] << 16), __uint_as_float(in[i] & 0xffff0000u));
    } else {
      __half2 pair;
      memcpy(&pair, &in[i], sizeof pair);
      value = __half22float2(pair);
    }
    out[i] = PackFloat2<T>(value.x * scale, value.y * scale);
  }
  return make_uint4(out[0], out[1], out[2], out[3]);
}

__device__ __forceinline__ uint32_t PackOut(float a, float b, bool bf16) {
  return bf16 ? PackFloat2<__nv_bfloat16>(a, b) : PackFloat2<__half>(a, b);
}

template <int kRank, typename T, typename Stored>
__global__ void __launch_bounds__(kThreads, 1) MlaDecodeKernel(const __grid_constant__ MlaParams params) {
  using Shape = MlaShape<kRank, T, Stored>;
  constexpr int kDim = Shape::kDim;
  constexpr int kRowBytes = Shape::kRowBytes;
  constexpr int kRankChunks = Shape::kRankChunks;

  extern __shared__ __align__(128) uint8_t smem[];
  uint8_t* const stage_base = smem;
  float* const s_partial = reinterpret_cast<float*>(smem + Shape::kSOffset);  // [4][64][32]
  T* const p_tile = reinterpret_cast<T*>(smem + Shape::kPOffset);             // [64][kPStride]
  T* const q_tile = reinterpret_cast<T*>(smem + Shape::kQOffset);             // [64][kDim]
  float* const row_rescale = reinterpret_cast<float*>(smem + Shape::kRowStateOffset);
  float* const row_inverse = row_rescale + kRows;
  float* const row_lse = row_inverse + kRows;
  // [stage][64] byte offsets into the pools of a tile's rows: ckv rows 0..31, kpe rows 32..63;
  // -1: past the chunk (zero-filled).
  int64_t* const table = reinterpret_cast<int64_t*>(smem + Shape::kTableOffset);

  const int4* const unit_words = reinterpret_cast<const int4*>(params.units + blockIdx.x);
  const int4 w0 = unit_words[0];
  const int4 w1 = unit_words[1];
  const int4 w2 = unit_words[2];
  const int request = w0.x;
  if (request < 0) return;  // a placeholder unit: nothing to do
  // Lets a following merge grid be scheduled once every CTA of this one runs; it still waits
  // (griddepcontrol.wait) for this grid's results.
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
  const int q_row = w0.y;
  const int q_len = w0.z;
  const int kv_len = w0.w;
  const int row_begin = w1.x;
  const int partial_first = w1.w;
  const int partial_stride = w2.x;

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int num_heads = params.num_heads;
  const int row_end = min(row_begin + kRows, q_len * num_heads);
  // Query token i of the request sits at position kv_len - q_len + i (bottom-right aligned).
  const int position_offset = kv_len - q_len;
  const int first_position = position_offset + row_begin / num_heads;
  const int last_position = position_offset + (row_end - 1) / num_heads;
  int kv_begin = w1.y;
  int kv_end = w1.z;
  if (params.causal) kv_end = min(kv_end, last_position + 1);
  if (params.window_left >= 0) kv_begin = max(kv_begin, first_position - params.window_left);
  const int num_tiles = kv_end > kv_begin ? (kv_end - kv_begin + kTile - 1) / kTile : 0;

  const int page_begin = params.page_indptr[request];
  const int page_log2 = params.page_size_log2;
  const int page_mask = (1 << page_log2) - 1;

  // Threads 0..63 own one table entry per tile: 0..31 the ckv row of token tid, 32..63 kpe.
  auto load_page_id = [&](int tile) -> int32_t {
    if (tid >= 2 * kTile || tile >= num_tiles) return -1;
    const int token = kv_begin + tile * kTile + (tid & (kTile - 1));
    if (token >= kv_end) return -1;
    const int32_t* ids = tid < kTile ? params.ckv_page_ids : params.kpe_page_ids;
    return ids[page_begin + (token >> page_log2)];
  };
  auto store_offset = [&](int tile, int32_t page) {
    if (tid >= 2 * kTile) return;
    const int token = kv_begin + tile * kTile + (tid & (kTile - 1));
    int64_t offset = -1;
    if (page >= 0) {
      offset = tid < kTile ? page * params.ckv_page_bytes +
                                 static_cast<int64_t>(token & page_mask) * kRank * sizeof(Stored)
                           : page * params.kpe_page_bytes +
                                 static_cast<int64_t>(token & page_mask) * kRopeDim * sizeof(Stored);
    }
    table[(tile % kStages) * 2 * kTile + tid] = offset;
  };

  // The tile the MMAs read for pipeline stage `stage`.
  auto mma_tile = [&](int stage) -> T* {
    if constexpr (Shape::kRaw) {
      return reinterpret_cast<T*>(stage_base + kStages * Shape::kRawTileBytes);
    } else {
      return reinterpret_cast<T*>(stage_base + stage * Shape::kTileBytes);
    }
  };

  // cp.async of a tile's ckv and kpe rows into its stage. Rows past the chunk are zero-filled:
  // their scores are masked, and a zero V row keeps 0 * stale bytes from making NaN.
  auto issue = [&](int tile) {
    const int stage = tile % kStages;
    const int64_t* offsets = table + stage * 2 * kTile;
    if constexpr (!Shape::kRaw) {
      T* tile_base = mma_tile(stage);
      constexpr int kCkvLoads = kTile * kRankChunks / kThreads;
#pragma unroll
      for (int l = 0; l < kCkvLoads; ++l) {
        const int id = tid + l * kThreads;
        const int row = id / kRankChunks;
        const int chunk = id % kRankChunks;
        const int64_t offset = offsets[row];
        const bool valid = offset >= 0;
        const uint8_t* source = valid ? params.ckv_pool + offset + chunk * 16 : params.ckv_pool;
        CpAsync16(SharedAddress(tile_base + Swizzle<kDim>(row, chunk)), source, valid);
      }
      static_assert(kTile * 8 == kThreads, "one kpe chunk per thread");
      const int row = tid / 8;
      const int chunk = tid % 8;
      const int64_t offset = offsets[kTile + row];
      const bool valid = offset >= 0;
      const uint8_t* source = valid ? params.kpe_pool + offset + chunk * 16 : params.kpe_pool;
      CpAsync16(SharedAddress(tile_base + Swizzle<kDim>(row, kRankChunks + chunk)), source, valid);
    } else {
      uint8_t* raw = stage_base + stage * Shape::kRawTileBytes;  // [32][kDim] bytes, unswizzled
      constexpr int kRawCkvChunks = kRank / 16;
      constexpr int kCkvLoads = kTile * kRawCkvChunks / kThreads;
#pragma unroll
      for (int l = 0; l < kCkvLoads; ++l) {
        const int id = tid + l * kThreads;
        const int row = id / kRawCkvChunks;
        const int chunk = id % kRawCkvChunks;
        const int64_t offset = offsets[row];
        const bool valid = offset >= 0;
        const uint8_t* source = valid ? params.ckv_pool + offset + chunk * 16 : params.ckv_pool;
        CpAsync16(SharedAddress(raw + row * kDim + chunk * 16), source, valid);
      }
      if (tid < kTile * 4) {
        const int row = tid / 4;
        const int chunk = tid % 4;
        const int64_t offset = offsets[kTile + row];
        const bool valid = offset >= 0;
        const uint8_t* source = valid ? params.kpe_pool + offset + chunk * 16 : params.kpe_pool;
        CpAsync16(SharedAddress(raw + row * kDim + kRank + chunk * 16), source, valid);
      }
    }
  };

  // fp8: the landed raw tile of `stage` -> the MMA tile (e4m3 -> fp16/bf16 is exact).
  auto convert = [&](int stage) {
    if constexpr (Shape::kRaw) {
      const uint8_t* raw = stage_base + stage * Shape::kRawTileBytes;
      T* tile_base = mma_tile(stage);
      auto convert_chunk = [&](int row, int raw_byte, int first_chunk) {
        const uint4 bits = *reinterpret_cast<const uint4*>(raw + row * kDim + raw_byte);
        uint4 low, high;
        ConvertFp8x16<T, Stored>(bits, low, high);
        *reinterpret_cast<uint4*>(tile_base + Swizzle<kDim>(row, first_chunk)) = low;
        *reinterpret_cast<uint4*>(tile_base + Swizzle<kDim>(row, first_chunk + 1)) = high;
      };
      constexpr int kRawCkvChunks = kRank / 16;
      constexpr int kCkvLoads = kTile * kRawCkvChunks / kThreads;
#pragma unroll
      for (int l = 0; l < kCkvLoads; ++l) {
        const int id = tid + l * kThreads;
        const int row = id / kRawCkvChunks;
        const int chunk = id % kRawCkvChunks;
        convert_chunk(row, chunk * 16, 2 * chunk);
      }
      if (tid < kTile * 4) {
        const int row = tid / 4;
        const int chunk = tid % 4;
        convert_chunk(row, kRank + chunk * 16, kRankChunks + 2 * chunk);
      }
    }
  };

  // --- Prologue: the first tiles' offsets, their loads, then Q (overlapping the loads).
  {
    int32_t pages[kStages];
#pragma unroll
    for (int s = 0; s < kStages; ++s) pages[s] = load_page_id(s);
#pragma unroll
    for (int s = 0; s < kStages; ++s) store_offset(s, pages[s]);
  }
  __syncthreads();
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < num_tiles) issue(s);
    CpAsyncCommit();  // empty groups keep the wait counts uniform
  }
  {
    // Rows past the request's end are zero (their results are never stored).
    constexpr int kQLoads = kRows * Shape::kChunks / kThreads;
    static_assert(kQLoads * kThreads == kRows * Shape::kChunks, "Q load");
    const uint16_t* q_nope = static_cast<const uint16_t*>(params.q_nope);
    const uint16_t* q_pe = static_cast<const uint16_t*>(params.q_pe);
    const bool direct = params.q_bf16 == std::is_same_v<T, __nv_bfloat16> && params.pe_ratio == 1.0f;
    uint4 values[kQLoads];
#pragma unroll
    for (int l = 0; l < kQLoads; ++l) {
      const int id = tid + l * kThreads;
      const int row = id / Shape::kChunks;
      const int chunk = id % Shape::kChunks;
      const int global_row = row_begin + row;
      values[l] = make_uint4(0, 0, 0, 0);
      if (global_row < row_end) {
        const int token = global_row / num_heads;
        const int head = global_row - token * num_heads;
        const int64_t q_index = static_cast<int64_t>(q_row + token) * num_heads + head;
        values[l] = chunk < kRankChunks
                        ? __ldg(reinterpret_cast<const uint4*>(q_nope + q_index * kRank + chunk * 8))
                        : __ldg(reinterpret_cast<const uint4*>(q_pe + q_index * kRopeDim +
                                                               (chunk - kRankChunks) * 8));
      }
    }
#pragma unroll
    for (int l = 0; l < kQLoads; ++l) {
      const int id = tid + l * kThreads;
      const int row = id / Shape::kChunks;
      const int chunk = id % Shape::kChunks;
      uint4 value = values[l];
      if (!direct) {
        value = ConvertQ<T>(value, params.q_bf16, chunk < kRankChunks ? 1.0f : params.pe_ratio);
      }
      *reinterpret_cast<uint4*>(q_tile + Swizzle<kDim>(row, chunk)) = value;
    }
  }
  int32_t next_page = load_page_id(kStages);

  // Softmax state of this thread's row (4 threads per row, identical m; d is this thread's
  // share of the row's sum, added over the 4 at the end).
  const int softmax_row = tid >> 2;
  const int softmax_quarter = tid & 3;
  const int softmax_global_row = row_begin + softmax_row;
  const bool softmax_row_valid = softmax_global_row < row_end;
  const int softmax_position = position_offset + softmax_global_row / num_heads;
  float row_max = -INFINITY;
  float row_sum = 0.0f;

  float o[4][Shape::kWarpNTiles][4];
#pragma unroll
  for (int mt = 0; mt < 4; ++mt) {
#pragma unroll
    for (int n = 0; n < Shape::kWarpNTiles; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) o[mt][n][e] = 0.0f;
    }
  }

  // ldmatrix lane addresses (the prefill kernel's conventions). A operands (Q, P): lanes
  // 0-7/8-15/16-23/24-31 read rows 0-7/8-15/0-7/8-15 at chunk +0/+0/+1/+1. K (B, non-trans):
  // rows 0-7/0-7/8-15/8-15 at chunk +0/+1/+0/+1, so x4 gives (b0, b1) of two 8-key blocks.
  // V (B, trans): rows (keys) 0-7/8-15/0-7/8-15 at chunk +0/+0/+1/+1: (b0, b1) of two 8-column
  // blocks. Row bases are multiples of 8, so a lane's row & 7 is lane & 7.
  const int g = lane >> 2;
  const int t4 = lane & 3;
  const int lane_row_a = (lane & 7) + 8 * ((lane >> 3) & 1);
  const int lane_chunk_a = lane >> 4;
  const int lane_row_k = (lane & 7) + 8 * (lane >> 4);
  const int lane_chunk_k = (lane >> 3) & 1;
  const int swizzle_bits = lane & 7;
  const int quarter = warp >> 1;
  const int row_group = warp & 1;
  const uint32_t q_lane = SharedAddress(q_tile) + (32 * row_group + lane_row_a) * kRowBytes;
  const uint32_t p_lane = SharedAddress(p_tile) + lane_row_a * Shape::kPStride * 2;
  const int warp_chunk = warp * (Shape::kWarpCols / 8);

  for (int tile = 0; tile < num_tiles; ++tile) {
    CpAsyncWait<kStages - 2>();  // this tile's group has landed (the next may be in flight)
    // The tile is visible to all; every warp is done with the previous tile's P V, so its stage,
    // P, the rescale factors and this tile's table slot are free.
    __syncthreads();
    if (tile + kStages - 1 < num_tiles) issue(tile + kStages - 1);
    CpAsyncCommit();
    store_offset(tile + kStages, next_page);
    next_page = load_page_id(tile + kStages + 1);
    if constexpr (Shape::kRaw) {
      convert(tile % kStages);
      __syncthreads();
    }
    const T* kv_tile = mma_tile(tile % kStages);
    const uint32_t kv_base = SharedAddress(kv_tile);

    // 1. Partial S of this warp's quarter of the k-steps: rows 32 * row_group + [0, 32), 32 keys.
    {
      float s[2][4][4];
#pragma unroll
      for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
        for (int n = 0; n < 4; ++n) {
#pragma unroll
          for (int e = 0; e < 4; ++e) s[mt][n][e] = 0.0f;
        }
      }
      const int first_step = quarter * Shape::kStepsPerWarp;
#pragma unroll
      for (int i = 0; i < Shape::kStepsPerWarp; ++i) {
        const int step = first_step + i;
        uint32_t a[2][4];
        const uint32_t a_column = static_cast<uint32_t>(((2 * step + lane_chunk_a) ^ swizzle_bits) << 4);
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) LdMatrixX4(q_lane + mt * 16 * kRowBytes + a_column, a[mt]);
        const uint32_t k_column = static_cast<uint32_t>(((2 * step + lane_chunk_k) ^ swizzle_bits) << 4);
#pragma unroll
        for (int kg = 0; kg < 2; ++kg) {
          uint32_t b[4];
          LdMatrixX4(kv_base + (16 * kg + lane_row_k) * kRowBytes + k_column, b);
#pragma unroll
          for (int mt = 0; mt < 2; ++mt) {
            Mma16816<T>(s[mt][2 * kg], a[mt], b[0], b[1]);
            Mma16816<T>(s[mt][2 * kg + 1], a[mt], b[2], b[3]);
          }
        }
      }
      // Partial S [row][key], keys in 8-column blocks XOR-swizzled by row % 4 (2 wavefronts per
      // float2 store).
      float* partial = s_partial + quarter * kRows * kTile;
#pragma unroll
      for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
        for (int n = 0; n < 4; ++n) {
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int row = 32 * row_group + 16 * mt + 8 * h + g;
            const int column = (8 * n + 2 * t4) ^ ((row & 3) << 3);
            *reinterpret_cast<float2*>(partial + row * kTile + column) =
                make_float2(s[mt][n][2 * h], s[mt][n][2 * h + 1]);
          }
        }
      }
    }
    __syncthreads();

    // Every warp is done reading K. In a tile where some row does not see some key, zero the
    // non-finite values of V (the ckv part): P V adds p = 0 times V for hidden keys, and 0 * NaN
    // would make a row NaN that never saw the key. A non-finite ckv value makes the key's score
    // non-finite for every row, so the rows that see it still come out NaN (step 2). Keys past
    // kv_end are zero-filled already.
    {
      const int tile_start = kv_begin + tile * kTile;
      const bool hides_keys = (params.causal && min(tile_start + kTile, kv_end) - 1 > first_position) ||
                              (params.window_left >= 0 && tile_start < last_position - params.window_left);
      if (hides_keys) {
        constexpr uint32_t kExponent = kNonFiniteExponent2<T>;
        T* v_tile = mma_tile(tile % kStages);
        for (int id = tid; id < kTile * kRankChunks; id += kThreads) {
          uint4* chunk = reinterpret_cast<uint4*>(v_tile + Swizzle<kDim>(id / kRankChunks, id % kRankChunks));
          const uint4 bits = *chunk;
          // 0xffff in each 16-bit half that is an inf or a NaN (exponent all ones).
          const uint32_t bad[4] = {__vcmpeq2(bits.x & kExponent, kExponent), __vcmpeq2(bits.y & kExponent, kExponent),
                                   __vcmpeq2(bits.z & kExponent, kExponent), __vcmpeq2(bits.w & kExponent, kExponent)};
          if ((bad[0] | bad[1] | bad[2] | bad[3]) != 0) {
            *chunk = make_uint4(bits.x & ~bad[0], bits.y & ~bad[1], bits.z & ~bad[2], bits.w & ~bad[3]);
          }
        }
      }
    }

    // 2. Online softmax: this thread's row, keys 8 * softmax_quarter + [0, 8).
    {
      const int row = softmax_row;
      const int column = (softmax_quarter ^ (row & 3)) << 3;
      float score[8];
      {
        float part[4][8];
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const float4* source = reinterpret_cast<const float4*>(s_partial + q * kRows * kTile + row * kTile + column);
          const float4 low = source[0];
          const float4 high = source[1];
          part[q][0] = low.x;
          part[q][1] = low.y;
          part[q][2] = low.z;
          part[q][3] = low.w;
          part[q][4] = high.x;
          part[q][5] = high.y;
          part[q][6] = high.z;
          part[q][7] = high.w;
        }
#pragma unroll
        for (int e = 0; e < 8; ++e) score[e] = (part[0][e] + part[1][e]) + (part[2][e] + part[3][e]);
      }
      const int first_key = kv_begin + tile * kTile + 8 * softmax_quarter;
      float tile_max = -INFINITY;
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const int key = first_key + e;
        const bool visible = softmax_row_valid && key < kv_end &&
                             (!params.causal || key <= softmax_position) &&
                             (params.window_left < 0 || key >= softmax_position - params.window_left);
        // Non-finite inputs make the score NaN or +-inf: s * 0 + s turns both into NaN (finite s
        // unchanged) before the cap could make inf finite or -inf could read as masked. A NaN p
        // makes the row's sum NaN: o and lse come out NaN (NaN in, NaN out).
        const float raw = fmaf(score[e], 0.0f, score[e]);
        float value = params.cap_log2 > 0.0f ? SoftCapLog2(raw, params.cap_input_scale, params.cap_log2)
                                             : raw * params.score_scale_log2;
        score[e] = visible ? value : -INFINITY;
        tile_max = fmaxf(tile_max, score[e]);
      }
      tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
      tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
      const float new_max = fmaxf(row_max, tile_max);
      // Nothing seen yet: subtracting 0 keeps exp2(-inf) = 0 instead of exp2(-inf + inf) = NaN.
      const float subtract = new_max == -INFINITY ? 0.0f : new_max;
      // A row that has seen no key keeps o = 0: factor 1 spares the warps a rescale of zeros
      // (padding rows of a CTA never see one).
      const float rescale = new_max == -INFINITY ? 1.0f : exp2f(row_max - subtract);
      float sum = 0.0f;
      uint32_t packed[4];
#pragma unroll
      for (int e = 0; e < 8; e += 2) {
        const float p0 = exp2f(score[e] - subtract);
        const float p1 = exp2f(score[e + 1] - subtract);
        sum += p0 + p1;
        packed[e / 2] = PackFloat2<T>(p0, p1);
      }
      row_sum = row_sum * rescale + sum;
      row_max = new_max;
      *reinterpret_cast<uint4*>(p_tile + row * Shape::kPStride + 8 * softmax_quarter) =
          make_uint4(packed[0], packed[1], packed[2], packed[3]);
      if (softmax_quarter == 0) row_rescale[row] = rescale;
    }
    __syncthreads();

    // 3. O = O * rescale + P V over this warp's columns.
    {
      float factor[4][2];
      bool any_rescale = false;
#pragma unroll
      for (int mt = 0; mt < 4; ++mt) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          factor[mt][h] = row_rescale[16 * mt + 8 * h + g];
          any_rescale |= factor[mt][h] != 1.0f;
        }
      }
      // Once the running maxima settle, most tiles move none: skip multiplying by exactly 1.
      if (__any_sync(0xffffffffu, any_rescale)) {
#pragma unroll
        for (int mt = 0; mt < 4; ++mt) {
#pragma unroll
          for (int n = 0; n < Shape::kWarpNTiles; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) o[mt][n][e] *= factor[mt][e >> 1];
          }
        }
      }
#pragma unroll
      for (int ks = 0; ks < kTile / 16; ++ks) {
        uint32_t a[4][4];
#pragma unroll
        for (int mt = 0; mt < 4; ++mt) {
          LdMatrixX4(p_lane + mt * 16 * Shape::kPStride * 2 + ((2 * ks + lane_chunk_a) << 4), a[mt]);
        }
        const uint32_t v_row = kv_base + (16 * ks + lane_row_a) * kRowBytes;
#pragma unroll
        for (int pair = 0; pair < Shape::kWarpNTiles / 2; ++pair) {
          uint32_t b[4];
          const int chunk = warp_chunk + 2 * pair + lane_chunk_a;
          LdMatrixX4Trans(v_row + static_cast<uint32_t>((chunk ^ swizzle_bits) << 4), b);
#pragma unroll
          for (int mt = 0; mt < 4; ++mt) {
            Mma16816<T>(o[mt][2 * pair], a[mt], b[0], b[1]);
            Mma16816<T>(o[mt][2 * pair + 1], a[mt], b[2], b[3]);
          }
        }
      }
    }
  }
  CpAsyncWait<0>();

  // --- Epilogue: row sums over the 4 threads of a row (fixed pairing), then normalise.
  row_sum += __shfl_xor_sync(0xffffffffu, row_sum, 1);
  row_sum += __shfl_xor_sync(0xffffffffu, row_sum, 2);
  if (softmax_quarter == 0) {
    // A row that saw no key has sum 0 and o 0: it stores 0 and lse = -inf. A NaN sum (a
    // non-finite input it saw) stores NaN in o and lse.
    row_inverse[softmax_row] = row_sum != 0.0f ? params.o_scale / row_sum : 0.0f;
    row_lse[softmax_row] = row_sum != 0.0f ? (row_max + log2f(row_sum)) * kLn2 : -INFINITY;
  }
  __syncthreads();  // also: every warp is done with the pipeline tiles the staging reuses

  float* const o_stage = reinterpret_cast<float*>(stage_base);  // [64][kOStride] fp32
#pragma unroll
  for (int mt = 0; mt < 4; ++mt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = 16 * mt + 8 * h + g;
      const float inverse = row_inverse[row];
#pragma unroll
      for (int n = 0; n < Shape::kWarpNTiles; ++n) {
        const int column = warp * Shape::kWarpCols + 8 * n + 2 * t4;
        *reinterpret_cast<float2*>(o_stage + row * Shape::kOStride + column) =
            make_float2(o[mt][n][2 * h] * inverse, o[mt][n][2 * h + 1] * inverse);
      }
    }
  }
  __syncthreads();

  // Rows out in 8-element pieces: o (16-byte stores) or fp32 partials (two 16-byte stores).
  constexpr int kPieces = kRank / 8;
  for (int id = tid; id < kRows * kPieces; id += kThreads) {
    const int row = id / kPieces;
    const int piece = id % kPieces;
    const int global_row = row_begin + row;
    if (global_row >= row_end) continue;
    const int token = global_row / num_heads;
    const int head = global_row - token * num_heads;
    const float4 low = *reinterpret_cast<const float4*>(o_stage + row * Shape::kOStride + 8 * piece);
    const float4 high = *reinterpret_cast<const float4*>(o_stage + row * Shape::kOStride + 8 * piece + 4);
    if (partial_first < 0) {
      const int64_t out_row = static_cast<int64_t>(q_row + token) * num_heads + head;
      const bool bf16 = params.o_bf16;
      *reinterpret_cast<uint4*>(static_cast<uint16_t*>(params.o) + out_row * kRank + 8 * piece) =
          make_uint4(PackOut(low.x, low.y, bf16), PackOut(low.z, low.w, bf16),
                     PackOut(high.x, high.y, bf16), PackOut(high.z, high.w, bf16));
      if (piece == 0 && params.lse != nullptr) params.lse[out_row] = row_lse[row];
    } else {
      const int64_t slot = partial_first + static_cast<int64_t>(token) * partial_stride;
      const int64_t partial_row = slot * num_heads + head;
      float4* target = reinterpret_cast<float4*>(params.partial_o + partial_row * kRank + 8 * piece);
      target[0] = low;
      target[1] = high;
      if (piece == 0) params.partial_lse[partial_row] = row_lse[row];
    }
  }
}

// Launches the kernel of one (rank, MMA type, cache type) on `num_ctas` CTAs, or, when
// `ctas_per_sm` is set, only reports how many of its CTAs one SM holds.
template <int kRank, typename T, typename Stored>
cudaError_t LaunchMla(const MlaParams& params, int32_t num_ctas, cudaStream_t stream, int* ctas_per_sm) {
  using Shape = MlaShape<kRank, T, Stored>;
  auto* kernel = &MlaDecodeKernel<kRank, T, Stored>;
  cudaError_t error = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Shape::kSmemBytes);
  if (error != cudaSuccess) return error;
  if (ctas_per_sm != nullptr) {
    return cudaOccupancyMaxActiveBlocksPerMultiprocessor(ctas_per_sm, kernel, kThreads, Shape::kSmemBytes);
  }
  kernel<<<num_ctas, kThreads, Shape::kSmemBytes, stream>>>(params);
  return cudaGetLastError();
}

// Dispatches the dtypes of one rank: 16-bit caches multiply in their own type, fp8 caches in
// q's type. Defined per rank in mla_decode_r{512,256}.cu (the two compile in parallel).
cudaError_t LaunchMlaR512(const MlaParams& params, DType q_dtype, DType kv_dtype, int32_t num_ctas,
                          cudaStream_t stream, int* ctas_per_sm);
cudaError_t LaunchMlaR256(const MlaParams& params, DType q_dtype, DType kv_dtype, int32_t num_ctas,
                          cudaStream_t stream, int* ctas_per_sm);

// The Hopper kernel (mla_decode_hopper.cu, sm_90a only): q and cache of one 16-bit type, rank
// 512 or 256, kpe_scale == ckv_scale. Defined only when the build includes sm_90a code
// (ATTND_MLA_HOPPER); runs only on compute capability 9.0.
cudaError_t LaunchMlaHopper(const MlaParams& params, int32_t rank, DType dtype, int32_t num_ctas,
                            cudaStream_t stream, int* ctas_per_sm);
// The wide-tile Hopper kernel (mla_decode_hopper_wide.cu, also sm_90a only): q 16-bit, the cache
// of q's type or fp8 e4m3 (mla_decode_hopper_wide_fp8.cu), rank 512 or 256, any scales.
cudaError_t LaunchMlaHopperWide(const MlaParams& params, int32_t rank, DType q_dtype, DType kv_dtype, int32_t num_ctas,
                                cudaStream_t stream, int* ctas_per_sm);
cudaError_t LaunchMlaHopperWideFp8(const MlaParams& params, int32_t rank, DType q_dtype, int32_t num_ctas,
                                   cudaStream_t stream, int* ctas_per_sm);

template <int kRank>
cudaError_t LaunchMlaForTypes(const MlaParams& params, DType q_dtype, DType kv_dtype, int32_t num_ctas,
                              cudaStream_t stream, int* ctas_per_sm) {
  switch (kv_dtype) {
    case DType::kBFloat16:
      return LaunchMla<kRank, __nv_bfloat16, __nv_bfloat16>(params, num_ctas, stream, ctas_per_sm);
    case DType::kFloat16:
      return LaunchMla<kRank, __half, __half>(params, num_ctas, stream, ctas_per_sm);
    case DType::kFloat8E4M3:
      if (q_dtype == DType::kBFloat16) {
        return LaunchMla<kRank, __nv_bfloat16, __nv_fp8_e4m3>(params, num_ctas, stream, ctas_per_sm);
      }
      return LaunchMla<kRank, __half, __nv_fp8_e4m3>(params, num_ctas, stream, ctas_per_sm);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace attnd::cuda::mla
