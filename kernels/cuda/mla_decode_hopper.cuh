// MLA decode on Hopper (sm_90a), DESIGN 4.6: the kernel template. Same units, masks, outputs and
// partials as the mma.sync kernel (mla_decode_kernel.cuh): a CTA computes 64 rows (query token,
// head) of one request against one chunk of its latent keys, in tiles of 32 keys. For caches of
// q's 16-bit type with kpe_scale == ckv_scale (the launcher checks).
//
// Warp specialisation, three warpgroups:
//   producer (warpgroup 0, 56 registers): cp.async of each tile's ckv and kpe rows through the
//     page table into a ring of kStages stages (rows past the chunk zero-filled); a stage is full
//     when every producer thread's copies landed, empty when all 8 consumer warps released it.
//   consumers (warpgroups 1 and 2, 224 registers). Consumer c owns output columns
//     [c * rank / 2, (c + 1) * rank / 2) of all 64 rows (O: 128 fp32 per thread at rank 512) and
//     k-steps [c * D / 32, (c + 1) * D / 32) of S = Q K^T (D = rank + 64; split-K, wgmma
//     m64n32k16, Q and K from shared memory). The two partial S swap through shared memory (one
//     named barrier per tile); both add them in the same order (s0 + s1), so both hold the same
//     S, run the same online softmax and get the same P (registers) and row statistics. Then
//     O_c += P V_c (wgmma m64n128k16, P from registers, V = the tile's ckv columns of consumer c,
//     transposed from shared memory). Q K^T of tile j is issued together with P V of tile j-1.
//
// Shared memory (1024-byte aligned blocks, 128-byte swizzle, see hopper_ptx.cuh):
//   Q   [D/64 blocks][64 rows][128 B]
//   KV  [kStages][D/64 blocks][32 rows][128 B]   ckv in blocks 0..rank/64-1, kpe in the last
//   X   [2 tiles][2 consumers][4][128 threads] float4: the partial S exchange
//   mbarriers: full, empty per stage.
#pragma once

#include <cstdint>
#include <type_traits>

#include "hopper_ptx.cuh"
#include "math.cuh"
#include "mla_decode_kernel.cuh"
#include "non_finite.cuh"
#include "softmax.cuh"

namespace attnd::cuda::mla::hopper {

inline constexpr int kHopperThreads = 384;
inline constexpr int kHopperStages = 3;
inline constexpr int kProducerRegisters = 56;
inline constexpr int kConsumerRegisters = 224;
static_assert(kProducerRegisters + 2 * kConsumerRegisters <= 512, "65536 registers per SM");
inline constexpr uint32_t kConsumersBarrier = 1;  // named barrier of the 256 consumer threads
inline constexpr uint32_t kConsumerBarrier = 2;   // + consumer index: one consumer's 128 threads

template <int kRankArg>
struct HopperShape {
  static constexpr int kRank = kRankArg;
  static constexpr int kDim = kRank + kRopeDim;
  static constexpr int kBlocks = kDim / 64;        // 128-byte column blocks
  static constexpr int kChunks = kDim / 8;         // 16-byte chunks per row
  static constexpr int kRankChunks = kRank / 8;
  static constexpr int kHalfSteps = kDim / 16 / 2;  // k-steps of one consumer: 18 or 10
  static constexpr int kConsumerCols = kRank / 2;   // 256 or 128
  static constexpr int kHalves = kConsumerCols / 128;  // m64n128 accumulators per consumer
  static constexpr int kQBlockBytes = kRows * 128;
  static constexpr int kKvBlockBytes = kTile * 128;
  static constexpr int kKvBytes = kBlocks * kKvBlockBytes;
  static constexpr int kXBytes = kRows * kTile * 4;  // one partial S
  static constexpr int kQOffset = 0;
  static constexpr int kKvOffset = kQOffset + kBlocks * kQBlockBytes;
  static constexpr int kXOffset = kKvOffset + kHopperStages * kKvBytes;
  static constexpr int kBarrierOffset = kXOffset + 4 * kXBytes;
  static constexpr int kSmemBytes = kBarrierOffset + 2 * kHopperStages * 8 + 1024;  // + alignment slack
  static_assert(kDim % 64 == 0 && kRank % 256 == 0, "shape");
  static_assert(kChunks % 4 == 0 && kRankChunks % 4 == 0, "producer: 4 threads per row");
};

template <typename T>
__device__ __forceinline__ void WgmmaSS32(float (&d)[16], uint64_t a, uint64_t b, int accumulate);

#define ATTND_MLA_WGMMA_SS32(TYPE, PTX_TYPE)                                                               \
  template <>                                                                                             \
  __device__ __forceinline__ void WgmmaSS32<TYPE>(float(&d)[16], uint64_t a, uint64_t b, int accumulate) { \
    asm volatile(                                                                                         \
        "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"                                                      \
        "wgmma.mma_async.sync.aligned.m64n32k16.f32." PTX_TYPE "." PTX_TYPE                               \
        " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, %16, %17, p, 1, 1, 0, 0;\n}\n" \
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),  \
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]),          \
          "+f"(d[15])                                                                                     \
        : "l"(a), "l"(b), "r"(accumulate)                                                                 \
        : "memory");                                                                                      \
  }
ATTND_MLA_WGMMA_SS32(__nv_bfloat16, "bf16")
ATTND_MLA_WGMMA_SS32(__half, "f16")
#undef ATTND_MLA_WGMMA_SS32

// The unit of this CTA, decoded the same way in every thread.
struct HopperWork {
  int request;
  int q_row;
  int row_begin;
  int row_end;
  int position_offset;  // kv_len - q_len: query token i sits at key position offset + i
  int kv_begin;
  int kv_end;
  int num_tiles;
  int partial_first;
  int partial_stride;
  int page_begin;
};

// Both Hopper MLA kernels: thread 0 sets up each stage's full barrier (the 128 producer
// threads arrive) and empty barrier (the consumer warps arrive: this CTA's 8, or 16 where a
// cluster pair shares the stages), then the CTA syncs.
template <int kStages>
__device__ __forceinline__ void InitStageBarriers(uint32_t barriers, uint32_t empty_arrivals = 8) {
  if (threadIdx.x == 0) {
    for (int stage = 0; stage < kStages; ++stage) {
      MbarrierInit(barriers + 8 * stage, 128);                         // full: producer threads
      MbarrierInit(barriers + 8 * (kStages + stage), empty_arrivals);  // empty: consumer warps
    }
    FenceMbarrierInit();
  }
  __syncthreads();
}

// Both Hopper MLA kernels' launchers: sets the kernel's dynamic shared memory, then reports its
// occupancy (ctas_per_sm non-null) or launches it. pairs: in clusters of two CTAs (num_ctas
// even); the occupancy reported is then the clusters of two the device holds at once.
template <typename Kernel>
cudaError_t LaunchOrMeasure(Kernel* kernel, int threads, int smem_bytes, const MlaParams& params,
                            int32_t num_ctas, cudaStream_t stream, int* ctas_per_sm, bool pairs = false) {
  cudaError_t error =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes);
  if (error != cudaSuccess) return error;
  if (!pairs) {
    if (ctas_per_sm != nullptr) {
      return cudaOccupancyMaxActiveBlocksPerMultiprocessor(ctas_per_sm, kernel, threads, smem_bytes);
    }
    kernel<<<num_ctas, threads, smem_bytes, stream>>>(params);
    return cudaGetLastError();
  }
  cudaLaunchAttribute cluster;
  cluster.id = cudaLaunchAttributeClusterDimension;
  cluster.val.clusterDim.x = 2;
  cluster.val.clusterDim.y = 1;
  cluster.val.clusterDim.z = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(ctas_per_sm != nullptr ? 2 : num_ctas);
  config.blockDim = dim3(threads);
  config.dynamicSmemBytes = smem_bytes;
  config.stream = stream;
  config.attrs = &cluster;
  config.numAttrs = 1;
  if (ctas_per_sm != nullptr) return cudaOccupancyMaxActiveClusters(ctas_per_sm, kernel, &config);
  return cudaLaunchKernelEx(&config, kernel, params);
}

// Decodes plan unit `unit` (plan::MlaWorkUnit; a CTA's own is blockIdx.x) for tiles of kTileKeys
// keys, with the causal and window limits applied to the key range; false for a placeholder unit
// (nothing to do). Shared by the Hopper kernels (mla_decode_hopper_wide.cuh too), so they cut
// units the same way.
template <int kTileKeys>
__device__ __forceinline__ bool LoadHopperWork(const MlaParams& params, int unit, HopperWork* work) {
  const int4* const unit_words = reinterpret_cast<const int4*>(params.units + unit);
  const int4 w0 = unit_words[0];
  const int4 w1 = unit_words[1];
  const int4 w2 = unit_words[2];
  if (w0.x < 0) return false;
  work->request = w0.x;
  work->q_row = w0.y;
  const int q_len = w0.z;
  const int kv_len = w0.w;
  work->row_begin = w1.x;
  work->partial_first = w1.w;
  work->partial_stride = w2.x;
  const int num_heads = params.num_heads;
  work->row_end = min(work->row_begin + kRows, q_len * num_heads);
  work->position_offset = kv_len - q_len;
  const int first_position = work->position_offset + work->row_begin / num_heads;
  const int last_position = work->position_offset + (work->row_end - 1) / num_heads;
  work->kv_begin = w1.y;
  work->kv_end = w1.z;
  if (params.causal) work->kv_end = min(work->kv_end, last_position + 1);
  if (params.window_left >= 0) work->kv_begin = max(work->kv_begin, first_position - params.window_left);
  work->num_tiles = work->kv_end > work->kv_begin ? (work->kv_end - work->kv_begin + kTileKeys - 1) / kTileKeys : 0;
  work->page_begin = params.page_indptr[work->request];
  return true;
}

// Producer: thread t copies row t / 4 of each tile, chunks t % 4 + 4k (k = 0..kChunks/4-1), so a
// warp instruction moves 64 contiguous bytes of each of 8 rows. Chunk c of a row lands in block
// c / 8 at position (c % 8) ^ (row % 8): for c = t % 4 + 4k that is block k / 2, position
// 4 (k % 2) XOR the thread's (t % 4) ^ (row % 8).
template <typename Shape>
__device__ __forceinline__ void Produce(const MlaParams& params, const HopperWork& work, uint32_t smem) {
  const int thread = threadIdx.x;  // 0..127
  const int row = thread / 4;
  const int quarter = thread % 4;
  const uint32_t row_swizzle = static_cast<uint32_t>(quarter ^ (row % 8));
  const int page_mask = (1 << params.page_size_log2) - 1;
  const uint32_t barriers = smem + Shape::kBarrierOffset;
  constexpr int kStoredBytes = 2;
  for (int tile = 0; tile < work.num_tiles; ++tile) {
    const int stage = tile % kHopperStages;
    const int token = work.kv_begin + tile * kTile + row;
    const bool valid = token < work.kv_end;
    const uint8_t* ckv = params.ckv_pool;
    const uint8_t* kpe = params.kpe_pool;
    if (valid) {
      // Looked up before the wait, so the page ids' latency hides behind it.
      const int slot = work.page_begin + (token >> params.page_size_log2);
      const int64_t entry = token & page_mask;
      ckv += __ldg(params.ckv_page_ids + slot) * params.ckv_page_bytes + entry * Shape::kRank * kStoredBytes;
      kpe += __ldg(params.kpe_page_ids + slot) * params.kpe_page_bytes + entry * kRopeDim * kStoredBytes;
    }
    // Fill u of a stage waits for the consumers' release of fill u - 1.
    MbarrierWait(barriers + 8 * (kHopperStages + stage), ((tile / kHopperStages) & 1) ^ 1);
    const uint32_t row_base = smem + Shape::kKvOffset + stage * Shape::kKvBytes + row * 128;
#pragma unroll
    for (int k = 0; k < Shape::kChunks / 4; ++k) {
      const uint32_t destination =
          row_base + (k / 2) * Shape::kKvBlockBytes + (((4u * (k % 2)) ^ row_swizzle) << 4);
      const uint8_t* source = k < Shape::kRankChunks / 4 ? ckv + 16 * (quarter + 4 * k)
                                                         : kpe + 16 * (quarter + 4 * k - Shape::kRankChunks);
      // Rows past the chunk are zero-filled: a zero V row keeps 0 * stale bytes from making NaN.
      CpAsync16(destination, valid ? source : params.ckv_pool, valid);
    }
    CpAsyncArriveNoinc(barriers + 8 * stage);
  }
}

// Partial S over k-steps [kFirstStep, kFirstStep + kHalfSteps): every descriptor offset is a
// compile-time constant (a runtime first step made the compiler keep 18 advanced descriptors in
// registers, which spilled).
template <typename Shape, typename T, int kFirstStep>
__device__ __forceinline__ void IssueQk(float (&s)[16], uint64_t q_descriptor, uint64_t k_descriptor) {
  WgmmaFence();
#pragma unroll
  for (int i = 0; i < Shape::kHalfSteps; ++i) {
    const int step = kFirstStep + i;
    const uint32_t q_bytes = (step / 4) * Shape::kQBlockBytes + (step % 4) * 32;
    const uint32_t k_bytes = (step / 4) * Shape::kKvBlockBytes + (step % 4) * 32;
    WgmmaSS32<T>(s, AdvanceDescriptor(q_descriptor, q_bytes), AdvanceDescriptor(k_descriptor, k_bytes), i > 0 ? 1 : 0);
  }
  WgmmaCommit();
}


template <typename Shape, typename T>
__device__ __forceinline__ void Consume(const MlaParams& params, const HopperWork& work, uint32_t smem,
                                        uint8_t* smem_generic) {
  constexpr int kRank = Shape::kRank;
  const int consumer = threadIdx.x / 128 - 1;
  const int thread = threadIdx.x % 128;
  const int warp = thread / 32;
  const int lane = thread % 32;
  const int num_heads = params.num_heads;
  const uint32_t barriers = smem + Shape::kBarrierOffset;

  // --- Q: both consumers load all 64 rows (zero past the request); wgmma reads it next.
  {
    const int index0 = threadIdx.x - 128;  // 0..255
    const uint16_t* q_nope = static_cast<const uint16_t*>(params.q_nope);
    const uint16_t* q_pe = static_cast<const uint16_t*>(params.q_pe);
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
        source = chunk < Shape::kRankChunks ? q_nope + q_index * kRank + 8 * chunk
                                            : q_pe + q_index * kRopeDim + 8 * (chunk - Shape::kRankChunks);
      }
      const uint32_t destination = smem + Shape::kQOffset + (chunk / 8) * Shape::kQBlockBytes + row * 128 +
                                   (((chunk % 8) ^ (row % 8)) << 4);
      CpAsync16(destination, source, valid);
    }
    CpAsyncWaitAll();
    FenceProxyAsync();  // generic-proxy writes, read next by wgmma (the async proxy)
    NamedBarrierSync(kConsumersBarrier, 256);
  }

  // Rows of this thread: g and g + 8 of its warp's 16 (the wgmma accumulator layout), the same
  // in both consumers.
  int row_position[2];
  bool row_valid[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int global_row = work.row_begin + 16 * warp + 8 * h + lane / 4;
    row_valid[h] = global_row < work.row_end;
    row_position[h] = work.position_offset + global_row / num_heads;
  }
  const bool soft_cap = params.cap_log2 > 0.0f;
  const float scale_log2 = soft_cap ? 1.0f : params.score_scale_log2;

  float o[Shape::kHalves][64];
#pragma unroll
  for (int half = 0; half < Shape::kHalves; ++half) {
#pragma unroll
    for (int i = 0; i < 64; ++i) o[half][i] = 0.0f;
  }
  float row_max[2] = {-INFINITY, -INFINITY};
  float row_sum[2] = {0.0f, 0.0f};
  float rescale[2] = {1.0f, 1.0f};
  float s[16];
#pragma unroll
  for (int i = 0; i < 16; ++i) s[i] = 0.0f;
  uint32_t p[2][4];  // P of the previous tile: the A operand of two m64n128k16 steps of 16 keys

  const uint64_t q_descriptor = MatrixDescriptor(smem + Shape::kQOffset, 16, 1024);
  auto issue_qk = [&](int stage) {
    const uint64_t k_descriptor = MatrixDescriptor(smem + Shape::kKvOffset + stage * Shape::kKvBytes, 16, 1024);
    if (consumer == 0) {
      IssueQk<Shape, T, 0>(s, q_descriptor, k_descriptor);
    } else {
      IssueQk<Shape, T, Shape::kHalfSteps>(s, q_descriptor, k_descriptor);
    }
  };
  auto issue_pv = [&](int stage) {
    // This consumer's ckv columns start at column block consumer * kConsumerCols / 64; MN-major:
    // 64-column blocks kKvBlockBytes apart, 8-key atoms 1024 bytes apart.
    const uint32_t v_base = smem + Shape::kKvOffset + stage * Shape::kKvBytes +
                            consumer * (Shape::kConsumerCols / 64) * Shape::kKvBlockBytes;
    const uint64_t v_descriptor = MatrixDescriptor(v_base, Shape::kKvBlockBytes, 1024);
    WgmmaFence();
#pragma unroll
    for (int step = 0; step < kTile / 16; ++step) {
#pragma unroll
      for (int half = 0; half < Shape::kHalves; ++half) {
        WgmmaRS<128, T>(o[half], p[step],
                        AdvanceDescriptor(v_descriptor, half * 2 * Shape::kKvBlockBytes + step * 16 * 128));
      }
    }
    WgmmaCommit();
  };
  // Adds the other consumer's partial S: both compute s0 + s1, bit for bit the same S.
  auto exchange = [&](int tile) {
    float4* mine = reinterpret_cast<float4*>(smem_generic + Shape::kXOffset + ((tile & 1) * 2 + consumer) * Shape::kXBytes);
    const float4* theirs = reinterpret_cast<const float4*>(smem_generic + Shape::kXOffset +
                                                           ((tile & 1) * 2 + (1 - consumer)) * Shape::kXBytes);
#pragma unroll
    for (int k = 0; k < 4; ++k) mine[k * 128 + thread] = make_float4(s[4 * k], s[4 * k + 1], s[4 * k + 2], s[4 * k + 3]);
    NamedBarrierSync(kConsumersBarrier, 256);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const float4 other = theirs[k * 128 + thread];
      s[4 * k] += other.x;
      s[4 * k + 1] += other.y;
      s[4 * k + 2] += other.z;
      s[4 * k + 3] += other.w;
    }
  };
  // s[4j + e]: rows g (e < 2) and g + 8, keys 8j + 2 (lane % 4) + e % 2 of the tile.
  auto softmax = [&](int tile) {
    const int tile_start = work.kv_begin + tile * kTile;
    // Non-finite inputs make a score NaN or +-inf: s * 0 + s turns both into NaN (finite s
    // unchanged) before the cap could make inf finite or -inf could read as masked. A NaN p
    // makes the row's sum NaN: o and lse come out NaN (NaN in, NaN out).
#pragma unroll
    for (int i = 0; i < 16; ++i) s[i] = fmaf(s[i], 0.0f, s[i]);
    if (soft_cap) {
#pragma unroll
      for (int i = 0; i < 16; ++i) s[i] = SoftCapLog2(s[i], params.cap_input_scale, params.cap_log2);
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = tile_start + 8 * j + 2 * (lane % 4) + (e % 2);
        const int position = row_position[e / 2];
        const bool visible = row_valid[e / 2] && key < work.kv_end && (!params.causal || key <= position) &&
                             (params.window_left < 0 || key >= position - params.window_left);
        if (!visible) s[4 * j + e] = -INFINITY;
      }
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float tile_max = fmaxf(fmaxf(fmaxf(s[2 * h], s[2 * h + 1]), fmaxf(s[4 + 2 * h], s[4 + 2 * h + 1])),
                             fmaxf(fmaxf(s[8 + 2 * h], s[8 + 2 * h + 1]), fmaxf(s[12 + 2 * h], s[12 + 2 * h + 1])));
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
      for (int j = 0; j < 4; ++j) {
        const float p0 = FastExp2(fmaf(s[4 * j + 2 * h], scale_log2, -subtract));
        const float p1 = FastExp2(fmaf(s[4 * j + 2 * h + 1], scale_log2, -subtract));
        s[4 * j + 2 * h] = p0;
        s[4 * j + 2 * h + 1] = p1;
        sum += p0 + p1;
      }
      row_sum[h] = row_sum[h] * rescale[h] + sum;
    }
  };
  // In a tile where some row does not see some key, zeroes the non-finite values of this
  // consumer's V columns once both partial S of the tile are done (exchange): P V adds p = 0
  // times V for hidden keys, and 0 * NaN would make a row NaN that never saw the key. A
  // non-finite ckv value makes the key's score non-finite for every row, so the rows that see it
  // still come out NaN (softmax). Keys past kv_end are zero-filled already.
  const int first_position = work.position_offset + work.row_begin / num_heads;
  const int last_position = work.position_offset + (work.row_end - 1) / num_heads;
  auto zero_non_finite_v = [&](int tile) {
    const int tile_start = work.kv_begin + tile * kTile;
    const bool hides_keys = (params.causal && min(tile_start + kTile, work.kv_end) - 1 > first_position) ||
                            (params.window_left >= 0 && tile_start < last_position - params.window_left);
    if (!hides_keys) return;
    constexpr uint32_t kExponent = kNonFiniteExponent2<T>;
    constexpr int kWords = (Shape::kConsumerCols / 64) * Shape::kKvBlockBytes / 16;
    uint4* v_words = reinterpret_cast<uint4*>(smem_generic + Shape::kKvOffset + (tile % kHopperStages) * Shape::kKvBytes +
                                              consumer * (Shape::kConsumerCols / 64) * Shape::kKvBlockBytes);
    for (int i = thread; i < kWords; i += 128) {
      const uint4 bits = v_words[i];
      // 0xffff in each 16-bit half that is an inf or a NaN (exponent all ones).
      const uint32_t bad[4] = {__vcmpeq2(bits.x & kExponent, kExponent), __vcmpeq2(bits.y & kExponent, kExponent),
                               __vcmpeq2(bits.z & kExponent, kExponent), __vcmpeq2(bits.w & kExponent, kExponent)};
      if ((bad[0] | bad[1] | bad[2] | bad[3]) != 0) {
        v_words[i] = make_uint4(bits.x & ~bad[0], bits.y & ~bad[1], bits.z & ~bad[2], bits.w & ~bad[3]);
      }
    }
    FenceProxyAsync();  // generic-proxy writes, read next by wgmma (the async proxy)
    NamedBarrierSync(kConsumerBarrier + consumer, 128);
  };
  auto convert_p = [&] {
#pragma unroll
    for (int step = 0; step < 2; ++step) {
#pragma unroll
      for (int i = 0; i < 4; ++i) p[step][i] = PackFloat2<T>(s[8 * step + 2 * i], s[8 * step + 2 * i + 1]);
    }
  };
  auto fence_p = [&] {
#pragma unroll
    for (int step = 0; step < 2; ++step) {
#pragma unroll
      for (int i = 0; i < 4; ++i) FenceRegister(p[step][i]);
    }
  };
  auto fence_o = [&] {
#pragma unroll
    for (int half = 0; half < Shape::kHalves; ++half) FenceRegisters(o[half]);
  };
  // Once the running maxima settle, most tiles move none of the warp's rows.
  auto rescale_o = [&] {
    if (__any_sync(0xffffffffu, rescale[0] != 1.0f || rescale[1] != 1.0f)) {
#pragma unroll
      for (int half = 0; half < Shape::kHalves; ++half) {
#pragma unroll
        for (int i = 0; i < 64; ++i) o[half][i] *= rescale[(i / 2) % 2];
      }
    }
  };
  // Releases a stage once this warp's wgmma reads of it completed (8 arrivals empty it).
  auto release = [&](int tile) {
    __syncwarp();
    if (lane == 0) MbarrierArrive(barriers + 8 * (kHopperStages + tile % kHopperStages));
  };
  auto wait_full = [&](int tile) {
    MbarrierWait(barriers + 8 * (tile % kHopperStages), static_cast<uint32_t>((tile / kHopperStages) & 1));
    FenceProxyAsync();
  };

  const int n = work.num_tiles;
  if (n > 0) {
    wait_full(0);
    issue_qk(0);
    WgmmaWait<0>();
    FenceRegisters(s);
    exchange(0);
    softmax(0);
    zero_non_finite_v(0);
    convert_p();
    for (int tile = 1; tile < n; ++tile) {
      wait_full(tile);
      issue_qk(tile % kHopperStages);
      rescale_o();  // by the previous tile's factor, before P_{j-1} V_{j-1} adds to O
      issue_pv((tile - 1) % kHopperStages);
      WgmmaWait<1>();  // Q K_j^T has completed; P_{j-1} V_{j-1} may still run
      FenceRegisters(s);
      exchange(tile);
      softmax(tile);
      zero_non_finite_v(tile);
      WgmmaWait<0>();
      fence_o();
      fence_p();
      release(tile - 1);
      convert_p();
    }
    rescale_o();
    issue_pv((n - 1) % kHopperStages);
    WgmmaWait<0>();
    fence_o();
    fence_p();
    release(n - 1);
  }

  // --- Epilogue: row sums over the quad (fixed pairing), normalise, store this consumer's
  // columns: o directly, or fp32 partials for MergeStates.
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    row_sum[h] += __shfl_xor_sync(0xffffffffu, row_sum[h], 1);
    row_sum[h] += __shfl_xor_sync(0xffffffffu, row_sum[h], 2);
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    if (!row_valid[h]) continue;
    // A row that saw no key has sum 0 and o 0: it stores 0 and lse = -inf. A NaN sum (a
    // non-finite input it saw) stores NaN in o and lse.
    const float inverse = row_sum[h] != 0.0f ? params.o_scale / row_sum[h] : 0.0f;
    const float lse = row_sum[h] != 0.0f ? (row_max[h] + log2f(row_sum[h])) * kLn2 : -INFINITY;
    const int global_row = work.row_begin + 16 * warp + 8 * h + lane / 4;
    const int token = global_row / num_heads;
    const int head = global_row - token * num_heads;
    const int column0 = consumer * Shape::kConsumerCols + 2 * (lane % 4);
    if (work.partial_first < 0) {
      const int64_t out_row = static_cast<int64_t>(work.q_row + token) * num_heads + head;
      uint16_t* out = static_cast<uint16_t*>(params.o) + out_row * kRank + column0;
      const bool bf16 = params.o_bf16;
#pragma unroll
      for (int half = 0; half < Shape::kHalves; ++half) {
#pragma unroll
        for (int j = 0; j < 16; ++j) {
          *reinterpret_cast<uint32_t*>(out + 128 * half + 8 * j) =
              PackOut(o[half][4 * j + 2 * h] * inverse, o[half][4 * j + 2 * h + 1] * inverse, bf16);
        }
      }
      if (consumer == 0 && lane % 4 == 0 && params.lse != nullptr) params.lse[out_row] = lse;
    } else {
      const int64_t slot = work.partial_first + static_cast<int64_t>(token) * work.partial_stride;
      const int64_t partial_row = slot * num_heads + head;
      float* out = params.partial_o + partial_row * kRank + column0;
#pragma unroll
      for (int half = 0; half < Shape::kHalves; ++half) {
#pragma unroll
        for (int j = 0; j < 16; ++j) {
          *reinterpret_cast<float2*>(out + 128 * half + 8 * j) =
              make_float2(o[half][4 * j + 2 * h] * inverse, o[half][4 * j + 2 * h + 1] * inverse);
        }
      }
      if (consumer == 0 && lane % 4 == 0) params.partial_lse[partial_row] = lse;
    }
  }
}

template <int kRank, typename T>
__global__ void __launch_bounds__(kHopperThreads, 1) MlaDecodeHopperKernel(const __grid_constant__ MlaParams params) {
  using Shape = HopperShape<kRank>;
  extern __shared__ __align__(1024) uint8_t shared_bytes[];
  HopperWork work;
  if (!LoadHopperWork<kTile>(params, blockIdx.x, &work)) return;  // a placeholder unit: nothing to do
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif

  // The swizzle phase follows address bits 7-9, so every block must sit on a 1024-byte boundary.
  const uint32_t raw = SharedAddress(shared_bytes);
  const uint32_t smem = (raw + 1023) & ~1023u;
  uint8_t* smem_generic = shared_bytes + (smem - raw);
  InitStageBarriers<kHopperStages>(smem + Shape::kBarrierOffset);
  // The role is uniform per warpgroup; the shuffle lets the compiler see that.
  const int warpgroup = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x / 128), 0);
  if (warpgroup == 0) {
    ReleaseRegisters<kProducerRegisters>();
    Produce<Shape>(params, work, smem);
    CpAsyncWaitAll();
  } else {
    ClaimRegisters<kConsumerRegisters>();
    Consume<Shape, T>(params, work, smem, smem_generic);
  }
}

template <int kRank, typename T>
cudaError_t LaunchMlaHopper(const MlaParams& params, int32_t num_ctas, cudaStream_t stream, int* ctas_per_sm) {
  return LaunchOrMeasure(&MlaDecodeHopperKernel<kRank, T>, kHopperThreads,
                         HopperShape<kRank>::kSmemBytes, params, num_ctas, stream, ctas_per_sm);
}

}  // namespace attnd::cuda::mla::hopper
