// MLA decode on Hopper (sm_90a), DESIGN 4.6: the wide-tile kernel (MlaKernel::kHopperWide), a
// variant of mla_decode_hopper.cuh with the same units, masks, outputs and partials: a CTA
// computes 64 rows (query token, head) of one request against one chunk of its latent keys, here
// in tiles of 64 keys. For caches of q's 16-bit type or fp8 e4m3 (ProduceWideFp8), any scales.
//
// Why a variant: the split-K kernel multiplies Q K^T as m64n32k16 with both operands in shared
// memory (3 KB per 16-clock instruction, more than shared memory feeds the tensor cores) and
// swaps partial scores between its consumers every tile. Here one warpgroup owns S:
//   producer (warpgroup 0, 56 registers): cp.async of each tile's 64 ckv and kpe rows through the
//     page table into a ring of Shape::kStages stages (rows past the chunk zero-filled); a stage
//     is full when every producer thread's copies landed, empty when all 8 consumer warps
//     released it.
//   scorer (warpgroup 1, 224 registers): S = Q K^T over all D = rank + 64 columns (wgmma
//     m64n64k16, Q and K from shared memory: 4 KB per 32-clock instruction), the online softmax
//     (row statistics live here only), P to shared memory with each row's rescale factor, then
//     O_0 += P V_0 (wgmma m64n256k16, P from registers).
//   helper (warpgroup 2, 224 registers): O_1 *= the published factors, O_1 += P V_1 (m64n256k16,
//     P and V from shared memory).
// Consumer c (scorer 0, helper 1) owns output columns [c * rank / 2, (c + 1) * rank / 2) of all
// 64 rows (128 fp32 per thread at rank 512; m64n128 at rank 256).
//
// A request of 128 heads has two such CTAs per chunk, which read the same keys. Launched in
// clusters of two (MlaParams::cluster_pairs), such a pair fetches each TMA tile once: each
// producer loads half of the tile's boxes into the stages of both CTAs (ClusterPeer).
//
// Order of one tile j in the scorer: wait for stage j, issue Q K_j^T behind the still running
// P_{j-1} V_0; wait_group 1 (P_{j-1} V_0 done: release stage j-1, so the producer refills it
// while tile j is computed; where tile j has not landed yet, the release comes before that
// wait); wait_group 0; softmax; wait for the helper to have finished P_{j-1} (kPEmptyBarrier);
// publish P_j and the factors (kPFullBarrier); issue P_j V_0. The helper's P_j V_1 runs beside
// the scorer's next Q K^T.
//
// Shared memory (1024-byte aligned 8 KB blocks of 64 rows x 128 B, 128-byte swizzle, see
// hopper_ptx.cuh):
//   Q        [D/64 blocks][64 rows][128 B]                72 KB at rank 512
//   KV       [kStages][D/64 blocks][64 keys][128 B]       ckv in blocks 0..rank/64-1, kpe last
//   P        [64 rows][128 B]: 64 keys of the MMA type, K-major (the helper's A operand)
//   factors  [64] float: per tile the rows' rescale factors
//   inverses [64] float: after the last tile, o_scale / sum (apart from the factors, so that the
//            helper's last read of the factors and these writes share no address)
//   mbarriers: full, empty per stage.
//   peer     4 bytes: 1 where the CTA shares its tiles with the other CTA of its cluster (read by
//            the consumers there rather than kept in their registers).
// Rank 512: 72 + 2 x 72 + 8 KB (+ 1 KB alignment slack) = 225.3 KB of the 227 KB an SM offers.
#pragma once

#include <cstdint>
#include <type_traits>

#include "hopper_ptx.cuh"
#include "math.cuh"
#include "mla_decode_hopper.cuh"
#include "mla_decode_kernel.cuh"
#include "non_finite.cuh"
#include "softmax.cuh"

namespace attnd::cuda::mla::hopper_wide {

using hopper::HopperWork;

inline constexpr int kWideTile = 64;  // keys per tile: the N of Q K^T, the K of P V
inline constexpr int kWideThreads = 384;
inline constexpr int kWideProducerRegisters = 56;
inline constexpr int kWideConsumerRegisters = 224;
static_assert(kWideProducerRegisters + 2 * kWideConsumerRegisters <= 512, "65536 registers per SM");
// Named barriers (0 is __syncthreads).
inline constexpr uint32_t kQBarrier = 1;       // both consumers, once Q is in shared memory
inline constexpr uint32_t kPFullBarrier = 2;   // scorer arrives, helper syncs: P_j is published
inline constexpr uint32_t kPEmptyBarrier = 3;  // helper arrives, scorer syncs: P_j was read
inline constexpr uint32_t kWarpgroupBarrier = 4;  // + consumer index: one consumer's 128 threads
inline constexpr uint32_t kProducerBarrier = 6;   // the producer's 128 threads (fp8 caches)
inline constexpr uint32_t kScorerBarrier = 7;     // the scorer's 128 threads: one choice for all

template <int kRankArg>
struct WideShape {
  static constexpr int kRank = kRankArg;
  static constexpr int kDim = kRank + kRopeDim;
  static constexpr int kBlocks = kDim / 64;         // 128-byte column blocks
  static constexpr int kChunks = kDim / 8;          // 16-byte chunks per row
  static constexpr int kRankChunks = kRank / 8;
  static constexpr int kSteps = kDim / 16;          // k-steps of Q K^T: 36 or 20
  static constexpr int kConsumerCols = kRank / 2;   // the N of P V: 256 or 128
  static constexpr int kStages = kRank == 512 ? 2 : 3;  // as many as shared memory holds
  static constexpr int kBlockBytes = kRows * 128;   // Q rows, a tile's keys and P: 64 rows each
  static constexpr int kKvBytes = kBlocks * kBlockBytes;
  static constexpr int kQOffset = 0;
  static constexpr int kKvOffset = kQOffset + kBlocks * kBlockBytes;
  static constexpr int kPOffset = kKvOffset + kStages * kKvBytes;
  static constexpr int kFactorOffset = kPOffset + kBlockBytes;
  static constexpr int kInverseOffset = kFactorOffset + kRows * 4;
  static constexpr int kBarrierOffset = kInverseOffset + kRows * 4;
  static constexpr int kPeerOffset = kBarrierOffset + 2 * kStages * 8;
  static constexpr int kSmemBytes = kPeerOffset + 8 + 1024;  // + alignment slack
  // fp8 caches: a tile's raw bytes, [kBlocks][64 rows][64 B], in the upper half of its stage.
  static constexpr int kRawBlockBytes = kRows * 64;
  static constexpr int kRawOffset = kKvBytes - kBlocks * kRawBlockBytes;
  // The epilogue stages 16-bit O row by row over Q, 16 bytes of padding a row so that a warp's
  // stores of 8 rows x 16 bytes hit distinct banks.
  static constexpr int kOutPitch = kRank * 2 + 16;
  static_assert(kRows * kOutPitch <= kKvOffset, "16-bit O staged over Q");
  static_assert(kWideTile == kRows, "one 8 KB block holds 64 rows of Q, the keys of a tile, or P");
  static_assert(kDim % 64 == 0 && kRank % 256 == 0, "shape");
  static_assert(kRopeDim == 64 && kRank % 64 == 0, "producer: whole 128-byte column blocks, kpe one of them");
  static_assert(kSmemBytes <= 227 * 1024, "shared memory of an SM");
};

// A stage's barriers: full (every producer thread's copies landed), empty (all 8 consumer warps
// released it); and the phase parity of the fill that brings `tile` into its stage.
template <typename Shape>
__device__ __forceinline__ uint32_t FullBarrier(uint32_t smem, int tile) {
  return smem + Shape::kBarrierOffset + 8 * (tile % Shape::kStages);
}

template <typename Shape>
__device__ __forceinline__ uint32_t EmptyBarrier(uint32_t smem, int tile) {
  return smem + Shape::kBarrierOffset + 8 * (Shape::kStages + tile % Shape::kStages);
}

template <typename Shape>
__device__ __forceinline__ uint32_t StagePhase(int tile) {
  return static_cast<uint32_t>((tile / Shape::kStages) & 1);
}

// A CTA's place in a cluster pair (MlaParams::cluster_pairs): `shared` where this CTA and the
// other of its cluster (rank ^ 1) compute the two 64-row halves of one request's rows over the
// same keys. Then each tile loaded by TMA is fetched once for both: each CTA's producer loads its
// share of the tile's 8 KB boxes into both CTAs' stage (multicast), every full barrier waits for
// the whole tile's bytes, and a stage is empty once the consumers of both CTAs released it (16
// arrivals), since the other CTA's producer writes it too. Tiles loaded by cp.async are each
// CTA's own.
struct ClusterPeer {
  bool shared = false;
  uint32_t rank = 0;  // this CTA's rank in the cluster
};

// fp8: expands a stage's raw tile (column-block-major at kRawOffset, see ProduceWide) into T in
// place as its commit groups land: group g < kRank / 128 is ckv line g (raw blocks 2g, 2g + 1),
// the last group kpe (the last block), so the expansion of the first blocks runs while the later
// ones still stream in. Thread t converts rows t / 4 + 32p (p = 0, 1), 16 values (bytes 16 (t % 4))
// of each raw block, to chunks 2 (t % 4) and + 1 of the row in the 128-byte swizzled layout (a
// warp reads 512 contiguous bytes and its stores hit every bank group four times). A block's
// output overlaps only raw blocks <= its own: a barrier of the producer's threads before the
// writes of each group that overlaps the raw region means none reads raw bytes already overwritten.
template <typename Shape, typename T>
__device__ __forceinline__ void ExpandFp8Stage(uint32_t stage) {
  constexpr int kGroups = Shape::kRank / 128 + 1;
  const int thread = threadIdx.x;  // 0..127
  const int piece = thread % 4;
#pragma unroll
  for (int group = 0; group < kGroups; ++group) {
    const int first_block = group < kGroups - 1 ? 2 * group : Shape::kBlocks - 1;
    const int blocks = group < kGroups - 1 ? 2 : 1;
    CpAsyncWaitPending(kGroups - 1 - group);
    NamedBarrierSync(kProducerBarrier, 128);  // every producer thread's copies of the group landed
    uint4 raw[2][2];
#pragma unroll
    for (int i = 0; i < blocks; ++i) {
#pragma unroll
      for (int p = 0; p < 2; ++p) {
        raw[i][p] = LoadShared16(stage + Shape::kRawOffset + (first_block + i) * Shape::kRawBlockBytes +
                                 (thread / 4 + 32 * p) * 64 + 16 * piece);
      }
    }
    if ((first_block + blocks) * Shape::kBlockBytes > Shape::kRawOffset) NamedBarrierSync(kProducerBarrier, 128);
#pragma unroll
    for (int i = 0; i < blocks; ++i) {
#pragma unroll
      for (int p = 0; p < 2; ++p) {
        const int row = thread / 4 + 32 * p;
        uint4 low, high;
        ConvertFp8x16<T, __nv_fp8_e4m3>(raw[i][p], low, high);
        const uint32_t row_base = stage + (first_block + i) * Shape::kBlockBytes + row * 128;
        StoreShared16(row_base + (((2 * piece) ^ (row % 8)) << 4), low);
        StoreShared16(row_base + (((2 * piece + 1) ^ (row % 8)) << 4), high);
      }
    }
  }
}

// Producer: thread t copies rows t / 8 + 16p (p = 0..3) of each tile, the 16-byte chunk t % 8
// of each of a row's 128-byte column blocks, so a warp instruction reads 4 whole 128-byte lines
// (one L2 request each; with 64 bytes of 8 rows an instruction made 8 requests of 2 sectors).
// Chunk c of block b of a row lands in block b at position c ^ (row % 8): the thread's rows
// share row % 8, so every copy of a row differs by an immediate.
//
// fp8 e4m3 caches (Stored 1 byte, T the MMA type): shared memory has no room for raw stages beside
// Q and two stages of T, so a tile's raw bytes land in the upper half of its own (released) stage,
// column-block-major ([kBlocks][64 rows][64 B]; ckv line L of a row, 128 values, is raw blocks 2L
// and 2L + 1; kpe is the last), and the producer expands them in place into T (ExpandFp8Stage).
// HBM then reads one byte a value.
template <typename Shape, typename T, typename Stored>
__device__ __forceinline__ void ProduceWide(const MlaParams& params, const HopperWork& work, const ClusterPeer& peer,
                                            uint32_t smem) {
  constexpr int kStages = Shape::kStages;
  constexpr int kStoredBytes = sizeof(Stored);
  constexpr bool kFp8 = kStoredBytes == 1;
  constexpr int kRowsPerThread = kWideTile / 16;
  constexpr int kRankBlocks = Shape::kRank / 64;
  const int thread = threadIdx.x;  // 0..127
  const int chunk = thread % 8;
  const int row0 = thread / 8;
  const uint32_t position = static_cast<uint32_t>(chunk ^ (row0 % 8)) << 4;
  const int page_mask = (1 << params.page_size_log2) - 1;
  for (int tile = 0; tile < work.num_tiles; ++tile) {
    const int stage = tile % kStages;
    const uint8_t* ckv[kRowsPerThread];
    const uint8_t* kpe[kRowsPerThread];
    uint32_t valid = 0;  // bit p: row row0 + 16p holds a key
    const int tile_start = work.kv_begin + tile * kWideTile;
#pragma unroll
    for (int p = 0; p < kRowsPerThread; ++p) valid |= tile_start + row0 + 16 * p < work.kv_end ? 1u << p : 0u;
    // Looked up before the wait, so the page ids' latency hides behind it. Where the tile's keys
    // lie in one page (pages of 64+ keys, mostly), one lookup per pool serves all four rows.
    const bool one_page =
        (tile_start >> params.page_size_log2) == ((tile_start + kWideTile - 1) >> params.page_size_log2);
    if constexpr (!kFp8) {
      // A whole tile inside one page: one thread loads it with TMA (nine 8 KB boxes at rank 512,
      // or its share of them into both CTAs of a shared pair), the others only arrive. Tiles that
      // end past the chunk (rows to zero-fill) or span pages take the copies below.
      if (params.tma && one_page && tile_start + kWideTile <= work.kv_end) {
        const int slot = work.page_begin + (tile_start >> params.page_size_log2);
        const int entry = tile_start & page_mask;
        const int ckv_row = (__ldg(params.ckv_page_ids + slot) << params.page_size_log2) + entry;
        const int kpe_row = (__ldg(params.kpe_page_ids + slot) << params.page_size_log2) + entry;
        MbarrierWait(EmptyBarrier<Shape>(smem, tile), StagePhase<Shape>(tile) ^ 1);
        const uint32_t full = FullBarrier<Shape>(smem, tile);
        if (thread == 0) {
          const uint32_t stage_base = smem + Shape::kKvOffset + stage * Shape::kKvBytes;
          MbarrierArriveExpectTx(full, Shape::kKvBytes);  // the whole tile, whoever loads it
          // Rank 0 of a shared pair loads boxes [0, kShareSplit), rank 1 the rest.
          constexpr int kShareSplit = (Shape::kBlocks + 1) / 2;
#pragma unroll
          for (int b = 0; b < Shape::kBlocks; ++b) {
            const void* map = b < kRankBlocks ? &params.ckv_map : &params.kpe_map;
            const int x = b < kRankBlocks ? 64 * b : 0;
            const int y = b < kRankBlocks ? ckv_row : kpe_row;
            const uint32_t box = stage_base + b * Shape::kBlockBytes;
            if (!peer.shared) {
              TmaLoad2d(box, map, x, y, full);
            } else if ((b < kShareSplit) == (peer.rank == 0)) {
              TmaLoad2dMulticast(box, map, x, y, full, 0b11);
            }
          }
        } else {
          MbarrierArrive(full);
        }
        continue;
      }
    }
    if (one_page) {
      const int slot = work.page_begin + (tile_start >> params.page_size_log2);
      const int64_t entry = (tile_start & page_mask) + row0;
      const uint8_t* ckv_row = params.ckv_pool + __ldg(params.ckv_page_ids + slot) * params.ckv_page_bytes +
                               entry * Shape::kRank * kStoredBytes + 16 * chunk;
      const uint8_t* kpe_row = params.kpe_pool + __ldg(params.kpe_page_ids + slot) * params.kpe_page_bytes +
                               entry * kRopeDim * kStoredBytes + 16 * chunk;
#pragma unroll
      for (int p = 0; p < kRowsPerThread; ++p) {
        ckv[p] = ckv_row + 16 * p * Shape::kRank * kStoredBytes;
        kpe[p] = kpe_row + 16 * p * kRopeDim * kStoredBytes;
      }
    } else {
#pragma unroll
      for (int p = 0; p < kRowsPerThread; ++p) {
        const int token = tile_start + row0 + 16 * p;
        ckv[p] = params.ckv_pool;
        kpe[p] = params.kpe_pool;
        if ((valid >> p) & 1u) {
          const int slot = work.page_begin + (token >> params.page_size_log2);
          const int64_t entry = token & page_mask;
          ckv[p] += __ldg(params.ckv_page_ids + slot) * params.ckv_page_bytes + entry * Shape::kRank * kStoredBytes +
                    16 * chunk;
          kpe[p] += __ldg(params.kpe_page_ids + slot) * params.kpe_page_bytes + entry * kRopeDim * kStoredBytes +
                    16 * chunk;
        }
      }
    }
    // Fill u of a stage waits for the consumers' release of fill u - 1.
    MbarrierWait(EmptyBarrier<Shape>(smem, tile), StagePhase<Shape>(tile) ^ 1);
    if constexpr (kFp8) {
      const uint32_t raw = smem + Shape::kKvOffset + stage * Shape::kKvBytes + Shape::kRawOffset + 16 * (chunk % 4);
      // One commit group per ckv line, then kpe (ExpandFp8Stage's order).
#pragma unroll
      for (int line = 0; line < Shape::kRank / 128; ++line) {
#pragma unroll
        for (int p = 0; p < kRowsPerThread; ++p) {
          CpAsync16(raw + (2 * line + chunk / 4) * Shape::kRawBlockBytes + (row0 + 16 * p) * 64, ckv[p] + 128 * line,
                    (valid >> p) & 1u);
        }
        CpAsyncCommit();
      }
      // kpe rows are 64 bytes: chunks 0..3 (the pointers of chunks 4..7 are not read).
      if (chunk < 4) {
#pragma unroll
        for (int p = 0; p < kRowsPerThread; ++p) {
          CpAsync16(raw + (Shape::kBlocks - 1) * Shape::kRawBlockBytes + (row0 + 16 * p) * 64, kpe[p], (valid >> p) & 1u);
        }
      }
      CpAsyncCommit();
      ExpandFp8Stage<Shape, T>(smem + Shape::kKvOffset + stage * Shape::kKvBytes);
      FenceProxyAsync();  // generic-proxy stores, read next by wgmma (the async proxy)
      MbarrierArrive(FullBarrier<Shape>(smem, tile));
    } else {
#pragma unroll
      for (int p = 0; p < kRowsPerThread; ++p) {
        const uint32_t row_base = smem + Shape::kKvOffset + stage * Shape::kKvBytes + (row0 + 16 * p) * 128 + position;
        const bool row_valid = (valid >> p) & 1u;
#pragma unroll
        for (int b = 0; b < Shape::kBlocks; ++b) {
          // Rows past the chunk are zero-filled: a zero V row keeps 0 * stale bytes from making NaN.
          // Their addresses stay inside the pools (the pool's start, or the tile's page), so the
          // copy takes them as they are, with a zero source size: no select per copy.
          CpAsync16(row_base + b * Shape::kBlockBytes,
                    b < kRankBlocks ? ckv[p] + 128 * b : kpe[p] + 128 * (b - kRankBlocks), row_valid);
        }
      }
      CpAsyncArriveNoinc(FullBarrier<Shape>(smem, tile));
    }
  }
}

// Q's 64 rows (zero past the request) into shared memory by both consumers' 256 threads. Where
// kpe_scale != ckv_scale, q_pe comes through registers times pe_ratio (rounded to T), as in the
// mma.sync kernel, so one score scale serves both parts of Q K^T.
template <typename Shape, typename T>
__device__ __forceinline__ void LoadQ(const MlaParams& params, const HopperWork& work, uint32_t smem) {
  const int index0 = threadIdx.x - 128;  // 0..255
  const uint16_t* q_nope = static_cast<const uint16_t*>(params.q_nope);
  const uint16_t* q_pe = static_cast<const uint16_t*>(params.q_pe);
  const int num_heads = params.num_heads;
  const bool scale_pe = params.pe_ratio != 1.0f;
  constexpr int kPasses = kRows * Shape::kChunks / 256;
  static_assert(kPasses * 256 == kRows * Shape::kChunks, "Q passes");
#pragma unroll
  for (int pass = 0; pass < kPasses; ++pass) {
    const int index = index0 + 256 * pass;
    const int row = index / Shape::kChunks;
    const int chunk = index % Shape::kChunks;
    const int global_row = work.row_begin + row;
    const bool valid = global_row < work.row_end;
    const uint16_t* source = q_nope;
    if (valid) {
      const int token = global_row / num_heads;
      const int64_t q_index = static_cast<int64_t>(work.q_row + token) * num_heads + (global_row - token * num_heads);
      source = chunk < Shape::kRankChunks ? q_nope + q_index * Shape::kRank + 8 * chunk
                                          : q_pe + q_index * kRopeDim + 8 * (chunk - Shape::kRankChunks);
    }
    const uint32_t destination =
        smem + Shape::kQOffset + (chunk / 8) * Shape::kBlockBytes + row * 128 + (((chunk % 8) ^ (row % 8)) << 4);
    if (scale_pe && chunk >= Shape::kRankChunks) {
      const uint4 raw = valid ? __ldg(reinterpret_cast<const uint4*>(source)) : make_uint4(0, 0, 0, 0);
      StoreShared16(destination, ConvertQ<T>(raw, std::is_same_v<T, __nv_bfloat16>, params.pe_ratio));
    } else {
      CpAsync16(destination, source, valid);
    }
  }
  CpAsyncWaitAll();
  FenceProxyAsync();  // generic-proxy writes, read next by wgmma (the async proxy)
  NamedBarrierSync(kQBarrier, 256);
}

// S = Q K^T over all kSteps k-steps; Q and K share one layout, so one offset moves both. Every
// offset is a compile-time constant (runtime offsets made the compiler keep advanced
// descriptors in registers).
template <typename Shape, typename T>
__device__ __forceinline__ void IssueScores(float (&s)[32], uint64_t q_descriptor, uint64_t k_descriptor) {
  WgmmaFence();
#pragma unroll
  for (int step = 0; step < Shape::kSteps; ++step) {
    const uint32_t bytes = (step / 4) * Shape::kBlockBytes + (step % 4) * 32;
    WgmmaSS<64, T>(s, AdvanceDescriptor(q_descriptor, bytes), AdvanceDescriptor(k_descriptor, bytes), step > 0 ? 1 : 0);
  }
  WgmmaCommit();
}

// What both consumers know of their rows: g and g + 8 of the warp's 16 (the wgmma accumulator
// layout), the same in both; and the query positions of the work's first and last rows, divided
// out once (per tile, two integer divisions sat on the scorer's path between Q K^T and P V).
struct WideRows {
  int position[2];
  bool valid[2];
  int first_position;
  int last_position;
};

// The consumer's V columns of a stage (MN-major: 64-column blocks kBlockBytes apart, 8-key
// atoms 1024 bytes apart).
template <typename Shape>
__device__ __forceinline__ uint64_t VDescriptor(uint32_t smem, int stage, int consumer) {
  return MatrixDescriptor(smem + Shape::kKvOffset + stage * Shape::kKvBytes +
                              consumer * (Shape::kConsumerCols / 64) * Shape::kBlockBytes,
                          Shape::kBlockBytes, 1024);
}

// In a tile where some row does not see some key, zeroes the non-finite values of this
// consumer's V columns once Q K^T of the tile is done: P V adds p = 0 times V for hidden keys,
// and 0 * NaN would make a row NaN that never saw the key. A non-finite ckv value makes the key's
// score non-finite for every row, so the rows that see it still come out NaN (softmax). Keys
// past kv_end are zero-filled already.
template <typename Shape, typename T>
__device__ __forceinline__ void ZeroNonFiniteV(const MlaParams& params, const HopperWork& work, const WideRows& rows,
                                               uint8_t* smem_generic, int tile, int consumer) {
  const int tile_start = work.kv_begin + tile * kWideTile;
  const bool hides_keys = (params.causal && min(tile_start + kWideTile, work.kv_end) - 1 > rows.first_position) ||
                          (params.window_left >= 0 && tile_start < rows.last_position - params.window_left);
  if (!hides_keys) return;
  constexpr uint32_t kExponent = kNonFiniteExponent2<T>;
  constexpr int kWords = (Shape::kConsumerCols / 64) * Shape::kBlockBytes / 16;
  uint4* v_words = reinterpret_cast<uint4*>(smem_generic + Shape::kKvOffset + (tile % Shape::kStages) * Shape::kKvBytes +
                                            consumer * (Shape::kConsumerCols / 64) * Shape::kBlockBytes);
  for (int i = threadIdx.x % 128; i < kWords; i += 128) {
    const uint4 bits = v_words[i];
    // 0xffff in each 16-bit half that is an inf or a NaN (exponent all ones).
    const uint32_t bad[4] = {__vcmpeq2(bits.x & kExponent, kExponent), __vcmpeq2(bits.y & kExponent, kExponent),
                             __vcmpeq2(bits.z & kExponent, kExponent), __vcmpeq2(bits.w & kExponent, kExponent)};
    if ((bad[0] | bad[1] | bad[2] | bad[3]) != 0) {
      v_words[i] = make_uint4(bits.x & ~bad[0], bits.y & ~bad[1], bits.z & ~bad[2], bits.w & ~bad[3]);
    }
  }
  FenceProxyAsync();  // generic-proxy writes, read next by wgmma (the async proxy)
  NamedBarrierSync(kWarpgroupBarrier + consumer, 128);
}

// ClusterPeer::shared, as the kernel's start stored it in shared memory.
template <typename Shape>
__device__ __forceinline__ bool SharesTiles(uint32_t smem) {
  uint32_t shared;
  asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(shared) : "r"(smem + Shape::kPeerOffset) : "memory");
  return shared != 0;
}

// Releases a stage once this warp's wgmma reads of it completed (8 arrivals empty it), in the
// other CTA of a shared pair too (whose producer writes this CTA's stage as well).
template <typename Shape>
__device__ __forceinline__ void Release(uint32_t smem, int tile) {
  __syncwarp();
  if (threadIdx.x % 32 == 0) {
    const uint32_t empty = EmptyBarrier<Shape>(smem, tile);
    MbarrierArrive(empty);
    if (SharesTiles<Shape>(smem)) MbarrierArriveRemote(empty, ClusterCtaRank() ^ 1);
  }
}

template <typename Shape>
__device__ __forceinline__ void WaitFull(uint32_t smem, int tile) {
  MbarrierWait(FullBarrier<Shape>(smem, tile), StagePhase<Shape>(tile));
  FenceProxyAsync();
}

// Multiplies the accumulator rows by their factors (rows g: i / 2 even; g + 8: odd), unless no
// row of the warp moved, as most tiles once the running maxima settle.
template <int kCount>
__device__ __forceinline__ void RescaleRows(float (&o)[kCount], const float (&factor)[2]) {
  if (__any_sync(0xffffffffu, factor[0] != 1.0f || factor[1] != 1.0f)) {
#pragma unroll
    for (int i = 0; i < kCount; ++i) o[i] *= factor[(i / 2) % 2];
  }
}

// Warpgroup 1: S, softmax, P; O_0. Leaves inverse = o_scale / sum (0 for a row that saw no key)
// and lse (natural log) of the thread's rows, and the inverses in shared memory for the helper.
template <typename Shape, typename T>
__device__ __forceinline__ void Score(const MlaParams& params, const HopperWork& work, const WideRows& rows,
                                      uint32_t smem, uint8_t* smem_generic, float (&o)[Shape::kConsumerCols / 2],
                                      float (&inverse)[2], float (&lse)[2]) {
  const int thread = threadIdx.x % 128;
  const int warp = thread / 32;
  const int lane = thread % 32;
  const bool soft_cap = params.cap_log2 > 0.0f;
  const float scale_log2 = soft_cap ? 1.0f : params.score_scale_log2;
  float* const factors = reinterpret_cast<float*>(smem_generic + Shape::kFactorOffset);
  uint8_t* const p_shared = smem_generic + Shape::kPOffset;

  float row_max[2] = {-INFINITY, -INFINITY};
  float row_sum[2] = {0.0f, 0.0f};
  float rescale[2] = {1.0f, 1.0f};
  float s[32];
#pragma unroll
  for (int i = 0; i < 32; ++i) s[i] = 0.0f;
  uint32_t p[4][4];  // P of the tile: the A operand of four m64nNk16 steps of 16 keys

  const uint64_t q_descriptor = MatrixDescriptor(smem + Shape::kQOffset, 16, 1024);
  auto issue_scores = [&](int tile) {
    const uint64_t k_descriptor =
        MatrixDescriptor(smem + Shape::kKvOffset + (tile % Shape::kStages) * Shape::kKvBytes, 16, 1024);
    IssueScores<Shape, T>(s, q_descriptor, k_descriptor);
  };
  auto issue_pv = [&](int tile) {
    const uint64_t v_descriptor = VDescriptor<Shape>(smem, tile % Shape::kStages, 0);
    WgmmaFence();
#pragma unroll
    for (int step = 0; step < kWideTile / 16; ++step) {
      WgmmaRS<Shape::kConsumerCols, T>(o, p[step], AdvanceDescriptor(v_descriptor, step * 16 * 128));
    }
    WgmmaCommit();
  };
  // s[4j + e]: rows g (e < 2) and g + 8, keys 8j + 2 (lane % 4) + e % 2 of the tile.
  auto softmax = [&](int tile) {
    const int tile_start = work.kv_begin + tile * kWideTile;
    // Non-finite inputs make a score NaN or +-inf: s * 0 + s turns both into NaN (finite s
    // unchanged) before the cap could make inf finite or -inf could read as masked. A NaN p
    // makes the row's sum NaN: o and lse come out NaN (NaN in, NaN out).
#pragma unroll
    for (int i = 0; i < 32; ++i) s[i] = fmaf(s[i], 0.0f, s[i]);
    if (soft_cap) {
#pragma unroll
      for (int i = 0; i < 32; ++i) s[i] = SoftCapLog2(s[i], params.cap_input_scale, params.cap_log2);
    }
    // Most tiles show every key to both rows: the per-key mask is skipped there (it sits on the
    // path between Q K^T and P V, where the tensor cores wait).
    const bool all_visible = rows.valid[0] && rows.valid[1] && tile_start + kWideTile <= work.kv_end &&
                             (!params.causal || tile_start + kWideTile - 1 <= min(rows.position[0], rows.position[1])) &&
                             (params.window_left < 0 ||
                              tile_start >= max(rows.position[0], rows.position[1]) - params.window_left);
    if (!all_visible) {
#pragma unroll
      for (int j = 0; j < 8; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int key = tile_start + 8 * j + 2 * (lane % 4) + (e % 2);
          const int position = rows.position[e / 2];
          const bool visible = rows.valid[e / 2] && key < work.kv_end && (!params.causal || key <= position) &&
                               (params.window_left < 0 || key >= position - params.window_left);
          if (!visible) s[4 * j + e] = -INFINITY;
        }
      }
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float tile_max = -INFINITY;
#pragma unroll
      for (int j = 0; j < 8; ++j) tile_max = fmaxf(tile_max, fmaxf(s[4 * j + 2 * h], s[4 * j + 2 * h + 1]));
      tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
      tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
      const float new_max = fmaxf(row_max[h], tile_max * scale_log2);
      // A row with no visible key yet keeps m = -inf; subtract 0 so exp2 gives 0, not NaN, and
      // its (zero) O needs no rescale.
      const float subtract = new_max == -INFINITY ? 0.0f : new_max;
      rescale[h] = new_max == -INFINITY ? 1.0f : FastExp2(row_max[h] - subtract);
      row_max[h] = new_max;
      float sum = 0.0f;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const float p0 = FastExp2(fmaf(s[4 * j + 2 * h], scale_log2, -subtract));
        const float p1 = FastExp2(fmaf(s[4 * j + 2 * h + 1], scale_log2, -subtract));
        s[4 * j + 2 * h] = p0;
        s[4 * j + 2 * h + 1] = p1;
        sum += p0 + p1;
      }
      row_sum[h] = row_sum[h] * rescale[h] + sum;
    }
  };
  // p[step][i]: keys 16 step + 8 (i / 2) + 2 (lane % 4) + {0, 1} of row g (i even) or g + 8.
  auto convert_p = [&] {
#pragma unroll
    for (int step = 0; step < 4; ++step) {
#pragma unroll
      for (int i = 0; i < 4; ++i) p[step][i] = PackFloat2<T>(s[8 * step + 2 * i], s[8 * step + 2 * i + 1]);
    }
  };
  // P to shared memory, K-major and swizzled like Q: row r's keys 8j.. are 16-byte chunk j at
  // position j ^ (r % 8) (r % 8 = lane / 4), so a warp's stores hit 32 distinct banks. Then the
  // rows' rescale factors, and the handoff.
  auto publish = [&] {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = 16 * warp + 8 * h + lane / 4;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        *reinterpret_cast<uint32_t*>(p_shared + row * 128 + ((j ^ (lane / 4)) << 4) + 4 * (lane % 4)) =
            p[j / 2][2 * (j % 2) + h];
      }
      if (lane % 4 == 0) factors[row] = rescale[h];
    }
    FenceProxyAsync();  // generic-proxy writes, read next by the helper's wgmma
    NamedBarrierArrive(kPFullBarrier, 256);
  };
  auto fence_p = [&] {
#pragma unroll
    for (int step = 0; step < 4; ++step) {
#pragma unroll
      for (int i = 0; i < 4; ++i) FenceRegister(p[step][i]);
    }
  };

  const int n = work.num_tiles;
  if (n > 0) {
    auto release_previous = [&](int tile) {
      FenceRegisters(o);
      fence_p();
      Release<Shape>(smem, tile - 1);
    };
    for (int tile = 0; tile < n; ++tile) {
      // Stage j - 1 goes back to the producer once P_{j-1} V_0 completed. Where tile j has landed,
      // Q K_j^T is issued first and queues behind that product. Where it has not, the release
      // comes first: held until tile j lands, it would delay the load of tile j + 1 by as long.
      // The four warps take one branch (a barrier's vote: landed for all of them), since a wgmma
      // instruction must be the same one in every warp of the warpgroup (synccheck flagged warps
      // that had seen the tile land at different times).
      if (tile > 0 && !NamedBarrierAll(kScorerBarrier, 128, MbarrierTest(FullBarrier<Shape>(smem, tile),
                                                                         StagePhase<Shape>(tile)))) {
        WgmmaWait<0>();
        release_previous(tile);
        WaitFull<Shape>(smem, tile);
        issue_scores(tile);
      } else {
        WaitFull<Shape>(smem, tile);
        issue_scores(tile);
        if (tile > 0) {
          WgmmaWait<1>();  // P_{j-1} V_0 has completed; Q K_j^T may still run
          release_previous(tile);
        }
      }
      WgmmaWait<0>();
      FenceRegisters(s);
      softmax(tile);
      convert_p();
      if (tile > 0) NamedBarrierSync(kPEmptyBarrier, 256);  // the helper's P_{j-1} V_1 completed
      publish();
      ZeroNonFiniteV<Shape, T>(params, work, rows, smem_generic, tile, 0);
      RescaleRows(o, rescale);  // by this tile's factor, before P_j V_j adds to O
      issue_pv(tile);
    }
    WgmmaWait<0>();
    release_previous(n);
    NamedBarrierSync(kPEmptyBarrier, 256);  // the helper's last arrival: every one is matched
  }

  // Row sums over the quad (fixed pairing); the helper gets the inverses through shared memory.
  float* const inverses = reinterpret_cast<float*>(smem_generic + Shape::kInverseOffset);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    row_sum[h] += __shfl_xor_sync(0xffffffffu, row_sum[h], 1);
    row_sum[h] += __shfl_xor_sync(0xffffffffu, row_sum[h], 2);
    // A row that saw no key has sum 0 and o 0: it stores 0 and lse = -inf. A NaN sum (a
    // non-finite input it saw) stores NaN in o and lse.
    inverse[h] = row_sum[h] != 0.0f ? params.o_scale / row_sum[h] : 0.0f;
    lse[h] = row_sum[h] != 0.0f ? (row_max[h] + log2f(row_sum[h])) * kLn2 : -INFINITY;
    if (lane % 4 == 0) inverses[16 * warp + 8 * h + lane / 4] = inverse[h];
  }
  NamedBarrierArrive(kPFullBarrier, 256);
}

// Warpgroup 2: O_1 from the published P and factors. Leaves the rows' inverses.
template <typename Shape, typename T>
__device__ __forceinline__ void Help(const MlaParams& params, const HopperWork& work, const WideRows& rows, uint32_t smem,
                                     uint8_t* smem_generic, float (&o)[Shape::kConsumerCols / 2], float (&inverse)[2]) {
  const int thread = threadIdx.x % 128;
  const int row0 = 16 * (thread / 32) + (thread % 32) / 4;
  const float* const factors = reinterpret_cast<const float*>(smem_generic + Shape::kFactorOffset);
  const uint64_t p_descriptor = MatrixDescriptor(smem + Shape::kPOffset, 16, 1024);
  for (int tile = 0; tile < work.num_tiles; ++tile) {
    NamedBarrierSync(kPFullBarrier, 256);  // P_j and its factors are published; Q K_j^T is done
    WaitFull<Shape>(smem, tile);           // completed already: makes the stage's bytes visible here
    const float factor[2] = {factors[row0], factors[row0 + 8]};
    RescaleRows(o, factor);
    ZeroNonFiniteV<Shape, T>(params, work, rows, smem_generic, tile, 1);
    const uint64_t v_descriptor = VDescriptor<Shape>(smem, tile % Shape::kStages, 1);
    WgmmaFence();
#pragma unroll
    for (int step = 0; step < kWideTile / 16; ++step) {
      WgmmaSSTransposedB<Shape::kConsumerCols, T>(o, AdvanceDescriptor(p_descriptor, step * 32),
                                                  AdvanceDescriptor(v_descriptor, step * 16 * 128), 1);
    }
    WgmmaCommit();
    WgmmaWait<0>();
    FenceRegisters(o);
    NamedBarrierArrive(kPEmptyBarrier, 256);
    Release<Shape>(smem, tile);
  }
  NamedBarrierSync(kPFullBarrier, 256);  // the inverses
  const float* const inverses = reinterpret_cast<const float*>(smem_generic + Shape::kInverseOffset);
  inverse[0] = inverses[row0];
  inverse[1] = inverses[row0 + 8];
}

template <typename Shape, typename T>
__device__ __forceinline__ void ConsumeWide(const MlaParams& params, const HopperWork& work, uint32_t smem,
                                            uint8_t* smem_generic) {
  constexpr int kRank = Shape::kRank;
  const int consumer = threadIdx.x / 128 - 1;
  const int thread = threadIdx.x % 128;
  const int warp = thread / 32;
  const int lane = thread % 32;
  const int num_heads = params.num_heads;

  LoadQ<Shape, T>(params, work, smem);
  WideRows rows;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int global_row = work.row_begin + 16 * warp + 8 * h + lane / 4;
    rows.valid[h] = global_row < work.row_end;
    rows.position[h] = work.position_offset + global_row / num_heads;
  }
  rows.first_position = work.position_offset + work.row_begin / num_heads;
  rows.last_position = work.position_offset + (work.row_end - 1) / num_heads;

  // o[4j + e]: rows g (e < 2) and g + 8, columns 8j + 2 (lane % 4) + e % 2 of the consumer's.
  float o[Shape::kConsumerCols / 2];
#pragma unroll
  for (int i = 0; i < Shape::kConsumerCols / 2; ++i) o[i] = 0.0f;
  float inverse[2];
  float lse[2] = {0.0f, 0.0f};
  if (consumer == 0) {
    Score<Shape, T>(params, work, rows, smem, smem_generic, o, inverse, lse);
  } else {
    Help<Shape, T>(params, work, rows, smem, smem_generic, o, inverse);
  }

  // --- Epilogue: normalise and store this consumer's columns; the scorer stores lse.
  // fp32 partials for MergeStates: straight from the accumulators (a warp's float2 stores fill
  // whole 32-byte sectors of its 8 rows).
  if (work.partial_first >= 0) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      if (!rows.valid[h]) continue;
      const int global_row = work.row_begin + 16 * warp + 8 * h + lane / 4;
      const int token = global_row / num_heads;
      const int head = global_row - token * num_heads;
      const int64_t slot = work.partial_first + static_cast<int64_t>(token) * work.partial_stride;
      const int64_t partial_row = slot * num_heads + head;
      float* out = params.partial_o + partial_row * kRank + consumer * Shape::kConsumerCols + 2 * (lane % 4);
#pragma unroll
      for (int j = 0; j < Shape::kConsumerCols / 8; ++j) {
        *reinterpret_cast<float2*>(out + 8 * j) =
            make_float2(o[4 * j + 2 * h] * inverse[h], o[4 * j + 2 * h + 1] * inverse[h]);
      }
      if (consumer == 0 && lane % 4 == 0) params.partial_lse[partial_row] = lse[h];
    }
    return;
  }
  // o of the MMA type: its 4-byte pairs would fill half sectors, so the columns are staged in
  // shared memory and stored as whole 16-byte chunks, a warp writing 512 contiguous bytes of a
  // row. The staging overwrites Q, which only the scorer's Q K^T reads: the scorer's last one
  // completed before its last softmax, and the helper got here through the barrier the scorer
  // arrived at after that (the inverses), so no read of Q is left.
  const bool bf16 = params.o_bf16;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = 16 * warp + 8 * h + lane / 4;
    const int column = consumer * Shape::kConsumerCols + 2 * (lane % 4);
    uint8_t* const staged = smem_generic + Shape::kQOffset + row * Shape::kOutPitch + 2 * column;
#pragma unroll
    for (int j = 0; j < Shape::kConsumerCols / 8; ++j) {
      *reinterpret_cast<uint32_t*>(staged + 16 * j) =
          PackOut(o[4 * j + 2 * h] * inverse[h], o[4 * j + 2 * h + 1] * inverse[h], bf16);
    }
    if (consumer == 0 && lane % 4 == 0 && rows.valid[h] && params.lse != nullptr) {
      const int global_row = work.row_begin + row;
      const int token = global_row / num_heads;
      params.lse[static_cast<int64_t>(work.q_row + token) * num_heads + (global_row - token * num_heads)] = lse[h];
    }
  }
  NamedBarrierSync(kWarpgroupBarrier + consumer, 128);
  constexpr int kRowChunks = Shape::kConsumerCols * 2 / 16;  // 16-byte chunks of a row's columns
  const int rows_here = work.row_end - work.row_begin;
  for (int index = thread; index < kRows * kRowChunks; index += 128) {
    const int row = index / kRowChunks;
    if (row >= rows_here) break;  // rows grow with index: the rest are past the request
    const int column_byte = consumer * Shape::kConsumerCols * 2 + 16 * (index % kRowChunks);
    const int global_row = work.row_begin + row;
    const int token = global_row / num_heads;
    const int64_t out_row = static_cast<int64_t>(work.q_row + token) * num_heads + (global_row - token * num_heads);
    *reinterpret_cast<uint4*>(static_cast<uint8_t*>(params.o) + out_row * kRank * 2 + column_byte) =
        *reinterpret_cast<const uint4*>(smem_generic + Shape::kQOffset + row * Shape::kOutPitch + column_byte);
  }
}

// T: q's type, which the tensor cores multiply in; Stored: the cache's (T or fp8 e4m3).
template <int kRank, typename T, typename Stored>
__global__ void __launch_bounds__(kWideThreads, 1) MlaDecodeHopperWideKernel(const __grid_constant__ MlaParams params) {
  using Shape = WideShape<kRank>;
  extern __shared__ __align__(1024) uint8_t shared_bytes[];
  HopperWork work;
  const bool active = hopper::LoadHopperWork<kWideTile>(params, blockIdx.x, &work);
  // Launched in clusters of two (ranks blockIdx.x % 2): the pair shares its tiles where both
  // units cover the same keys of one request. Both CTAs decide from the same two units.
  ClusterPeer peer;
  if constexpr (std::is_same_v<Stored, T>) {
    if (params.cluster_pairs) {
      HopperWork other;
      const bool other_active = hopper::LoadHopperWork<kWideTile>(params, blockIdx.x ^ 1, &other);
      peer.shared = active && other_active && work.num_tiles > 0 && other.request == work.request &&
                    other.kv_begin == work.kv_begin && other.kv_end == work.kv_end;
      peer.rank = ClusterCtaRank();
    }
  }
  if (!active) return;  // a placeholder unit: nothing to do (its partner does not share)
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif

  // The swizzle phase follows address bits 7-9, so every block must sit on a 1024-byte boundary.
  const uint32_t raw = SharedAddress(shared_bytes);
  const uint32_t smem = (raw + 1023) & ~1023u;
  uint8_t* smem_generic = shared_bytes + (smem - raw);
  if (threadIdx.x == 0) *reinterpret_cast<uint32_t*>(smem_generic + Shape::kPeerOffset) = peer.shared ? 1 : 0;
  hopper::InitStageBarriers<Shape::kStages>(smem + Shape::kBarrierOffset, peer.shared ? 16 : 8);
  if (peer.shared) {  // the other CTA's barriers are set up before any multicast or remote arrival
    ClusterArrive();
    ClusterWait();
  }
  // The role is uniform per warpgroup; the shuffle lets the compiler see that.
  const int warpgroup = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x / 128), 0);
  if (warpgroup == 0) {
    ReleaseRegisters<kWideProducerRegisters>();
    static_assert(std::is_same_v<Stored, T> || std::is_same_v<Stored, __nv_fp8_e4m3>, "caches of q's type or fp8");
    ProduceWide<Shape, T, Stored>(params, work, peer, smem);
    CpAsyncWaitAll();
  } else {
    ClaimRegisters<kWideConsumerRegisters>();
    ConsumeWide<Shape, T>(params, work, smem, smem_generic);
  }
  // Neither CTA of a shared pair exits while the other may still arrive on its barriers.
  if (SharesTiles<Shape>(smem)) {
    ClusterArrive();
    ClusterWait();
  }
}

// params.cluster_pairs (16-bit caches only): launched in clusters of two CTAs (num_ctas even),
// and with ctas_per_sm non-null, *ctas_per_sm is set to the clusters the device runs at once.
template <int kRank, typename T, typename Stored>
cudaError_t LaunchMlaHopperWide(const MlaParams& params, int32_t num_ctas, cudaStream_t stream, int* ctas_per_sm) {
  return hopper::LaunchOrMeasure(&MlaDecodeHopperWideKernel<kRank, T, Stored>, kWideThreads,
                                 WideShape<kRank>::kSmemBytes, params, num_ctas, stream, ctas_per_sm,
                                 params.cluster_pairs && std::is_same_v<Stored, T>);
}

// The rank (512 or 256) and q's type (bf16 when `bf16`, else fp16) of one cache type: Fp8 =
// __nv_fp8_e4m3, or void for caches of q's own type. Each .cu instantiates one cache kind.
template <typename Fp8>
cudaError_t LaunchMlaHopperWideFor(const MlaParams& params, int32_t rank, bool bf16, int32_t num_ctas,
                                   cudaStream_t stream, int* ctas_per_sm) {
  using Bf16Cache = std::conditional_t<std::is_void_v<Fp8>, __nv_bfloat16, Fp8>;
  using HalfCache = std::conditional_t<std::is_void_v<Fp8>, __half, Fp8>;
  if (rank == 512) {
    return bf16 ? LaunchMlaHopperWide<512, __nv_bfloat16, Bf16Cache>(params, num_ctas, stream, ctas_per_sm)
                : LaunchMlaHopperWide<512, __half, HalfCache>(params, num_ctas, stream, ctas_per_sm);
  }
  return bf16 ? LaunchMlaHopperWide<256, __nv_bfloat16, Bf16Cache>(params, num_ctas, stream, ctas_per_sm)
              : LaunchMlaHopperWide<256, __half, HalfCache>(params, num_ctas, stream, ctas_per_sm);
}

}  // namespace attnd::cuda::mla::hopper_wide
