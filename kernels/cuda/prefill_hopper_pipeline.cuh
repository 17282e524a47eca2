// The Hopper prefill kernel's (prefill_hopper_kernel.cuh) fixed shapes, shared memory layout,
// the decoding of a CTA's work item, and its producer: paged K/V tiles copied with cp.async into
// 128-byte-swizzled stages that complete on mbarriers. sm_90a only.
#pragma once

#include <cstdint>
#include <type_traits>

#include "cp_async.cuh"
#include "fast_divider.h"
#include "hopper_ptx.cuh"
#include "math.cuh"
#include "non_finite.cuh"
#include "prefill_params.h"

namespace attnd::cuda::prefill::hopper {

inline constexpr int kConsumers = 2;
inline constexpr int kThreads = 128 * (1 + kConsumers);
inline constexpr int kTileRows = 64 * kConsumers;
// Registers a thread after setmaxnreg (the producer at 40 spilled its address math). The CTA
// starts with 168 a thread (65536 / 384, in steps of 8) and setmaxnreg only moves registers
// between its warpgroups: the consumers' increase waits for the producer's decrease and blocks
// forever past the CTA's own 3 x 168 (64 / 224 hung the head_dim 256 kernel on an H200). At
// head_dim 256 a consumer holds O (128), S (32) and P (16) at once: ptxas spills ~140 bytes
// there (two values a KV tile in the loop, the rest in the prologue and epilogue; 40 / 232
// spills more).
inline constexpr int kProducerRegisters = 56;
inline constexpr int kConsumerRegisters = 224;
inline constexpr int kLaunchRegisters = (65536 / kThreads) / 8 * 8;
static_assert(kProducerRegisters + kConsumers * kConsumerRegisters <= (1 + kConsumers) * kLaunchRegisters,
              "setmaxnreg moves registers within the CTA's launch allocation");

// Named barrier ids (0 is __syncthreads): the consumers' turn-taking pair, then one per consumer.
inline constexpr uint32_t kTurnBarrier = 1;       // + consumer index
inline constexpr uint32_t kConsumerBarrier = 3;   // + consumer index
inline constexpr uint32_t kProducerBarrier = 5;   // the producer warpgroup's 128 threads


// Head dims 64 and 128 take KV tiles of 128 keys and two Q buffers (192 KB of shared memory at 128);
// head_dim 256 tiles of 64 keys, so that a consumer thread's O (128 floats), S and P fit its
// registers, and one Q buffer (192 KB: Q 64, K and V 64 each).
template <int kHeadDimArg, int kStagesArg>
struct HopperShape {
  static constexpr int kHeadDim = kHeadDimArg;
  static constexpr int kStages = kStagesArg;
  static constexpr int kTileKv = kHeadDim <= 128 ? 128 : 64;  // keys per K/V tile
  // The producer's lanes copy kRowsPerLane consecutive rows of a KV tile each (ProduceKvTiles):
  // 4 warps x 4 lane groups cover a tile.
  static constexpr int kRowsPerLane = kTileKv / 16;
  static constexpr int kBlocks = kHeadDim / 64;      // 128-byte column blocks per row
  static constexpr int kChunks = kHeadDim / 8;       // 16-byte chunks per row
  static constexpr int kQBlockBytes = 64 * 128;      // one column block of one consumer's Q
  static constexpr int kQBytes = kBlocks * kQBlockBytes;
  static constexpr int kKvBlockBytes = kTileKv * 128;
  static constexpr int kKvBytes = kBlocks * kKvBlockBytes;
  // Two Q buffers: work k of a CTA reads buffer k % 2, so the producer loads a work's rows while
  // the consumers finish the one before. With one (head_dim 256) it loads them once the
  // consumers' last Q K^T of the work before completed.
  static constexpr int kQBuffers = kHeadDim <= 128 ? 2 : 1;
  static constexpr int kQOffset = 0;
  static constexpr int kKOffset = kQOffset + kQBuffers * kConsumers * kQBytes;
  static constexpr int kVOffset = kKOffset + kStages * kKvBytes;
  // mbarriers: K full, K empty, V full, V empty per stage, then Q full and Q empty per buffer.
  static constexpr int kBarrierOffset = kVOffset + kStages * kKvBytes;
  static constexpr int kQBarrierOffset = kBarrierOffset + 4 * kStages * 8;
  // [kStages][kTileKv bits]: set where a V row of a tile that hides keys held a non-finite value.
  static constexpr int kFlagOffset = kQBarrierOffset + 2 * kQBuffers * 8;
  static constexpr int kFlagBytes = kTileKv / 8;
  // [kWorkRecords] work records (CtaWork, 64 bytes each): the producer stores work k's beside its
  // Q rows in buffer k % kQBuffers (ProduceQ; on demand, in record k % kWorkRecords: PublishWork),
  // and the consumers read it there once Q is full.
  static constexpr int kWorkOffset = (kFlagOffset + kStages * kFlagBytes + 15) / 16 * 16;
  static constexpr int kWorkBytes = 64;
  static constexpr int kWorkRecords = kQBuffers + 1;
  static constexpr int kSmemBytes = kWorkOffset + kWorkRecords * kWorkBytes + 1024;  // + alignment slack
  static_assert(kHeadDim == 64 || kHeadDim == 128 || kHeadDim == 256, "head_dim");
  static_assert(kSmemBytes <= 227 * 1024, "shared memory of one CTA");
};

// Q buffer `buffer`'s rows of consumer `consumer`, and the buffer's mbarriers: full (the
// producer's 128 threads' copies landed and its work record was stored: kQFullArrivals) and
// empty (every consumer warp's last Q K^T completed).
template <typename Shape>
__device__ __forceinline__ uint32_t QSmem(uint32_t smem, int buffer, int consumer) {
  return smem + Shape::kQOffset + (buffer * kConsumers + consumer) * Shape::kQBytes;
}
template <typename Shape>
__device__ __forceinline__ uint32_t QFull(uint32_t smem, int buffer) {
  return smem + Shape::kQBarrierOffset + 8 * buffer;
}
template <typename Shape>
__device__ __forceinline__ uint32_t QEmpty(uint32_t smem, int buffer) {
  return smem + Shape::kQBarrierOffset + 8 * (Shape::kQBuffers + buffer);
}
// Q full completes on the producer's 128 threads' copies and one plain arrival, its thread 0's
// after it stored the work record (ProduceQ): the arrival's release orders the record.
inline constexpr uint32_t kQFullArrivals = 128 + 1;

// Byte offset of 16-byte chunk `chunk` of row `row` in a swizzled tile of `kRows` rows.
template <int kRows>
__device__ __forceinline__ uint32_t SwizzledChunk(int row, int chunk) {
  return (chunk / 8) * (kRows * 128) + row * 128 + (((chunk % 8) ^ (row % 8)) << 4);
}

// The work of one CTA, decoded from its item the same way in every thread (or stored in shared
// memory by the producer's thread 0 and read there: StoreWork, LoadWork).
struct alignas(16) CtaWork {
  int index;  // into the launch's items (one per KV head)
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

// Work record `buffer` (Shape::kWorkOffset; < kWorkRecords), through a generic pointer to the
// CTA's aligned shared memory.
template <typename Shape>
__device__ __forceinline__ void StoreWork(uint8_t* smem_generic, int buffer, const CtaWork& work) {
  static_assert(sizeof(CtaWork) <= Shape::kWorkBytes, "work record");
  *reinterpret_cast<CtaWork*>(smem_generic + Shape::kWorkOffset + buffer * Shape::kWorkBytes) = work;
}
template <typename Shape>
__device__ __forceinline__ CtaWork LoadWork(const uint8_t* smem_generic, int buffer) {
  return *reinterpret_cast<const CtaWork*>(smem_generic + Shape::kWorkOffset + buffer * Shape::kWorkBytes);
}

// Division by the launch's GQA group, the multiplier read from the parameters (constant memory)
// where it is used.
__device__ __forceinline__ int DivideByGroup(const KernelParams& params, int n) {
  return FastDivider(params.group_size, params.group_multiplier).Divide(n);
}

template <typename Shape>
__device__ __forceinline__ CtaWork DecodeWork(const KernelParams& params, int index) {
  constexpr int kTileKv = Shape::kTileKv;
  CtaWork work;
  work.index = index;
  const WorkItem item = params.items[index];
  work.kv_head = item.kv_head;
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
  work.first_position = work.position_offset + DivideByGroup(params, work.row_start);
  work.last_position = work.position_offset + DivideByGroup(params, work.row_end - 1);
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

// A V tile that hides keys from some row (the causal diagonal, a window's edge), whose copies this
// thread issued but has not yet scanned for non-finite values (ScanV). The scan waits for the
// copies to land; done at once, it held the producer for a whole load's latency at the end of
// every causal work, before it could issue the next work's K_0 and Q. So the scan waits until the
// producer has issued the copies after it (the next load), or until it must arrive before a wait
// of its own (FlushScan).
struct PendingScan {
  uint32_t lane_smem = 0;  // this thread's first row chunk of the tile (ProduceKvTiles' lane_smem)
  uint32_t flags = 0;      // the stage's flag words
  uint32_t full = 0;       // the stage's full barrier
  int round = -1;          // the CTA's work (round) the tile belongs to; -1: none pending
};

// Zeroes the non-finite values of the pending V tile, flags their rows (a bit each, one word per
// warp; the consumers make the rows that see a flagged key NaN) and arrives on its full barrier.
// The tile's copies have landed (the caller waited for their commit group).
template <typename Shape, typename T>
__device__ __forceinline__ void ScanV(PendingScan& pending) {
  constexpr int kBlocks = Shape::kBlocks;
  constexpr int kTileKv = Shape::kTileKv;
  constexpr int kRowsPerLane = Shape::kRowsPerLane;
  const int warp = (threadIdx.x / 32) % 4;
  const int lane = threadIdx.x % 32;
  constexpr uint32_t kExponent = kNonFiniteExponent2<T>;
  uint32_t warp_bits = 0;  // bit r: row (kTileKv / 4) * warp + r held a non-finite value
#pragma unroll
  for (int i = 0; i < kRowsPerLane; ++i) {
    uint32_t found = 0;
#pragma unroll
    for (int b = 0; b < kBlocks; ++b) {
      const uint32_t address = ((pending.lane_smem ^ (i << 4)) + i * 128) + b * Shape::kKvBlockBytes;
      uint4* bytes = static_cast<uint4*>(__cvta_shared_to_generic(address));
      const uint4 bits = *bytes;
      const uint32_t bad[4] = {__vcmpeq2(bits.x & kExponent, kExponent), __vcmpeq2(bits.y & kExponent, kExponent),
                               __vcmpeq2(bits.z & kExponent, kExponent), __vcmpeq2(bits.w & kExponent, kExponent)};
      const uint32_t any = bad[0] | bad[1] | bad[2] | bad[3];
      if (any != 0) *bytes = make_uint4(bits.x & ~bad[0], bits.y & ~bad[1], bits.z & ~bad[2], bits.w & ~bad[3]);
      found |= any;
    }
    // Lane group g (lanes 8g..8g+7) holds row kRowsPerLane * g + i of the warp's: that bit is
    // set if any of its lanes found a non-finite value.
    const uint32_t votes = __ballot_sync(0xffffffffu, found != 0);
#pragma unroll
    for (int g = 0; g < 4; ++g) {
      warp_bits |= ((votes >> (8 * g)) & 0xffu) != 0 ? 1u << (kRowsPerLane * g + i) : 0u;
    }
  }
  // A warp's rows are kTileKv / 4 consecutive bits of the stage's flags.
  if (lane == 0) {
    if constexpr (kTileKv == 128) {
      *static_cast<uint32_t*>(__cvta_shared_to_generic(pending.flags + 4 * warp)) = warp_bits;
    } else {
      static_assert(kTileKv == 64, "flag words");
      *static_cast<uint16_t*>(__cvta_shared_to_generic(pending.flags + 2 * warp)) = static_cast<uint16_t>(warp_bits);
    }
  }
  FenceProxyAsync();  // generic-proxy writes, read next by wgmma (the async proxy)
  MbarrierArrive(pending.full);
  pending.round = -1;
}

// The pending scan now, if one is left from work `before` or earlier (by default any work: when
// the producer is done). Q empty of work q's buffer is the consumers' release of work q - kQBuffers,
// once they have that work's last V: the producer flushes a scan of that work or an earlier one
// before it waits there.
template <typename Shape, typename T>
__device__ __forceinline__ void FlushScan(PendingScan& pending, int before = 1 << 30) {
  if (pending.round < 0 || pending.round > before) return;
  CpAsyncWait<0>();
  ScanV<Shape, T>(pending);
}

// Copies kRows Q rows of `work`, from its packed row row_start + first_row, into Q buffer
// `buffer` (row r of the tile in consumer r / 64's block); 128 threads share the copies, this one
// being `thread` of them. Rows past the request are zero-filled (and never stored).
template <typename Shape, typename T, int kRows>
__device__ __forceinline__ void CopyQRows(const KernelParams& params, const CtaWork& work, uint32_t smem, int buffer,
                                          int first_row, int thread) {
  constexpr int kChunks = Shape::kChunks;
  const int chunk = thread % kChunks;
  const int group = params.group_size;
  const T* q = static_cast<const T*>(params.q);
#pragma unroll
  for (int pass = 0; pass < kRows * kChunks / 128; ++pass) {
    const int row = first_row + thread / kChunks + pass * (128 / kChunks);
    const int packed = work.row_start + row;
    const bool valid = packed < work.row_end;
    const T* source = q;
    if (valid) {
      const int token = DivideByGroup(params, packed);
      const int head = work.kv_head * group + (packed - token * group);
      source += (static_cast<int64_t>(work.qo_start + token) * params.num_qo_heads + head) * Shape::kHeadDim + chunk * 8;
    }
    CpAsync16(QSmem<Shape>(smem, buffer, row / 64) + SwizzledChunk<64>(row % 64, chunk), source, valid);
  }
}

// The Q rows of the CTA's `round`-th work (round >= 1; the consumers load their first work's
// rows themselves, beside the producer's first K tile) into buffer round % kQBuffers, and the
// work's record beside them (the consumers read it once Q is full; with two buffers the
// producer reads it too, when it reaches that work), once the consumers released that buffer's
// previous rows (work round - kQBuffers), which also ends their use of its record.
template <typename Shape, typename T>
__device__ __forceinline__ void ProduceQ(const KernelParams& params, const CtaWork& work, uint32_t smem,
                                         uint8_t* smem_generic, int round, PendingScan& pending) {
  const int buffer = round % Shape::kQBuffers;
  FlushScan<Shape, T>(pending, round - Shape::kQBuffers);
  // Fill u = round / kQBuffers of the buffer waits for the release of fill u - 1 (fill 0 of
  // buffer 0 is the consumers' own): parity (u & 1) ^ 1, which passes at once for u = 0.
  MbarrierWait(QEmpty<Shape>(smem, buffer), ((round / Shape::kQBuffers) & 1) ^ 1);
  if (threadIdx.x % 128 == 0) {
    StoreWork<Shape>(smem_generic, buffer, work);
    MbarrierArrive(QFull<Shape>(smem, buffer));
  }
  // The producer's other threads read the record when they reach the work.
  if constexpr (Shape::kQBuffers > 1) NamedBarrierSync(kProducerBarrier, 128);
  CopyQRows<Shape, T, kTileRows>(params, work, smem, buffer, 0, threadIdx.x % 128);
  CpAsyncArriveNoinc(QFull<Shape>(smem, buffer));
}

// Works on demand (HopperPrefillOnDemandKernel, KernelParams::work_counter): the CTA's
// `round`-th work (round >= 1), published by the producer. Thread 0 takes `next_index`, which it
// took from the counter a round before, takes the one after from the counter now (so that the
// atomic's latency never waits), decodes the work (index -1: none left, which ends the
// consumers' loop and the producer's) and stores its record at once, in record round %
// kWorkRecords: that record's last reader, work round - kWorkRecords, read it before its
// consumers released the Q buffer this producer waited for in the round before. Once the
// consumers released buffer round % kQBuffers's previous rows (work round - kQBuffers), the
// producer's threads read the record back and copy the work's Q rows beside it; Q full
// completes on their copies and thread 0's arrival.
template <typename Shape, typename T>
__device__ __forceinline__ void PublishWork(const KernelParams& params, int& next_index, uint32_t smem,
                                            uint8_t* smem_generic, int round, PendingScan& pending) {
  static_assert(Shape::kWorkRecords > Shape::kQBuffers, "a record outlives its Q buffer's release");
  const int buffer = round % Shape::kQBuffers;
  const int record = round % Shape::kWorkRecords;
  if (threadIdx.x % 128 == 0) {
    const int index = next_index;
    CtaWork work;
    if (index < params.num_work) {
      next_index = params.counter_base + atomicAdd(params.work_counter, 1);
      work = DecodeWork<Shape>(params, index);
    } else {
      work = CtaWork{};
      work.index = -1;
    }
    StoreWork<Shape>(smem_generic, record, work);
  }
  // Fill u = round / kQBuffers of the buffer waits for the release of fill u - 1 (fill 0 of
  // buffer 0 is the consumers' own): parity (u & 1) ^ 1, which passes at once for u = 0.
  FlushScan<Shape, T>(pending, round - Shape::kQBuffers);
  MbarrierWait(QEmpty<Shape>(smem, buffer), ((round / Shape::kQBuffers) & 1) ^ 1);
  if (threadIdx.x % 128 == 0) MbarrierArrive(QFull<Shape>(smem, buffer));
  NamedBarrierSync(kProducerBarrier, 128);
  const CtaWork work = LoadWork<Shape>(smem_generic, record);
  if (work.index >= 0) CopyQRows<Shape, T, kTileRows>(params, work, smem, buffer, 0, threadIdx.x % 128);
  // With no copies (none left) the arrival still counts, once this thread's earlier copies landed.
  CpAsyncArriveNoinc(QFull<Shape>(smem, buffer));
}

// Works on demand: once every CTA sharing the counter took its last index, the last to finish
// zeroes the counter's two words for the next launch (which reads them only after this grid
// completed: griddepcontrol.wait, or stream order). Producer thread 0, after its last
// PublishWork.
__device__ __forceinline__ void FinishWorkCounter(const KernelParams& params) {
  if (threadIdx.x != 0) return;
  __threadfence();
  if (atomicAdd(params.work_counter + 1, 1) == params.counter_ctas - 1) {
    atomicExch(params.work_counter, 0);
    atomicExch(params.work_counter + 1, 0);
  }
}

// Copies KV tiles into the stages. Warp w copies rows [32w, 32w + 32) of each tile: lane group
// g = lane / 8 takes the 8 rows 32w + 8g + i (i = 0..7), and lane c = lane % 8 the 16-byte chunk
// c of each of a row's 128-byte column blocks, so one warp instruction reads 4 whole 128-byte
// lines. (The version before had a lane pair per row, 32 bytes of each of 16 rows per
// instruction: 16 one-sector L2 requests where 4 four-sector ones do, and ncu showed L2 at 93% of
// its throughput with the tensor pipe at 51%, non-causal 1x8192 on an H100.) A lane looks up the
// pages of its 8 rows itself (one lookup where they share a page); the swizzled chunk
// c ^ (row % 8) is c ^ i, one XOR per row, and the column block is an immediate offset on both
// sides. (With 64-key tiles, head_dim 256: 16 rows a warp, 4 a lane group, and row % 8 is
// (row0 % 8) + i, row0 % 8 being 0 or 4.)
// `first` counts the tiles this CTA loaded for earlier work: tile t of this work is the CTA's
// (first + t)-th, which fixes its stage and phase.
// kOnePage: a lane's 8 rows lie in one page (ProduceKv). A loop of its own for each case, so that
// the common one carries none of the other's per-row lookups (instruction cache).
// Steps [step_begin, step_end) of the work's n + 1: step s loads K_s (s < n), then V_{s-1}
// (s > 0); the consumers need K_j before V_{j-1}.
template <typename Shape, typename T, bool kOnePage>
__device__ __forceinline__ void ProduceKvTiles(const KernelParams& params, const CtaWork& work, uint32_t smem,
                                               int first, int step_begin, int step_end, PendingScan& pending,
                                               int round) {
  constexpr int kBlocks = Shape::kBlocks;
  constexpr int kTileKv = Shape::kTileKv;
  constexpr int kRowsPerLane = Shape::kRowsPerLane;
  const int warp = (threadIdx.x / 32) % 4;
  const int lane = threadIdx.x % 32;
  const int chunk = lane % 8;
  const int row0 = (kTileKv / 4) * warp + kRowsPerLane * (lane / 8);  // 8 rows a lane: row % 8 is i
  const int page_mask = (1 << params.page_size_log2) - 1;
  const int64_t head_offset = static_cast<int64_t>(work.kv_head) * params.kv_head_stride + chunk * 8;
  const T* k_pool = static_cast<const T*>(params.k_pool) + head_offset;
  const T* v_pool = static_cast<const T*>(params.v_pool) + head_offset;
  const int32_t* k_ids = params.k_page_ids + work.page_begin;
  const int32_t* v_ids = params.v_page_ids + work.page_begin;
  const uint32_t barriers = smem + Shape::kBarrierOffset;
  const int64_t entry_stride = params.kv_entry_stride;

  // `flags`: for V, this stage's row flags; null for K.
  auto load = [&](const T* pool, const int32_t* ids, int tile, uint32_t tile_smem, uint32_t empty, uint32_t full,
                  uint32_t empty_parity, uint32_t flags) {
    const int tile_start = work.kv_begin + tile * kTileKv;
    const int token0 = tile_start + row0;
    // Rows i >= valid_rows are past the keys. Every row's address stays inside the pool (a row
    // past the keys reads page 0, or the page of the lane's first row), so the copies take it
    // as it is, with the column block as an immediate offset, and a zero source size where the
    // row is past the keys: no select per copy.
    const int valid_rows = min(max(work.kv_end - token0, 0), kRowsPerLane);
    const T* source[kRowsPerLane];
    // Looked up before the wait, so the page ids' latency hides behind it.
    if constexpr (kOnePage) {
      const int page = valid_rows > 0 ? __ldg(ids + (token0 >> params.page_size_log2)) : 0;
      const T* row = pool + static_cast<int64_t>(page) * params.kv_page_stride + (token0 & page_mask) * entry_stride;
#pragma unroll
      for (int i = 0; i < kRowsPerLane; ++i) source[i] = row + i * entry_stride;
    } else {
#pragma unroll
      for (int i = 0; i < kRowsPerLane; ++i) {
        const int token = token0 + i;
        const int page = i < valid_rows ? __ldg(ids + (token >> params.page_size_log2)) : 0;
        source[i] = pool + static_cast<int64_t>(page) * params.kv_page_stride + (token & page_mask) * entry_stride;
      }
    }
    // Chunk c of row row0 + i sits at 16 * (c ^ i) in the row's 128 bytes of each column block
    // (16 * (c ^ (row0 % 8) ^ i) with 4 rows a lane).
    uint32_t lane_smem = tile_smem + row0 * 128 + (chunk << 4);
    if constexpr (kRowsPerLane < 8) lane_smem ^= (row0 % 8) << 4;
    MbarrierWait(empty, empty_parity);
#pragma unroll
    for (int i = 0; i < kRowsPerLane; ++i) {
      const uint32_t row_smem = (lane_smem ^ (i << 4)) + i * 128;
#pragma unroll
      for (int b = 0; b < kBlocks; ++b) {
        // Rows past the keys are zero-filled: V must be, since P = 0 times stale memory could
        // be NaN.
        CpAsync16(row_smem + b * Shape::kKvBlockBytes, source[i] + 64 * b, i < valid_rows);
      }
    }
    // P V adds p = 0 times V for keys a row does not see, and 0 * NaN would make a row NaN that
    // never saw the key. In a V tile where some row does not see some key (keys past kv_end are
    // zero-filled already), the non-finite values are zeroed and their rows flagged (ScanV)
    // before the tile is full; the scan waits for its copies, so it is left pending until the
    // next load's copies are issued (PendingScan).
    const bool hides_keys =
        flags != 0 && ((params.causal && min(tile_start + kTileKv, work.kv_end) - 1 > work.first_position) ||
                       (params.window_left >= 0 && tile_start < work.last_position - params.window_left));
    if (!hides_keys) CpAsyncArriveNoinc(full);
    if (pending.round < 0 && !hides_keys) return;
    // This load's copies as a group of their own, so that the pending tile's (the group before)
    // can be waited for alone.
    CpAsyncCommit();
    if (pending.round >= 0) {
      CpAsyncWait<1>();
      ScanV<Shape, T>(pending);
    }
    if (hides_keys) {
      pending.lane_smem = lane_smem;
      pending.flags = flags;
      pending.full = full;
      pending.round = round;
    }
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
  // Peeled as the whole work's loop would be, so that the steps inside it test nothing.
  int step = step_begin;
  if (step == 0 && step < step_end) {
    if (n > 0) load_k(0);
    ++step;
  }
  const int loop_end = min(step_end, n);
  for (; step < loop_end; ++step) {
    load_k(step);
    load_v(step - 1);
  }
  if (step == n && step < step_end && n > 0) load_v(n - 1);
}

template <typename Shape, typename T>
__device__ __forceinline__ void ProduceKv(const KernelParams& params, const CtaWork& work, uint32_t smem, int first,
                                          int step_begin, int step_end, PendingScan& pending, int round) {
  // A lane's 8 rows (4 with 64-key tiles) lie in one page when pages hold that many keys or more
  // and the work's first key sits on a multiple of it (tiles are a multiple too): one page
  // lookup, then a stride per row. Otherwise (smaller pages, a window's unaligned start) each
  // row looks up its own page.
  constexpr int kRowsPerLane = Shape::kRowsPerLane;
  constexpr int kLog2 = kRowsPerLane == 8 ? 3 : 2;
  static_assert(kRowsPerLane == 1 << kLog2, "pages of 2^kLog2 keys or more");
  if (params.page_size_log2 >= kLog2 && work.kv_begin % kRowsPerLane == 0) {
    ProduceKvTiles<Shape, T, true>(params, work, smem, first, step_begin, step_end, pending, round);
  } else {
    ProduceKvTiles<Shape, T, false>(params, work, smem, first, step_begin, step_end, pending, round);
  }
}

}  // namespace attnd::cuda::prefill::hopper
