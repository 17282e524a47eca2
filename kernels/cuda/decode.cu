// Batch decode with split-KV (DESIGN 4.2). One CTA per (plan work item, KV head): it streams the
// item's keys through a cp.async pipeline in shared memory and serves every query head of the
// group from one read of K and V, on CUDA cores (one query row per head leaves tensor cores
// little to do; the kernel is bound by HBM, not arithmetic).
//
// Thread layout of a CTA (128 threads): tx (fastest) splits head_dim into 8-element slices,
// ty splits the group's query heads (each thread holds up to 4 heads, so K is converted to
// float once per 4 heads), tz splits the tile's tokens. Each (ty, tz) keeps its own online
// softmax state (m, d, o); the CTA combines the tz states in a fixed order at the end.
#include <cuda_runtime.h>

#include <cmath>

#include "absl/strings/str_cat.h"
#include "attnd/kernels/cuda/cuda_check.h"
#include "attnd/kernels/cuda/decode.h"
#include "attnd/kernels/cuda/flag_gate.h"
#include "attnd/kernels/cuda/merge.h"
#include "attnd/status_macros.h"
#include "cp_async.cuh"
#include "decode_tc_launch.h"
#include "grid_signal.cuh"
#include "launch.cuh"
#include "math.cuh"
#include "softmax.cuh"
#include "vec.cuh"

namespace attnd::cuda {
namespace {

constexpr int kDecodeThreads = 128;
constexpr int kDecodeStages = 4;          // tiles in the pipeline (3 in flight while one computes)
constexpr int kStageBytes = 4096;         // K bytes of one tile (V the same)
constexpr int64_t kWorkspaceAlignment = 256;

struct DecodeParams {
  const void* q;  // [T_q][num_qo_heads][head_dim] fp16/bf16
  bool q_bf16;
  int32_t num_qo_heads;
  int32_t num_kv_heads;
  int32_t group_size;  // real group; the kernel's template group may be padded up
  const void* k_pool;
  const void* v_pool;
  // Element strides of the pools; a row (page, entry, head) starts at
  // page * page_stride + entry * entry_stride + head * head_stride.
  int64_t page_stride;
  int64_t entry_stride;
  int64_t head_stride;
  int32_t log2_page_size;
  const int32_t* page_indptr;
  const int32_t* k_indices;
  const int32_t* v_indices;
  plan::DecodeWorkView work;
  float score_scale_log2;  // sm_scale * k_scale * log2(e): scores in base 2 without soft cap
  float soft_cap;          // 0: none
  float cap_input_scale;   // soft cap (softmax.cuh): sm_scale * k_scale / soft_cap
  float cap_log2;          // soft cap: soft_cap * log2(e)
  float v_scale;
  void* o;  // [T_q][num_qo_heads][head_dim]
  bool o_bf16;
  float* lse;          // [T_q][num_qo_heads] or null
  float* partial_o;    // [num_partials][num_qo_heads][head_dim]
  float* partial_lse;  // [num_partials][num_qo_heads]
  GridSignal done;     // set by the last CTA once o and lse are stored (no merge after)
};

template <int kHeadDim, typename KvT, int kGroup>
struct DecodeTraits {
  static constexpr int kVec = 8;  // head_dim elements per thread
  static constexpr int kBdx = kHeadDim / kVec;
  static constexpr int kHeadsPerThread = kGroup < 2 ? kGroup : 2;
  static constexpr int kBdy = kGroup / kHeadsPerThread;
  static constexpr int kBdz = kDecodeThreads / (kBdx * kBdy);
  static constexpr int kRowBytes = kHeadDim * static_cast<int>(sizeof(KvT));
  static constexpr int kTileTokens = kStageBytes / kRowBytes;
  static constexpr int kTokensPerThread = kTileTokens / kBdz;
  static constexpr int kChunksPerRow = kRowBytes / 16;
  static constexpr int kLoadsPerThread = kTileTokens * kChunksPerRow / kDecodeThreads;
  static constexpr int kSharedBytes = 2 * kDecodeStages * kStageBytes;
  // Registers are capped so 5 CTAs share an SM (4 where FP8 x group 8 needs more registers):
  // more resident CTAs mean a larger wave, so the planner can cut mixed-length batches into
  // finer, better balanced chunks. Tighter caps spilled.
  static constexpr int kMinCtasPerSm = sizeof(KvT) == 1 && kGroup == 8 ? 4 : 5;

  static_assert(kBdx <= 32 && 32 % kBdx == 0, "a head's lanes must sit in one warp");
  static_assert(kBdz >= 1 && kBdx * kBdy * kBdz == kDecodeThreads);
  static_assert(kTokensPerThread >= 1 && kTokensPerThread * kBdz == kTileTokens);
  static_assert(kLoadsPerThread * kDecodeThreads == kTileTokens * kChunksPerRow);
  // The final combine reuses the pipeline's shared memory.
  static_assert(kBdz * kGroup * kHeadDim * 4 + 2 * kBdz * kGroup * 4 <= kSharedBytes);
};

__device__ __forceinline__ void LoadQ8(const void* q, bool bf16, int64_t offset, float* out) {
  const uint4 raw = *reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(q) + offset);
  if (bf16) {
    Raw8ToFloat<__nv_bfloat16>(raw, out);
  } else {
    Raw8ToFloat<__half>(raw, out);
  }
}

__device__ __forceinline__ void StoreO8(void* o, bool bf16, int64_t offset, const float* values) {
  const uint4 raw = bf16 ? FloatToRaw8<__nv_bfloat16>(values) : FloatToRaw8<__half>(values);
  *reinterpret_cast<uint4*>(static_cast<uint16_t*>(o) + offset) = raw;
}

template <int kHeadDim, typename KvT, int kGroup>
__global__ void __launch_bounds__(kDecodeThreads, (DecodeTraits<kHeadDim, KvT, kGroup>::kMinCtasPerSm))
    BatchDecodeKernel(const DecodeParams params) {
  using Traits = DecodeTraits<kHeadDim, KvT, kGroup>;
  constexpr int kBdx = Traits::kBdx;
  constexpr int kBdy = Traits::kBdy;
  constexpr int kBdz = Traits::kBdz;
  constexpr int kHpt = Traits::kHeadsPerThread;
  constexpr int kTpt = Traits::kTokensPerThread;
  constexpr int kTile = Traits::kTileTokens;
  constexpr int kRowBytes = Traits::kRowBytes;
  constexpr int kLoads = Traits::kLoadsPerThread;
  using RawT = typename Raw8<KvT>::type;

  // [stage][tile token][row bytes] for K, then the same for V.
  __shared__ __align__(16) uint8_t shared[Traits::kSharedBytes];
  uint8_t* const k_shared = shared;
  uint8_t* const v_shared = shared + kDecodeStages * kStageBytes;

  // The KV heads of an item are adjacent CTAs: they run together and read the same pages (the
  // heads of a token share its NHD rows), which keeps DRAM accesses local.
  const int item = blockIdx.x / params.num_kv_heads;
  const int kv_head = blockIdx.x - item * params.num_kv_heads;
  const int tid = threadIdx.x;
  // Lets a following merge grid be scheduled as soon as every CTA of this one is running; it
  // still waits (griddepcontrol.wait) for this grid's results. Hides the merge's launch latency.
  // Launched itself as a programmatic dependent of the append that wrote q and the new keys:
  // wait for that grid before reading anything (an ordinary launch passes straight through).
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
  const int tx = tid % kBdx;
  const int ty = (tid / kBdx) % kBdy;
  const int tz = tid / (kBdx * kBdy);

  const int32_t request = params.work.item_request[item];
  const int32_t q_row = params.work.item_q_row[item];
  const int32_t kv_begin = params.work.item_kv_begin[item];
  const int32_t kv_end = params.work.item_kv_end[item];
  const int32_t partial = params.work.item_partial[item];
  const int32_t page_begin = params.page_indptr[request];
  const int32_t group_size = params.group_size;

  // This thread's query heads (kHpt of them), dims [tx * 8, tx * 8 + 8).
  float q[kHpt][8];
#pragma unroll
  for (int i = 0; i < kHpt; ++i) {
    const int head_in_group = ty * kHpt + i;
    if (head_in_group < group_size) {
      const int64_t head = static_cast<int64_t>(kv_head) * group_size + head_in_group;
      LoadQ8(params.q, params.q_bf16,
             (static_cast<int64_t>(q_row) * params.num_qo_heads + head) * kHeadDim + tx * 8, q[i]);
    } else {
#pragma unroll
      for (int e = 0; e < 8; ++e) q[i][e] = 0.0f;
    }
  }

  // Each thread copies kLoads 16-byte chunks of K and of V per tile: chunk c of the tile is
  // row c / kChunksPerRow, column c % kChunksPerRow.
  const int64_t head_offset_bytes = kv_head * params.head_stride * static_cast<int64_t>(sizeof(KvT));
  const int64_t page_stride_bytes = params.page_stride * static_cast<int64_t>(sizeof(KvT));
  const int64_t entry_stride_bytes = params.entry_stride * static_cast<int64_t>(sizeof(KvT));
  const int32_t page_mask = (1 << params.log2_page_size) - 1;
  const bool separate_v = params.v_indices != params.k_indices;
  const uint8_t* const k_pool = static_cast<const uint8_t*>(params.k_pool);
  const uint8_t* const v_pool = static_cast<const uint8_t*>(params.v_pool);
  const int num_tiles = (kv_end - kv_begin + kTile - 1) / kTile;

  // Page ids of the rows this thread copies for a tile (read one tile ahead of the copy so the
  // index load's latency hides behind a tile of compute).
  auto fetch_pages = [&](int tile, int32_t (&k_page)[kLoads], int32_t (&v_page)[kLoads]) {
#pragma unroll
    for (int l = 0; l < kLoads; ++l) {
      const int row = (tid + l * kDecodeThreads) / Traits::kChunksPerRow;
      const int32_t token = kv_begin + tile * kTile + row;
      k_page[l] = 0;
      v_page[l] = 0;
      if (tile < num_tiles && token < kv_end) {
        const int32_t slot = page_begin + (token >> params.log2_page_size);
        k_page[l] = params.k_indices[slot];
        v_page[l] = separate_v ? params.v_indices[slot] : k_page[l];
      }
    }
  };
  auto issue_tile = [&](int tile, const int32_t (&k_page)[kLoads], const int32_t (&v_page)[kLoads]) {
    const int stage = tile % kDecodeStages;
#pragma unroll
    for (int l = 0; l < kLoads; ++l) {
      const int chunk = tid + l * kDecodeThreads;
      const int row = chunk / Traits::kChunksPerRow;
      const int column_bytes = (chunk % Traits::kChunksPerRow) * 16;
      const int32_t token = kv_begin + tile * kTile + row;
      // Rows past the item's end are zero-filled: their scores are masked, and a zero V row
      // keeps 0 * stale bytes from making NaN.
      const bool valid = tile < num_tiles && token < kv_end;
      const int64_t entry_bytes = static_cast<int64_t>(token & page_mask) * entry_stride_bytes +
                                  head_offset_bytes + column_bytes;
      const uint8_t* k_source = valid ? k_pool + k_page[l] * page_stride_bytes + entry_bytes : k_pool;
      const uint8_t* v_source = valid ? v_pool + v_page[l] * page_stride_bytes + entry_bytes : v_pool;
      const int shared_offset = stage * kStageBytes + row * kRowBytes + column_bytes;
      CpAsync16(k_shared + shared_offset, k_source, valid);
      CpAsync16(v_shared + shared_offset, v_source, valid);
    }
  };

  int32_t k_page[kLoads], v_page[kLoads];
#pragma unroll
  for (int tile = 0; tile < kDecodeStages - 1; ++tile) {
    fetch_pages(tile, k_page, v_page);
    if (tile < num_tiles) issue_tile(tile, k_page, v_page);
    CpAsyncCommit();  // empty groups keep the wait count uniform
  }
  fetch_pages(kDecodeStages - 1, k_page, v_page);

  float m[kHpt], d[kHpt], o[kHpt][8];
#pragma unroll
  for (int i = 0; i < kHpt; ++i) {
    m[i] = -INFINITY;
    d[i] = 0.0f;
#pragma unroll
    for (int e = 0; e < 8; ++e) o[i][e] = 0.0f;
  }

  for (int tile = 0; tile < num_tiles; ++tile) {
    CpAsyncWait<kDecodeStages - 2>();
    // Makes the tile visible to all threads, and frees the stage computed last iteration.
    __syncthreads();
    const int next_tile = tile + kDecodeStages - 1;
    if (next_tile < num_tiles) issue_tile(next_tile, k_page, v_page);
    CpAsyncCommit();
    fetch_pages(next_tile + 1, k_page, v_page);

    const uint8_t* k_tile = k_shared + (tile % kDecodeStages) * kStageBytes;
    const uint8_t* v_tile = v_shared + (tile % kDecodeStages) * kStageBytes;

    float s[kHpt][kTpt];
#pragma unroll
    for (int j = 0; j < kTpt; ++j) {
      const int row = tz * kTpt + j;
      float k[8];
      Raw8ToFloat<KvT>(*reinterpret_cast<const RawT*>(k_tile + row * kRowBytes + tx * 8 * sizeof(KvT)), k);
#pragma unroll
      for (int i = 0; i < kHpt; ++i) {
        float dot = 0.0f;
#pragma unroll
        for (int e = 0; e < 8; ++e) dot = fmaf(q[i][e], k[e], dot);
        s[i][j] = dot;
      }
    }
#pragma unroll
    for (int i = 0; i < kHpt; ++i) {
#pragma unroll
      for (int j = 0; j < kTpt; ++j) {
#pragma unroll
        for (int offset = kBdx / 2; offset >= 1; offset /= 2)
          s[i][j] += __shfl_xor_sync(0xffffffffu, s[i][j], offset);
      }
    }

    const int32_t first_token = kv_begin + tile * kTile + tz * kTpt;
#pragma unroll
    for (int i = 0; i < kHpt; ++i) {
      float tile_max = -INFINITY;
#pragma unroll
      for (int j = 0; j < kTpt; ++j) {
        // Non-finite inputs (q, or this key's k) make the raw score NaN or +-inf: x * 0 + x turns
        // both into NaN (finite x unchanged), before the cap can map inf to a finite value. A
        // NaN probability then makes d and o NaN, which the end of the kernel reports.
        const float raw = fmaf(s[i][j], 0.0f, s[i][j]);
        float score;
        if (params.soft_cap > 0.0f) {
          score = SoftCapLog2(raw, params.cap_input_scale, params.cap_log2);
        } else {
          score = raw * params.score_scale_log2;
        }
        s[i][j] = first_token + j < kv_end ? score : -INFINITY;
        tile_max = fmaxf(tile_max, s[i][j]);
      }
      const float m_new = fmaxf(m[i], tile_max);
      // Nothing seen yet: subtracting 0 keeps exp2(-inf) = 0 instead of exp2(-inf + inf) = NaN.
      const float m_use = m_new == -INFINITY ? 0.0f : m_new;
      const float rescale = exp2f(m[i] - m_use);
      d[i] *= rescale;
#pragma unroll
      for (int e = 0; e < 8; ++e) o[i][e] *= rescale;
#pragma unroll
      for (int j = 0; j < kTpt; ++j) {
        s[i][j] = exp2f(s[i][j] - m_use);
        d[i] += s[i][j];
      }
      m[i] = m_new;
    }

#pragma unroll
    for (int j = 0; j < kTpt; ++j) {
      const int row = tz * kTpt + j;
      float v[8];
      Raw8ToFloat<KvT>(*reinterpret_cast<const RawT*>(v_tile + row * kRowBytes + tx * 8 * sizeof(KvT)), v);
#pragma unroll
      for (int i = 0; i < kHpt; ++i) {
#pragma unroll
        for (int e = 0; e < 8; ++e) o[i][e] = fmaf(s[i][j], v[e], o[i][e]);
      }
    }
  }
  CpAsyncWait<0>();
  __syncthreads();

  // Combine the kBdz token streams of every head, in tz order: [tz][head in group][dim] sums,
  // then [tz][head in group] maxima and denominators.
  float* const sums = reinterpret_cast<float*>(shared);
  float* const maxima = sums + kBdz * kGroup * kHeadDim;
  float* const denominators = maxima + kBdz * kGroup;
#pragma unroll
  for (int i = 0; i < kHpt; ++i) {
    // A non-finite v of a key this stream saw left a NaN or inf in o (even times a probability
    // of 0): fold that into d, over the head's lanes, as NaN (adds exactly 0 otherwise).
    float poison = 0.0f;
#pragma unroll
    for (int e = 0; e < 8; ++e) poison = fmaf(o[i][e], 0.0f, poison);
#pragma unroll
    for (int offset = kBdx / 2; offset >= 1; offset /= 2) poison += __shfl_xor_sync(0xffffffffu, poison, offset);
    d[i] += poison;
    const int head_in_group = ty * kHpt + i;
    float* row = sums + (tz * kGroup + head_in_group) * kHeadDim + tx * 8;
    reinterpret_cast<float4*>(row)[0] = make_float4(o[i][0], o[i][1], o[i][2], o[i][3]);
    reinterpret_cast<float4*>(row)[1] = make_float4(o[i][4], o[i][5], o[i][6], o[i][7]);
    if (tx == 0) {
      maxima[tz * kGroup + head_in_group] = m[i];
      denominators[tz * kGroup + head_in_group] = d[i];
    }
  }
  __syncthreads();

  for (int slice = tid; slice < kGroup * kBdx; slice += kDecodeThreads) {
    const int head_in_group = slice / kBdx;
    const int dim = (slice % kBdx) * 8;
    if (head_in_group >= group_size) continue;
    float max_all = -INFINITY;
#pragma unroll
    for (int z = 0; z < kBdz; ++z) max_all = fmaxf(max_all, maxima[z * kGroup + head_in_group]);
    float out[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    float lse = -INFINITY;
    // Streams that saw no key add weight 0 times d = 0 and o = 0. A poisoned stream (d NaN) may
    // have m = -inf (every score it saw was NaN): subtracting 0 then still gives weight 0, and
    // 0 * NaN makes the row NaN.
    const float subtract = max_all == -INFINITY ? 0.0f : max_all;
    float denominator = 0.0f;
#pragma unroll
    for (int z = 0; z < kBdz; ++z) {
      const float weight = exp2f(maxima[z * kGroup + head_in_group] - subtract);
      denominator += weight * denominators[z * kGroup + head_in_group];
      const float* row = sums + (z * kGroup + head_in_group) * kHeadDim + dim;
#pragma unroll
      for (int e = 0; e < 8; ++e) out[e] = fmaf(weight, row[e], out[e]);
    }
    // denominator: 0 when the row saw no key (o 0, lse -inf), NaN when an input it saw was not
    // finite (o NaN in every dim, lse NaN: NaN in, NaN out, ForwardResponse.o in the proto).
    if (denominator != 0.0f) {
      const float factor = params.v_scale / denominator;
#pragma unroll
      for (int e = 0; e < 8; ++e) out[e] *= factor;
      lse = (max_all + log2f(denominator)) * kLn2;
    }
    const int64_t head = static_cast<int64_t>(kv_head) * group_size + head_in_group;
    if (partial < 0) {
      const int64_t row = static_cast<int64_t>(q_row) * params.num_qo_heads + head;
      StoreO8(params.o, params.o_bf16, row * kHeadDim + dim, out);
      if (params.lse != nullptr && dim == 0) params.lse[row] = lse;
    } else {
      const int64_t row = static_cast<int64_t>(partial) * params.num_qo_heads + head;
      float4* target = reinterpret_cast<float4*>(params.partial_o + row * kHeadDim + dim);
      target[0] = make_float4(out[0], out[1], out[2], out[3]);
      target[1] = make_float4(out[4], out[5], out[6], out[7]);
      if (dim == 0) params.partial_lse[row] = lse;
    }
  }
  SignalWhenGridDone(params.done);
}

using DecodeKernelFn = void (*)(DecodeParams);

// Groups run padded to 1, 2, 4 or 8 heads: a bounded set of instantiations covers groups 1..8.
int PaddedGroup(int group_size) {
  if (group_size <= 2) return group_size;
  return group_size <= 4 ? 4 : 8;
}

template <int kHeadDim, typename KvT>
DecodeKernelFn PickGroup(int group_size) {
  switch (PaddedGroup(group_size)) {
    case 1:
      return &BatchDecodeKernel<kHeadDim, KvT, 1>;
    case 2:
      return &BatchDecodeKernel<kHeadDim, KvT, 2>;
    case 4:
      return &BatchDecodeKernel<kHeadDim, KvT, 4>;
    case 8:
      return &BatchDecodeKernel<kHeadDim, KvT, 8>;
  }
  return nullptr;
}

template <int kHeadDim>
DecodeKernelFn PickKv(DType kv_dtype, int group_size) {
  switch (kv_dtype) {
    case DType::kFloat16:
      return PickGroup<kHeadDim, __half>(group_size);
    case DType::kBFloat16:
      return PickGroup<kHeadDim, __nv_bfloat16>(group_size);
    case DType::kFloat8E4M3:
      return PickGroup<kHeadDim, __nv_fp8_e4m3>(group_size);
    case DType::kFloat32:
      return nullptr;
  }
  return nullptr;
}

DecodeKernelFn PickDecodeKernel(const DecodeKernelConfig& config) {
  if (config.q_dtype != DType::kFloat16 && config.q_dtype != DType::kBFloat16) return nullptr;
  if (config.group_size < 1 || config.group_size > 8) return nullptr;
  switch (config.head_dim) {
    case 64:
      return PickKv<64>(config.kv_dtype, config.group_size);
    case 128:
      return PickKv<128>(config.kv_dtype, config.group_size);
    case 256:
      return PickKv<256>(config.kv_dtype, config.group_size);
  }
  return nullptr;
}

bool Aligned16(const void* pointer) { return reinterpret_cast<uintptr_t>(pointer) % 16 == 0; }

int64_t PartialLseOffsetBytes(int32_t num_partials, int32_t num_qo_heads, int32_t head_dim) {
  const int64_t o_bytes = int64_t{num_partials} * num_qo_heads * head_dim * 4;
  return (o_bytes + kWorkspaceAlignment - 1) / kWorkspaceAlignment * kWorkspaceAlignment;
}

absl::Status ValidateDecode(const BatchDecodeArgs& args, int* log2_page_size) {
  const TokenHeadsView& q = args.q;
  const PagedKvView& k = args.k_cache;
  const PagedKvView& v = args.v_cache;
  if (q.dtype != DType::kFloat16 && q.dtype != DType::kBFloat16) {
    return absl::InvalidArgumentError(absl::StrCat("q.dtype: expected float16 or bfloat16, got ",
                                                   DTypeName(q.dtype)));
  }
  if (args.o.dtype != DType::kFloat16 && args.o.dtype != DType::kBFloat16) {
    return absl::InvalidArgumentError(absl::StrCat("o.dtype: expected float16 or bfloat16, got ",
                                                   DTypeName(args.o.dtype)));
  }
  if (k.dtype != v.dtype || k.layout != v.layout || k.page_size != v.page_size ||
      k.num_heads != v.num_heads || k.head_dim != v.head_dim) {
    return absl::InvalidArgumentError("v_cache: expected the K pool's dtype, layout and geometry");
  }
  if (k.head_dim != q.head_dim || args.o.head_dim != q.head_dim || args.o.num_heads != q.num_heads) {
    return absl::InvalidArgumentError(absl::StrCat("head_dim: q ", q.head_dim, ", o ",
                                                   args.o.head_dim, ", cache ", k.head_dim,
                                                   " must agree"));
  }
  if (k.num_heads <= 0 || q.num_heads % k.num_heads != 0) {
    return absl::InvalidArgumentError(absl::StrCat("num_qo_heads ", q.num_heads,
                                                   " must be a multiple of num_kv_heads ",
                                                   k.num_heads));
  }
  if (k.page_size <= 0 || (k.page_size & (k.page_size - 1)) != 0 || k.page_size > 128 ||
      args.pages.page_size != k.page_size) {
    return absl::InvalidArgumentError(absl::StrCat(
        "page_size: expected a power of two in 1..128 shared by table and pools, got ",
        k.page_size, " (table ", args.pages.page_size, ")"));
  }
  *log2_page_size = 0;
  while ((1 << *log2_page_size) < k.page_size) ++*log2_page_size;
  if (args.work.window_left != args.params.window_left) {
    return absl::InvalidArgumentError(absl::StrCat("window_left ", args.params.window_left,
                                                   " differs from the plan's ",
                                                   args.work.window_left));
  }
  if (args.work.num_items > 0 &&
      (q.data == nullptr || args.o.data == nullptr || k.data == nullptr || v.data == nullptr ||
       args.pages.indptr == nullptr || args.pages.k_indices == nullptr ||
       args.pages.v_indices == nullptr || args.work.item_request == nullptr)) {
    return absl::InvalidArgumentError("BatchDecode: null tensor, page table or plan pointer");
  }
  if (!Aligned16(q.data) || !Aligned16(args.o.data) || !Aligned16(k.data) || !Aligned16(v.data)) {
    return absl::InvalidArgumentError("BatchDecode: q, o and the pools must be 16-byte aligned");
  }
  const int64_t needed = BatchDecodeWorkspaceBytes(args.work.num_partials, q.num_heads, q.head_dim);
  if (args.workspace_bytes < needed || (needed > 0 && args.workspace == nullptr) ||
      reinterpret_cast<uintptr_t>(args.workspace) % kWorkspaceAlignment != 0) {
    return absl::InvalidArgumentError(absl::StrCat("workspace: need ", needed,
                                                   " bytes, 256-byte aligned; got ",
                                                   args.workspace_bytes));
  }
  return absl::OkStatus();
}

// Merges a split plan's partials into o and lse (nothing when the plan does not split).
absl::Status MergePartials(const BatchDecodeArgs& args, float* partial_o, float* partial_lse,
                           cudaStream_t stream);

}  // namespace

bool DecodeSupports(const DecodeKernelConfig& config) { return PickDecodeKernel(config) != nullptr; }

absl::StatusOr<int32_t> DecodeCtasPerWave(const DecodeKernelConfig& config) {
  const DecodeKernelFn kernel = PickDecodeKernel(config);
  if (kernel == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "decode: no kernel for q ", DTypeName(config.q_dtype), ", kv ", DTypeName(config.kv_dtype),
        ", head_dim ", config.head_dim, ", group ", config.group_size));
  }
  int device = 0;
  int num_sms = 0;
  int ctas_per_sm = 0;
  CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, device));
  CUDA_RETURN_IF_ERROR(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
      &ctas_per_sm, reinterpret_cast<const void*>(kernel), kDecodeThreads, 0));
  return ctas_per_sm * num_sms;
}

int64_t BatchDecodeWorkspaceBytes(int32_t num_partials, int32_t num_qo_heads, int32_t head_dim) {
  if (num_partials <= 0) return 0;
  const int64_t lse_bytes = int64_t{num_partials} * num_qo_heads * 4;
  return PartialLseOffsetBytes(num_partials, num_qo_heads, head_dim) + lse_bytes;
}

absl::Status BatchDecode(const BatchDecodeArgs& args, cudaStream_t stream) {
  int log2_page_size = 0;
  RETURN_IF_ERROR(ValidateDecode(args, &log2_page_size));
  if (args.work.num_items == 0) {
    // Nothing to launch: the signal still follows whatever ran before on the stream.
    return args.done.active() ? LaunchFlagSignal(stream, args.done.word, args.done.value)
                              : absl::OkStatus();
  }
  if (args.work.kernel == plan::DecodeKernel::kTensorCore) {
    float* partial_o = nullptr;
    float* partial_lse = nullptr;
    if (args.work.num_partials > 0) {
      uint8_t* workspace = static_cast<uint8_t*>(args.workspace);
      partial_o = reinterpret_cast<float*>(workspace);
      partial_lse = reinterpret_cast<float*>(
          workspace + PartialLseOffsetBytes(args.work.num_partials, args.q.num_heads, args.q.head_dim));
    }
    RETURN_IF_ERROR(LaunchTensorCoreDecode(args, log2_page_size, partial_o, partial_lse, stream));
    return MergePartials(args, partial_o, partial_lse, stream);
  }

  const DecodeKernelConfig config{args.q.dtype, args.k_cache.dtype, args.q.head_dim,
                                  args.q.num_heads / args.k_cache.num_heads};
  const DecodeKernelFn kernel = PickDecodeKernel(config);
  if (kernel == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "decode: no kernel for kv ", DTypeName(config.kv_dtype), ", head_dim ", config.head_dim,
        ", group ", config.group_size, " (head_dim 64/128/256, group 1..8)"));
  }

  const PagedKvView& k = args.k_cache;
  DecodeParams params{};
  params.q = args.q.data;
  params.q_bf16 = args.q.dtype == DType::kBFloat16;
  params.num_qo_heads = args.q.num_heads;
  params.num_kv_heads = args.k_cache.num_heads;
  params.group_size = config.group_size;
  params.k_pool = k.data;
  params.v_pool = args.v_cache.data;
  params.page_stride = k.PageElements();
  if (k.layout == KvLayout::kNHD) {
    params.entry_stride = int64_t{k.num_heads} * k.head_dim;
    params.head_stride = k.head_dim;
  } else {
    params.entry_stride = k.head_dim;
    params.head_stride = int64_t{k.page_size} * k.head_dim;
  }
  params.log2_page_size = log2_page_size;
  params.page_indptr = args.pages.indptr;
  params.k_indices = args.pages.k_indices;
  params.v_indices = args.pages.v_indices;
  params.work = args.work;
  params.soft_cap = args.params.logits_soft_cap > 0.0f ? args.params.logits_soft_cap : 0.0f;
  const SoftmaxParams softmax =
      SoftmaxParams::Of(args.params.sm_scale * args.params.k_scale, params.soft_cap);
  params.score_scale_log2 = args.params.sm_scale * args.params.k_scale * kLog2e;
  params.cap_input_scale = softmax.cap_input_scale;
  params.cap_log2 = softmax.cap_log2;
  params.v_scale = args.params.v_scale;
  params.o = args.o.data;
  params.o_bf16 = args.o.dtype == DType::kBFloat16;
  params.lse = args.lse;
  const int32_t num_partials = args.work.num_partials;
  uint8_t* workspace = static_cast<uint8_t*>(args.workspace);
  params.partial_o = reinterpret_cast<float*>(workspace);
  // The last grid of the launch signals: the merge where the plan splits, this one otherwise.
  if (args.work.num_merge_rows == 0) params.done = args.done;
  params.partial_lse = num_partials > 0
                           ? reinterpret_cast<float*>(workspace + PartialLseOffsetBytes(
                                                                      num_partials, args.q.num_heads,
                                                                      args.q.head_dim))
                           : nullptr;

  void* kernel_args[] = {&params};
  CUDA_RETURN_IF_ERROR(LaunchAfterPrecedingGrid(
      reinterpret_cast<const void*>(kernel),
      dim3(static_cast<unsigned>(int64_t{args.work.num_items} * k.num_heads)), dim3(kDecodeThreads),
      0, stream, kernel_args));
  return MergePartials(args, params.partial_o, params.partial_lse, stream);
}

namespace {

absl::Status MergePartials(const BatchDecodeArgs& args, float* partial_o, float* partial_lse,
                           cudaStream_t stream) {
  if (args.work.num_merge_rows == 0) return absl::OkStatus();
  MergeStatesArgs merge;
  merge.partial_o = partial_o;
  merge.partial_lse = partial_lse;
  merge.indptr = args.work.merge_indptr;
  merge.out_rows = args.work.merge_q_row;
  merge.num_rows = args.work.num_merge_rows;
  merge.num_heads = args.q.num_heads;
  merge.head_dim = args.q.head_dim;
  merge.o = args.o;
  merge.lse = args.lse;
  merge.done = args.done;
  return MergeStates(merge, stream);
}

}  // namespace
}  // namespace attnd::cuda
