// Batch decode on tensor cores (issue 14): the kernel template. Plans with kernel kTensorCore
// run it; the CUDA-core kernel (decode.cu) runs the rest.
//
// One CTA (4 warps) per (plan work item, KV head), like the CUDA-core kernel. The group's query
// heads (1..16, zero-padded to 16) are the M of mma.sync m16n8k16, keys the N of S = Q K^T and
// the K of O += P V, head_dim the K of Q K^T and the N of P V; fp32 accumulators, online
// softmax in registers (log2 domain), P rounded to the MMA type.
//
// Keys are dealt to warps in tiles of 64: warp w takes keys [16w, 16w + 16) of every tile, so
// each warp is an independent stream with its own multi-stage cp.async pipeline in shared memory
// (page ids fetched one tile ahead, synchronised with __syncwarp only: no CTA barrier in the
// loop). The loop is issue-bound at 2 CTAs an SM, so its copies' addresses are kept short: one
// row offset per lane and tile, shared by shuffle, and where a warp tile's 16 keys lie in one
// page (pages of 16+, items on a multiple of 16) one address plus row strides, in a separately
// compiled loop (D128: 367 instructions a tile against 408 row by row, 787 before either). At
// the end the four warps' (m, d, o) states are merged in warp order through shared memory, and
// the CTA writes o and lse, or an fp32 partial that MergeStates combines.
//
// Fragment layouts relied on (PTX ISA, mma.m16n8k16 with .bf16/.f16 inputs, .f32 accumulators;
// g = lane / 4, t = lane % 4; the prefill kernel uses the same):
//   A (16 x 16, row-major), 4 registers of two 16-bit values:
//     a0 = (row g,     cols 2t, 2t+1)   a1 = (row g + 8, cols 2t, 2t+1)
//     a2 = (row g,     cols 2t+8, 2t+9) a3 = (row g + 8, cols 2t+8, 2t+9)
//   B (16 x 8, "col"), 2 registers: b0 = (k 2t, 2t+1; n g), b1 = (k 2t+8, 2t+9; n g)
//   C/D (16 x 8) fp32: c0, c1 = (row g, cols 2t, 2t+1); c2, c3 = (row g + 8, cols 2t, 2t+1)
//   ldmatrix.x4: lanes 8i..8i+7 give the 8 row addresses of matrix i; every lane receives
//     register i = matrix i's (row g, cols 2t, 2t+1) (with .trans: (rows 2t, 2t+1; col g)).
// Hence, with tiles stored row-major as [row][head_dim]:
//   Q (A): lanes read rows 0-7 / 8-15 / 0-7 / 8-15 at k-chunk +0 / +0 / +1 / +1 -> a0..a3.
//   K (B of S, plain): key rows 0-7 / 0-7 / 8-15 / 8-15 at chunk +0 / +1 / +0 / +1 -> (b0, b1)
//     of keys 0-7, then (b0, b1) of keys 8-15: s[0..3] keys 0-7, s[4..7] keys 8-15, so
//     s[e] = (row g + 8 * ((e / 2) % 2), key 8 * (e / 4) + 2t + e % 2).
//   P (A of P V) = (s[0], s[1]), (s[2], s[3]), (s[4], s[5]), (s[6], s[7]) packed: exactly
//     a0..a3 above (keys are P's columns).
//   V (B of P V, .trans): key rows 0-7 / 8-15 / 0-7 / 8-15 at chunk +0 / +0 / +1 / +1 -> (b0, b1)
//     of dims 16db..16db+7, then of dims 16db+8..: o[db][0..3] dims 16db + 2t (+1),
//     o[db][4..7] dims 16db + 8 + 2t (+1), rows as in C.
// Tiles keep 16-byte chunk c of row r at c ^ (r % 8), so the 8 addresses of every ldmatrix phase
// and of every cp.async wave fall in distinct banks (SwizzledStepBytes folds the XOR).
//
// fp8 (e4m3) caches (head_dim 128 and 256: 8+ chunks a row): the tiles land as bytes, half the
// copies, and become fp16 in registers on their way to the MMAs (e4m3 -> fp16 is exact), so the
// MMAs are fp16 whatever q's type: Q is converted once per CTA (ConvertQToHalf: a power of two per
// row, and its dims permuted within each 16-dim k-step). Both K and V take plain ldmatrix.x4
// (V's bytes cannot take .trans): lane (g, t) receives fp8 dims 4t..4t+3 of key g, g + 8 of two
// chunks. For Q K^T those are (b0, b1) of the chunk's k-step, Q's dims permuted to match; for P V
// the two converted pairs (dims 4t, 4t+1 and 4t+2, 4t+3 of keys 0-7, and of 8-15) are 8 x 8 fp16
// matrices, and movmatrix.trans turns each into the B fragment over keys of an n8 block whose
// dims are 16c + {0,1,4,5,8,9,12,13} or + {2,3,6,7,...}; the epilogue stores o's dims accordingly.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "cp_async.cuh"
#include "fp8.cuh"
#include "grid_signal.cuh"
#include "math.cuh"
#include "mma.cuh"
#include "plan/decode_work.h"
#include "prefill_kernel.cuh"
#include "softmax.cuh"
#include "vec.cuh"

namespace attnd::cuda::decode_tc {

// The primitives (FastExp2, FastLog2, kLn2, cp.async, ldmatrix, mma.sync, PackFloat2,
// SoftCapLog2) are attnd::cuda's; the prefill kernel's tile helpers are shared too.
using prefill::StaticFor;
using prefill::SwizzledStepBytes;

inline constexpr int kThreads = 128;
inline constexpr int kWarps = kThreads / 32;
inline constexpr int kRows = 16;                        // MMA M: the group, zero-padded
inline constexpr int kWarpKeys = 16;                    // keys per warp per tile (K of P V)
inline constexpr int kTileKeys = kWarps * kWarpKeys;    // keys per CTA per tile
inline constexpr int kMaxGroup = kRows;

// What one launch reads, resolved by the launcher (decode_tc.cu).
struct TcDecodeParams {
  const void* q;        // [T_q][num_qo_heads][head_dim], the MMA type (the cache's)
  void* o;              // [T_q][num_qo_heads][head_dim], fp16 or bf16 (o_bf16)
  float* lse;           // [T_q][num_qo_heads] natural log, or null
  const uint8_t* k_pool;  // the layer's pools (NHD or HND, by the strides below)
  const uint8_t* v_pool;
  // Byte strides: row (page, entry, head) starts at page * page + entry * entry + head * head.
  int64_t page_stride_bytes;
  int64_t entry_stride_bytes;
  int64_t head_stride_bytes;
  const int32_t* page_indptr;  // [batch + 1]
  const int32_t* k_indices;    // page ids of K
  const int32_t* v_indices;    // page ids of V (== k_indices for SHARED tables)
  plan::DecodeWorkView work;
  float* partial_o;    // [num_partials][num_qo_heads][head_dim]
  float* partial_lse;  // [num_partials][num_qo_heads]
  int32_t num_qo_heads;
  int32_t num_kv_heads;
  int32_t group_size;  // 1..16
  int32_t log2_page_size;
  float score_scale_log2;  // sm_scale * k_scale * log2(e), without soft cap
  float cap_input_scale;   // sm_scale * k_scale / soft_cap
  float cap_log2;          // soft_cap * log2(e); 0: no soft cap
  float v_scale;
  bool o_bf16;
  GridSignal done;  // set by the last CTA once o and lse are stored (no split only)
};

// kKvBytes: bytes of a cached value (2: fp16/bf16; 1: fp8 e4m3, converted to fp16 as it leaves
// shared memory, see the fp8 section above). kShallow (fp8 at head_dim 128 only): 4 stages at 3
// CTAs an SM instead of 5 at 2, for launches of many short CTAs (TcShallowPays).
template <int kHeadDimArg, int kKvBytesArg = 2, bool kShallowArg = false>
struct TcShape {
  static constexpr int kHeadDim = kHeadDimArg;
  static constexpr int kKvBytes = kKvBytesArg;
  static constexpr int kRowBytes = kKvBytes * kHeadDim;  // a cached K or V row
  static constexpr int kChunks = kRowBytes / 16;         // 16-byte chunks per cached row
  static constexpr int kQRowBytes = 2 * kHeadDim;        // a Q row (16-bit) in shared memory
  static constexpr int kQChunks = kHeadDim / 8;
  static constexpr int kMmaD = kHeadDim / 16;   // k-steps of Q K^T, n-pairs of P V
  static constexpr bool kFp8Deep = kKvBytes == 1 && kHeadDim == 128 && !kShallowArg;
  static_assert(!kShallowArg || (kKvBytes == 1 && kHeadDim == 128), "the shallow pipeline is fp8's");
  // Stages per warp pipeline: (kStages - 1) warp tiles of K and V in flight per warp. With the
  // CTAs per SM below that is 96-144 KB in flight per SM, and 64-80 KB per CTA: a CTA alone on an
  // SM is bound by the latency of its bytes in flight.
  static constexpr int kStages = kFp8Deep ? 5 : (kHeadDim == 64 || kKvBytes == 1 && kHeadDim == 128) ? 4 : 3;
  static constexpr int kWarpTileBytes = kWarpKeys * kRowBytes;  // K (or V) of a warp tile
  static constexpr int kWarpStageBytes = 2 * kWarpTileBytes;    // K, then V
  static constexpr int kPipelineBytes = kWarps * kStages * kWarpStageBytes;
  static constexpr int kQBytes = kRows * kQRowBytes;
  // fp8: the power of two each Q row was scaled by into fp16's range, [16] fp32 (padded).
  static constexpr int kQScaleBytes = kKvBytes == 1 ? 128 : 0;
  static constexpr int kLoadsPerLane = kWarpKeys * kChunks / 32;  // of K (and of V) per tile
  // Epilogue, over the pipeline: o [warp][16][kMergeStride] fp32 (padded against bank
  // conflicts), then m and d [warp][16].
  static constexpr int kMergeStride = kHeadDim + 8;
  static constexpr int kMergeBytes = 4 * (kWarps * kRows * kMergeStride + 2 * kWarps * kRows);
  static constexpr int kSmemBytes =
      kQBytes + kQScaleBytes + (kPipelineBytes > kMergeBytes ? kPipelineBytes : kMergeBytes);
  // Resident CTAs per SM the shared memory allows (228 KB per H100 SM): the register cap.
  static constexpr int kMinCtasPerSm = kKvBytes == 1 ? (kHeadDim == 128 && kShallowArg ? 3 : 2)
                                                     : (kHeadDim == 64 ? 3 : (kHeadDim == 128 ? 2 : 1));

  static_assert(kChunks >= 8, "the swizzle needs at least 8 chunks per cached row");
  static_assert(kLoadsPerLane * 32 == kWarpKeys * kChunks, "whole copies per lane");
  static_assert(kRows * kQChunks % kThreads == 0, "whole Q copies per thread");
  static_assert(kSmemBytes <= 227 * 1024, "dynamic shared memory per CTA");
};

// m8n8 transpose of a 16-bit matrix held one register per lane (row lane / 4, columns
// 2 (lane % 4), + 1): afterwards lane holds (rows 2 (lane % 4), + 1; column lane / 4).
__device__ __forceinline__ uint32_t TransposeMatrix(uint32_t x) {
  uint32_t y;
  asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}

// Eight fp32 values of o rounded to fp16 or bf16, as one 16-byte chunk.
__device__ __forceinline__ uint4 PackOut8(const float* v, bool bf16) {
  if (bf16) {
    return make_uint4(PackFloat2<__nv_bfloat16>(v[0], v[1]), PackFloat2<__nv_bfloat16>(v[2], v[3]),
                      PackFloat2<__nv_bfloat16>(v[4], v[5]), PackFloat2<__nv_bfloat16>(v[6], v[7]));
  }
  return make_uint4(PackFloat2<__half>(v[0], v[1]), PackFloat2<__half>(v[2], v[3]),
                    PackFloat2<__half>(v[4], v[5]), PackFloat2<__half>(v[6], v[7]));
}

// fp8 caches: Q (T, in q_tile as it landed) to fp16 in place, each row scaled by a power of two
// 2^-s that puts its largest magnitude in [2^14, 2^15), which q_scale[row] then holds as 2^s for
// the scores. Every element within 2^28 of its row's largest converts exactly (fp16 keeps bf16's
// 8-bit mantissas and 11 of its own); smaller ones lose bits as fp16 subnormals (their share of a
// score is below 2^-28 of the largest term's). A row with a non-finite or zero maximum keeps
// s = 0: inf and NaN stay inf and NaN (NaN in, NaN out), as do values past fp16's range beside
// an inf. Within each 16-dim k-step the dims are stored permuted, 4t, 4t+1 at columns 2t, 2t+1
// and 4t+2, 4t+3 at 8+2t, 9+2t (t < 4), so that ldmatrix hands Q K^T the A fragments matching
// the 4 consecutive fp8 dims each lane takes from K. Eight threads a row, 16 dims at a time.
template <typename T, typename Shape>
__device__ __forceinline__ void ConvertQToHalf(uint8_t* q_tile, float* q_scale, int tid) {
  constexpr int kSteps = Shape::kHeadDim / 16;           // 16-dim k-steps per row
  constexpr int kStepsPerThread = kRows * kSteps / kThreads;
  static_assert(kThreads == 8 * kRows && kStepsPerThread >= 1, "eight threads a row");
  const int row = tid / 8;
  uint4 chunk[kStepsPerThread][2];
  float max_abs = 0.0f;
#pragma unroll
  for (int i = 0; i < kStepsPerThread; ++i) {
    const int step = tid % 8 + 8 * i;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int c = 2 * step + half;
      const uint8_t* at = q_tile + row * Shape::kQRowBytes + ((c ^ (row & 7)) << 4);
      chunk[i][half] = *reinterpret_cast<const uint4*>(at);
      float values[8];
      Raw8ToFloat<T>(chunk[i][half], values);
#pragma unroll
      for (int e = 0; e < 8; ++e) max_abs = fmaxf(max_abs, fabsf(values[e]));  // NaN ignored here
    }
  }
  max_abs = fmaxf(max_abs, __shfl_xor_sync(0xffffffffu, max_abs, 1));
  max_abs = fmaxf(max_abs, __shfl_xor_sync(0xffffffffu, max_abs, 2));
  max_abs = fmaxf(max_abs, __shfl_xor_sync(0xffffffffu, max_abs, 4));
  // max_abs in [2^(E - 127), 2^(E - 126)) for its exponent field E: s = E - 141, at least -126 so
  // that 2^-s stays a normal float.
  const int exponent = static_cast<int>(__float_as_uint(max_abs) >> 23);
  const int s = max_abs > 0.0f && exponent < 255 ? max(exponent - 141, -126) : 0;
  const float scale = __uint_as_float(static_cast<uint32_t>(127 - s) << 23);
  if (tid % 8 == 0) q_scale[row] = __uint_as_float(static_cast<uint32_t>(127 + s) << 23);
#pragma unroll
  for (int i = 0; i < kStepsPerThread; ++i) {
    const int step = tid % 8 + 8 * i;
    uint32_t pairs[8];  // pairs[j]: dims 2j, 2j + 1 of the k-step, as fp16
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float values[8];
      Raw8ToFloat<T>(chunk[i][half], values);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        pairs[4 * half + j] = PackFloat2<__half>(values[2 * j] * scale, values[2 * j + 1] * scale);
      }
    }
    // Column pairs 0-3 take dims (0,1), (4,5), (8,9), (12,13); 4-7 take (2,3), (6,7), ...
    const uint4 low = make_uint4(pairs[0], pairs[2], pairs[4], pairs[6]);
    const uint4 high = make_uint4(pairs[1], pairs[3], pairs[5], pairs[7]);
    *reinterpret_cast<uint4*>(q_tile + row * Shape::kQRowBytes + (((2 * step) ^ (row & 7)) << 4)) = low;
    *reinterpret_cast<uint4*>(q_tile + row * Shape::kQRowBytes + (((2 * step + 1) ^ (row & 7)) << 4)) = high;
  }
}

// T: q's type (fp16 or bf16). KvT: the cache's, T itself (the MMA type then) or fp8 e4m3 (fp16
// MMAs, see the fp8 section above). kSoftCap: the launch has a soft cap; a kernel of its own, so
// that the kernels without one carry none of its code in their tile loop. kShallow: TcShape's.
template <int kHeadDim, typename T, typename KvT, bool kSoftCap, bool kShallow = false>
__global__ void __launch_bounds__(kThreads, (TcShape<kHeadDim, sizeof(KvT), kShallow>::kMinCtasPerSm))
    TensorCoreDecodeKernel(const __grid_constant__ TcDecodeParams params) {
  constexpr bool kFp8 = std::is_same_v<KvT, __nv_fp8_e4m3>;
  static_assert(kFp8 || std::is_same_v<KvT, T>, "a 16-bit cache has q's type");
  using MmaT = std::conditional_t<kFp8, __half, T>;
  using Shape = TcShape<kHeadDim, sizeof(KvT), kShallow>;
  constexpr int kChunks = Shape::kChunks;
  constexpr int kRowBytes = Shape::kRowBytes;
  constexpr int kQRowBytes = Shape::kQRowBytes;
  constexpr int kMmaD = Shape::kMmaD;
  constexpr int kStages = Shape::kStages;

  extern __shared__ __align__(128) uint8_t smem[];
  uint8_t* const q_tile = smem;  // [16][D] 16-bit (T; fp16 once converted, with fp8), swizzled
  float* const q_scale = reinterpret_cast<float*>(smem + Shape::kQBytes);  // fp8: [16]
  // [warp][stage][K, V][16][D] of KvT, swizzled
  uint8_t* const pipeline = smem + Shape::kQBytes + Shape::kQScaleBytes;

  // The KV heads of an item are adjacent CTAs: they run together and read the same pages.
  const int item = blockIdx.x / params.num_kv_heads;
  const int kv_head = blockIdx.x - item * params.num_kv_heads;
  // Lets a following merge grid be scheduled once every CTA of this one runs; it still waits
  // (griddepcontrol.wait) for this grid's results. Launched itself as a programmatic dependent
  // of the kernel before it (the append that wrote q and the new keys): the plan's work item and
  // the page table, which were uploaded before that kernel ran and which no kernel writes, are
  // read while it finishes; q and the cache only after griddepcontrol.wait below.
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int32_t request = params.work.item_request[item];
  const int32_t q_row = params.work.item_q_row[item];
  const int32_t kv_begin = params.work.item_kv_begin[item];
  const int32_t kv_end = params.work.item_kv_end[item];
  const int32_t page_begin = params.page_indptr[request];
  const int group = params.group_size;
  const int64_t first_head_row = static_cast<int64_t>(q_row) * params.num_qo_heads +
                                 static_cast<int64_t>(kv_head) * group;

  // --- This warp's key stream: tile j holds keys [warp_first + 64 j, + 16).
  const int warp_first = kv_begin + warp * kWarpKeys;
  const int num_tiles = kv_end > warp_first ? (kv_end - warp_first + kTileKeys - 1) / kTileKeys : 0;
  const uint32_t warp_stages = SharedAddress(pipeline) + warp * kStages * Shape::kWarpStageBytes;
  const int page_mask = (1 << params.log2_page_size) - 1;
  const uint8_t* const k_pool = params.k_pool + kv_head * params.head_stride_bytes;
  const uint8_t* const v_pool = params.v_pool + kv_head * params.head_stride_bytes;
  // Lane l < 16 holds the K page id of key l of a tile, lane 16 + l its V page id.
  const int32_t* const page_ids = lane < 16 ? params.k_indices : params.v_indices;
  auto fetch_page = [&](int tile) -> int32_t {
    const int token = warp_first + tile * kTileKeys + (lane & 15);
    if (tile >= num_tiles || token >= kv_end) return 0;
    return page_ids[page_begin + (token >> params.log2_page_size)];
  };
  // Copies of tile `tile` (K and V, kLoadsPerLane 16-byte chunks each per lane): chunk id of the
  // warp tile = row * kChunks + chunk, consecutive lanes on consecutive chunks of a row, so a
  // lane's chunk is the same in every copy and its row advances by kRowStep. Rows past the
  // item's end are zero-filled: their scores are masked, and a zero V row keeps 0 * stale bytes
  // from making NaN. Their sources stay inside the pool (page 0 from fetch_page, or the tile's
  // own page below), so no address needs a select.
  // The keys and values are read once: evicted from L2 first (EvictFirstPolicy).
  const uint64_t stream_policy = EvictFirstPolicy();
  constexpr int kRowStep = 32 / kChunks;
  static_assert(32 % kChunks == 0, "a lane's chunk is the same in every copy");
  const int lane_row = lane / kChunks;
  const int lane_chunk = lane % kChunks;
  const uint8_t* const k_lane_pool = k_pool + lane_chunk * 16;
  const uint8_t* const v_lane_pool = v_pool + lane_chunk * 16;
  uint32_t stage_offset[Shape::kLoadsPerLane];  // of this lane's copy l in a stage (swizzled)
#pragma unroll
  for (int l = 0; l < Shape::kLoadsPerLane; ++l) {
    const int row = lane_row + kRowStep * l;
    stage_offset[l] = row * kRowBytes + ((lane_chunk ^ (row & 7)) << 4);
  }
  // One page per warp tile: pages of 16+ keys (a power of two) and an item that starts on a
  // multiple of 16 (every split the planner makes; a window's cut start may not) put each warp
  // tile's 16 keys in one page, so its copies are one source plus multiples of a row stride
  // (no shuffle per copy: 1-2% faster at 128 x 65-512 keys on an H200).
  const bool one_page = params.log2_page_size >= 4 && (kv_begin & (kWarpKeys - 1)) == 0;
  const int64_t lane_entry_bytes = static_cast<int64_t>(lane_row) * params.entry_stride_bytes;
  const int64_t row_step_bytes = static_cast<int64_t>(kRowStep) * params.entry_stride_bytes;
  auto issue = [&](int tile, int32_t page, auto one_page_constant) {
    const uint32_t k_stage = warp_stages + (tile % kStages) * Shape::kWarpStageBytes;
    const uint32_t v_stage = k_stage + Shape::kWarpTileBytes;
    const int tile_first = warp_first + tile * kTileKeys;
    // Lane l < 16: the byte offset of key l's K row in the pool, lane 16 + l of its V row (the
    // page id was loaded a tile ago, so the product waits for nothing).
    const int my_entry = (tile_first + (lane & 15)) & page_mask;
    const int64_t my_row_bytes = static_cast<int64_t>(page) * params.page_stride_bytes +
                                 static_cast<int64_t>(my_entry) * params.entry_stride_bytes;
    const int rows_left = kv_end - tile_first - lane_row;  // copy l is valid if l * kRowStep < it
    if constexpr (decltype(one_page_constant)::value) {
      const uint8_t* k_source = k_lane_pool + __shfl_sync(0xffffffffu, my_row_bytes, 0) + lane_entry_bytes;
      const uint8_t* v_source = v_lane_pool + __shfl_sync(0xffffffffu, my_row_bytes, 16) + lane_entry_bytes;
#pragma unroll
      for (int l = 0; l < Shape::kLoadsPerLane; ++l) {
        const bool valid = kRowStep * l < rows_left;
        CpAsync16(k_stage + stage_offset[l], k_source, valid, stream_policy);
        CpAsync16(v_stage + stage_offset[l], v_source, valid, stream_policy);
        k_source += row_step_bytes;
        v_source += row_step_bytes;
      }
    } else {
#pragma unroll
      for (int l = 0; l < Shape::kLoadsPerLane; ++l) {
        const int row = lane_row + kRowStep * l;
        const bool valid = kRowStep * l < rows_left;
        const uint8_t* k_source = k_lane_pool + __shfl_sync(0xffffffffu, my_row_bytes, row);
        const uint8_t* v_source = v_lane_pool + __shfl_sync(0xffffffffu, my_row_bytes, 16 + row);
        CpAsync16(k_stage + stage_offset[l], k_source, valid, stream_policy);
        CpAsync16(v_stage + stage_offset[l], v_source, valid, stream_policy);
      }
    }
  };

  // The first tiles' page ids: page-table reads, so before the wait.
  int32_t first_pages[kStages];
#pragma unroll
  for (int tile = 0; tile < kStages; ++tile) first_pages[tile] = fetch_page(tile);
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif

  // --- Q: the group's rows; rows past the group are zero (never stored).
  {
    const T* q = static_cast<const T*>(params.q);
    constexpr int kQLoads = kRows * Shape::kQChunks / kThreads;
#pragma unroll
    for (int l = 0; l < kQLoads; ++l) {
      const int id = tid + l * kThreads;
      const int row = id / Shape::kQChunks;
      const int chunk = id % Shape::kQChunks;
      const bool valid = row < group;
      const T* source = valid ? q + (first_head_row + row) * kHeadDim + chunk * 8 : q;
      CpAsync16(SharedAddress(q_tile + row * kQRowBytes + ((chunk ^ (row & 7)) << 4)), source, valid);
    }
    CpAsyncCommit();
  }

  const bool soft_cap = kSoftCap && params.cap_log2 > 0.0f;
  const float scale_log2 = params.score_scale_log2;
  float o[kMmaD][8];
#pragma unroll
  for (int db = 0; db < kMmaD; ++db) {
#pragma unroll
    for (int e = 0; e < 8; ++e) o[db][e] = 0.0f;
  }
  float row_max[2] = {-INFINITY, -INFINITY};  // rows g and g + 8, log2 domain
  float row_sum[2] = {0.0f, 0.0f};            // this thread's share; summed over the quad later

  // The pipeline and the tile loop, compiled once per way of issuing copies (one_page: uniform
  // over the CTA, so the barrier inside is reached by all).
  auto run = [&](auto one_page_constant) {
#pragma unroll
    for (int tile = 0; tile < kStages - 1; ++tile) {
      if (tile < num_tiles) issue(tile, first_pages[tile], one_page_constant);
      CpAsyncCommit();  // empty groups keep the wait counts uniform
    }
    int32_t page = first_pages[kStages - 1];
    // Q (the oldest group) has landed for every thread; the barrier makes it visible to all.
    CpAsyncWait<kStages - 1>();
    __syncthreads();
    if constexpr (kFp8) {
      ConvertQToHalf<T, Shape>(q_tile, q_scale, tid);
      __syncthreads();
    }
    // Per row (g and g + 8 of the thread's fragments): the factor from a raw score to the log2
    // domain (or to the cap's input), times the power of two fp8's Q conversion divided out.
    float score_scale[2] = {scale_log2, scale_log2};
    float cap_scale[2] = {params.cap_input_scale, params.cap_input_scale};
    if constexpr (kFp8) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float unscale = q_scale[8 * h + (lane >> 2)];
        score_scale[h] *= unscale;
        cap_scale[h] *= unscale;
      }
    }

    // ldmatrix lane addresses and swizzle bits (see the layouts above). Row bases are multiples
    // of 8, so a lane's row % 8 is lane % 8.
    const uint32_t q_lane = SharedAddress(q_tile) + ((lane & 7) + 8 * ((lane >> 3) & 1)) * kQRowBytes;
    const uint32_t a_z = (lane >> 4) ^ (lane & 7);  // Q and V: chunk + lane / 16
    const uint32_t v_lane_offset = ((lane & 7) + 8 * ((lane >> 3) & 1)) * kRowBytes;
    // fp8 K tiles take V's plain x4 (keys 0-7 / 8-15 at chunks +0 / +0 / +1 / +1).
    const uint32_t k_lane_offset = kFp8 ? v_lane_offset : ((lane & 7) + 8 * (lane >> 4)) * kRowBytes;
    const uint32_t k_z = kFp8 ? a_z : ((lane >> 3) & 1) ^ (lane & 7);
    // fp8 tiles, K or V at `lane_address` (the stage plus this lane's x4 row; z its swizzle
    // bits): f(c, keys_0_7, keys_8_15) for every 16-byte chunk c of the rows (16 dims), with lane
    // (g, t)'s 4 fp8 of dims 16c + 4t..4t+3 of keys g and 8 + g; one ldmatrix.x4 serves two chunks.
    auto for_each_fp8_chunk = [&](uint32_t lane_address, uint32_t z, auto&& f) {
      StaticFor<kMmaD / 2>([&](auto pair_constant) {
        constexpr int pair = decltype(pair_constant)::value;
        uint32_t r[4];  // keys 0-7 / 8-15 of chunk 2 pair, then of chunk 2 pair + 1
        LdMatrixX4(lane_address + SwizzledStepBytes<pair>(z), r);
        StaticFor<2>([&](auto half_constant) {
          constexpr int half = decltype(half_constant)::value;
          f(std::integral_constant<int, 2 * pair + half>{}, r[2 * half], r[2 * half + 1]);
        });
      });
    };

    for (int tile = 0; tile < num_tiles; ++tile) {
      CpAsyncWait<kStages - 2>();  // this lane's copies of the tile have landed
      // Makes every lane's copies visible, and every lane is done reading the stage refilled next.
      __syncwarp();
      const int next_tile = tile + kStages - 1;
      if (next_tile < num_tiles) issue(next_tile, page, one_page_constant);
      CpAsyncCommit();
      page = fetch_page(next_tile + 1);

      const uint32_t k_stage = warp_stages + (tile % kStages) * Shape::kWarpStageBytes;
      const uint32_t v_stage = k_stage + Shape::kWarpTileBytes;

      // S = Q K^T over head_dim.
      float s[8];
#pragma unroll
      for (int e = 0; e < 8; ++e) s[e] = 0.0f;
      if constexpr (kFp8) {
        // Lane (g, t)'s dims 4t..4t+3 of a key are k 2t, 2t+1 (b0) and 2t+8, 2t+9 (b1) of the
        // chunk's k-step in Q's permuted order.
        for_each_fp8_chunk(k_stage + k_lane_offset, k_z, [&](auto c_constant, uint32_t keys_0_7,
                                                             uint32_t keys_8_15) {
          constexpr int c = decltype(c_constant)::value;
          uint32_t qa[4];
          LdMatrixX4(q_lane + SwizzledStepBytes<c>(a_z), qa);
          Mma16816<MmaT>(s, qa, ConvertPair<__half, __nv_fp8_e4m3>(keys_0_7 & 0xffffu),
                         ConvertPair<__half, __nv_fp8_e4m3>(keys_0_7 >> 16));
          Mma16816<MmaT>(s + 4, qa, ConvertPair<__half, __nv_fp8_e4m3>(keys_8_15 & 0xffffu),
                         ConvertPair<__half, __nv_fp8_e4m3>(keys_8_15 >> 16));
        });
      } else {
        StaticFor<kMmaD>([&](auto step_constant) {
          constexpr int step = decltype(step_constant)::value;
          uint32_t qa[4], kb[4];
          LdMatrixX4(q_lane + SwizzledStepBytes<step>(a_z), qa);
          LdMatrixX4(k_stage + k_lane_offset + SwizzledStepBytes<step>(k_z), kb);
          Mma16816<MmaT>(s, qa, kb[0], kb[1]);
          Mma16816<MmaT>(s + 4, qa, kb[2], kb[3]);
        });
      }

      // Scores in the log2 domain; keys past the item's end are masked (the plan already cut the
      // item to the sliding window, and one query row has nothing causal to mask).
      const int valid_keys = kv_end - (warp_first + tile * kTileKeys);
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const int key = 8 * (e / 4) + 2 * (lane & 3) + (e & 1);
        // Non-finite scores (NaN or inf in q or K) become NaN before the cap (tanh(inf) is
        // finite), so they reach the row's sum and o: NaN in, NaN out (one FFMA).
        const float raw = s[e] * 0.0f + s[e];
        const int h = (e / 2) % 2;
        const float score = soft_cap ? SoftCapLog2(raw, cap_scale[h], params.cap_log2) : raw * score_scale[h];
        s[e] = key < valid_keys ? score : -INFINITY;
      }

      float subtract[2];
      bool any_rescale = false;
      float rescale[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float tile_max = fmaxf(fmaxf(s[2 * h], s[2 * h + 1]), fmaxf(s[4 + 2 * h], s[5 + 2 * h]));
        tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
        tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
        const float new_max = fmaxf(row_max[h], tile_max);
        // Nothing seen yet: subtracting 0 keeps exp2(-inf) = 0 instead of exp2(-inf + inf) = NaN.
        subtract[h] = new_max == -INFINITY ? 0.0f : new_max;
        rescale[h] = FastExp2(row_max[h] - subtract[h]);
        any_rescale |= new_max != row_max[h];
        row_max[h] = new_max;
        row_sum[h] *= rescale[h];
      }
      // Once the maxima settle most tiles change no row: skip multiplying every accumulator by 1.
      if (__any_sync(0xffffffffu, any_rescale)) {
#pragma unroll
        for (int db = 0; db < kMmaD; ++db) {
#pragma unroll
          for (int e = 0; e < 8; ++e) o[db][e] *= rescale[(e / 2) % 2];
        }
      }

      uint32_t p_frag[4];
      {
        float p[8];
#pragma unroll
        for (int e = 0; e < 8; ++e) p[e] = FastExp2(s[e] - subtract[(e / 2) % 2]);
        row_sum[0] += (p[0] + p[1]) + (p[4] + p[5]);
        row_sum[1] += (p[2] + p[3]) + (p[6] + p[7]);
#pragma unroll
        for (int i = 0; i < 4; ++i) p_frag[i] = PackFloat2<MmaT>(p[2 * i], p[2 * i + 1]);
      }

      // O += P V.
      if constexpr (kFp8) {
        // V as it landed (no .trans for bytes): converted, lane (g, t)'s dims (4t, 4t+1) and
        // (4t+2, 4t+3) of keys 0-7 (and 8-15) are two 8 x 8 fp16 matrices whose transposes are B
        // fragments over keys: o[c][0..3] then holds dims 16c + 4t, + 1 and o[c][4..7] dims
        // 16c + 4t + 2, + 3 (rows as in C; the epilogue maps them back).
        auto b = [](uint32_t pair_bits) {
          return TransposeMatrix(ConvertPair<__half, __nv_fp8_e4m3>(pair_bits));
        };
        for_each_fp8_chunk(v_stage + v_lane_offset, a_z, [&](auto c_constant, uint32_t keys_0_7,
                                                             uint32_t keys_8_15) {
          constexpr int c = decltype(c_constant)::value;
          Mma16816<MmaT>(o[c], p_frag, b(keys_0_7 & 0xffffu), b(keys_8_15 & 0xffffu));
          Mma16816<MmaT>(o[c] + 4, p_frag, b(keys_0_7 >> 16), b(keys_8_15 >> 16));
        });
      } else {
        StaticFor<kMmaD>([&](auto db_constant) {
          constexpr int db = decltype(db_constant)::value;
          uint32_t vb[4];
          LdMatrixX4Trans(v_stage + v_lane_offset + SwizzledStepBytes<db>(a_z), vb);
          Mma16816<MmaT>(o[db], p_frag, vb[0], vb[1]);
          Mma16816<MmaT>(o[db] + 4, p_frag, vb[2], vb[3]);
        });
      }
    }
  };
  if (one_page) {
    run(std::true_type{});
  } else {
    run(std::false_type{});
  }
  CpAsyncWait<0>();

#pragma unroll
  for (int h = 0; h < 2; ++h) {
    row_sum[h] += __shfl_xor_sync(0xffffffffu, row_sum[h], 1);
    row_sum[h] += __shfl_xor_sync(0xffffffffu, row_sum[h], 2);
  }
  __syncthreads();  // every warp is done with its pipeline: the merge staging reuses it

  constexpr int kStride = Shape::kMergeStride;
  float* const merge_o = reinterpret_cast<float*>(pipeline);  // [warp][16][kStride]
  float* const merge_m = merge_o + kWarps * kRows * kStride;  // [warp][16]
  float* const merge_d = merge_m + kWarps * kRows;            // [warp][16]
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = 8 * h + (lane >> 2);
    if ((lane & 3) == 0) {
      merge_m[warp * kRows + row] = row_max[h];
      merge_d[warp * kRows + row] = row_sum[h];
    }
#pragma unroll
    for (int db = 0; db < kMmaD; ++db) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int dim = kFp8 ? 16 * db + 4 * (lane & 3) + 2 * half : 16 * db + 8 * half + 2 * (lane & 3);
        *reinterpret_cast<float2*>(merge_o + (warp * kRows + row) * kStride + dim) =
            make_float2(o[db][4 * half + 2 * h], o[db][4 * half + 2 * h + 1]);
      }
    }
  }
  __syncthreads();

  // Eight threads per row, kHeadDim / 8 consecutive dims each; warps merged in warp order.
  constexpr int kDimsPerThread = kHeadDim / 8;
  const int row = tid >> 3;
  // Rows past the group store nothing, but stay for the grid's done signal.
  if (row < group) {
    const int dim_begin = (tid & 7) * kDimsPerThread;
    float merged_max = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) merged_max = fmaxf(merged_max, merge_m[w * kRows + row]);
    const float subtract = merged_max == -INFINITY ? 0.0f : merged_max;
    float weight[kWarps];
    float sum = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      weight[w] = FastExp2(merge_m[w * kRows + row] - subtract);
      sum += weight[w] * merge_d[w * kRows + row];
    }
    // A non-finite V value the row saw left a non-finite o dim: folded into the sum (x * 0 is NaN
    // for inf and NaN), over the row's 8 threads, so the whole row and its lse become NaN.
    float poison = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
#pragma unroll
      for (int d = 0; d < kDimsPerThread; ++d) {
        poison += merge_o[(w * kRows + row) * kStride + dim_begin + d] * 0.0f;
      }
    }
    // Rows are whole groups of 8 lanes (rows past the group skip this together).
    const unsigned row_lanes = 0xFFu << (lane & 24);
    poison += __shfl_xor_sync(row_lanes, poison, 1);
    poison += __shfl_xor_sync(row_lanes, poison, 2);
    poison += __shfl_xor_sync(row_lanes, poison, 4);
    sum += poison;
    // A row that saw no key (every weight 0) stores o = 0 and lse = -inf; NaN scores (every m
    // -inf but the sum NaN) and poisoned rows (sum NaN) store NaN o and lse.
    const bool saw_key = sum != 0.0f;
    const float inverse = saw_key ? params.v_scale / sum : 0.0f;
    const float lse = saw_key ? (merged_max + FastLog2(sum)) * kLn2 : -INFINITY;
    const int32_t partial = params.work.item_partial[item];
    const int64_t head = static_cast<int64_t>(kv_head) * group + row;
#pragma unroll
    for (int c = 0; c < kDimsPerThread / 8; ++c) {
      float value[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const int dim = dim_begin + 8 * c + j;
        float accumulated = 0.0f;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) accumulated += weight[w] * merge_o[(w * kRows + row) * kStride + dim];
        value[j] = accumulated * inverse;
      }
      if (partial < 0) {
        const int64_t out_row = first_head_row + row;
        *reinterpret_cast<uint4*>(static_cast<uint16_t*>(params.o) + out_row * kHeadDim + dim_begin + 8 * c) =
            PackOut8(value, params.o_bf16);
      } else {
        const int64_t slot_row = static_cast<int64_t>(partial) * params.num_qo_heads + head;
        float4* target = reinterpret_cast<float4*>(params.partial_o + slot_row * kHeadDim + dim_begin + 8 * c);
        target[0] = make_float4(value[0], value[1], value[2], value[3]);
        target[1] = make_float4(value[4], value[5], value[6], value[7]);
      }
    }
    if ((tid & 7) == 0) {
      if (partial < 0) {
        if (params.lse != nullptr) params.lse[first_head_row + row] = lse;
      } else {
        params.partial_lse[static_cast<int64_t>(partial) * params.num_qo_heads + head] = lse;
      }
    }
  }
  SignalWhenGridDone(params.done);
}

}  // namespace attnd::cuda::decode_tc
