// Fused RoPE + quantise + paged append (DESIGN 4.1). A CTA takes kTokensPerCta tokens: it looks
// up each token's page slot and computes its rotary cos/sin once (shared by every head), then
// every thread transforms 16-element segments of the tokens' rows. A launch runs up to three
// "jobs" over the same tokens: MHA q (dense, rotated), k (paged, rotated), v (paged); MLA q_pe
// (dense, rotated), ckv (paged), kpe (paged, rotated). Loads and stores are 16 bytes wide.
#include <cuda_runtime.h>

#include "absl/strings/str_cat.h"
#include "attnd/kernels/cuda/append.h"
#include "attnd/status_macros.h"
#include "cuda_check.h"
#include "vec.cuh"

namespace attnd::cuda {
namespace {

constexpr int kAppendThreads = 256;
constexpr int kTokensPerCta = 4;
constexpr int kMaxRopePairs = 128;  // rotary_dim <= 256
constexpr int kSegment = 16;        // elements a thread handles at once
constexpr int kMaxJobs = 3;

struct AppendJob {
  const void* in;           // [T][num_heads][width], the input dtype; null: job absent
  void* out;                // dense: [T][num_heads][width] (input dtype); paged: the pool
  const int32_t* page_ids;  // paged: the K or V page ids; null: dense output
  // Paged: element strides of (page, entry, head) in the pool.
  int64_t page_stride;
  int64_t entry_stride;
  int64_t head_stride;
  int32_t num_heads;
  int32_t width;
  int32_t segments_per_row;
  int32_t segments_per_token;
  bool rotate;
  float scale;  // paged: stores value / scale
};

struct AppendParams {
  AppendJob jobs[kMaxJobs];
  int64_t num_tokens;
  const int32_t* batch_indices;
  const int32_t* positions;
  const int32_t* page_indptr;
  int32_t log2_page_size;
  const float* inv_freq;
  int32_t rope_pairs;  // 0: no rotation
  bool interleaved;
};

template <typename T>
__device__ __forceinline__ void Load16(const T* source, float* out) {
  const uint4* raw = reinterpret_cast<const uint4*>(source);
  Raw8ToFloat<T>(raw[0], out);
  Raw8ToFloat<T>(raw[1], out + 8);
}

template <typename T>
__device__ __forceinline__ float LoadOne(const T* source) {
  return static_cast<float>(*source);
}

template <typename T>
__device__ __forceinline__ void Store16(T* target, const float* values) {
  uint4* raw = reinterpret_cast<uint4*>(target);
  raw[0] = FloatToRaw8<T>(values);
  raw[1] = FloatToRaw8<T>(values + 8);
}

template <>
__device__ __forceinline__ void Store16<__nv_fp8_e4m3>(__nv_fp8_e4m3* target, const float* values) {
  const uint2 low = FloatToRaw8<__nv_fp8_e4m3>(values);
  const uint2 high = FloatToRaw8<__nv_fp8_e4m3>(values + 8);
  *reinterpret_cast<uint4*>(target) = make_uint4(low.x, low.y, high.x, high.y);
}

// Rotates the elements of x (dims [first_dim, first_dim + 16) of a row starting at row) that
// fall in the rotary range. Products and sums are rounded separately (no FMA contraction), as
// the reference's float arithmetic does, so both store the same bits for the same cos/sin.
template <typename T>
__device__ __forceinline__ void Rotate16(float* x, const T* row, int first_dim, int rope_pairs,
                                         bool interleaved, const float2* angles) {
  const int rotary_dim = 2 * rope_pairs;
  if (interleaved) {
#pragma unroll
    for (int k = 0; k < kSegment; k += 2) {
      const int dim = first_dim + k;
      if (dim < rotary_dim) {
        const float2 angle = angles[dim / 2];
        const float first = x[k];
        const float second = x[k + 1];
        x[k] = __fsub_rn(__fmul_rn(first, angle.x), __fmul_rn(second, angle.y));
        x[k + 1] = __fadd_rn(__fmul_rn(first, angle.y), __fmul_rn(second, angle.x));
      }
    }
    return;
  }
  // Neox: dim pairs (i, i + rope_pairs). The partner segment is one aligned vector when the
  // half rotary width is a multiple of 16; otherwise partners are read one by one.
  float partner[kSegment];
  if (rope_pairs % kSegment == 0 && first_dim + kSegment <= rotary_dim) {
    Load16(row + (first_dim < rope_pairs ? first_dim + rope_pairs : first_dim - rope_pairs), partner);
  } else {
#pragma unroll
    for (int k = 0; k < kSegment; ++k) {
      const int dim = first_dim + k;
      partner[k] = dim < rotary_dim
                       ? LoadOne(row + (dim < rope_pairs ? dim + rope_pairs : dim - rope_pairs))
                       : 0.0f;
    }
  }
#pragma unroll
  for (int k = 0; k < kSegment; ++k) {
    const int dim = first_dim + k;
    if (dim < rope_pairs) {
      const float2 angle = angles[dim];
      x[k] = __fsub_rn(__fmul_rn(x[k], angle.x), __fmul_rn(partner[k], angle.y));
    } else if (dim < rotary_dim) {
      const float2 angle = angles[dim - rope_pairs];
      x[k] = __fadd_rn(__fmul_rn(partner[k], angle.y), __fmul_rn(x[k], angle.x));
    }
  }
}

template <typename InT, typename CacheT>
__global__ void __launch_bounds__(kAppendThreads) AppendKvKernel(const AppendParams params) {
  __shared__ float2 angles[kTokensPerCta][kMaxRopePairs];  // (cos, sin) per token and pair
  __shared__ int32_t token_slot[kTokensPerCta];  // index into the page-id arrays; -1: skip
  __shared__ int32_t token_entry[kTokensPerCta];

  const int64_t first_token = static_cast<int64_t>(blockIdx.x) * kTokensPerCta;
  if (threadIdx.x < kTokensPerCta) {
    const int64_t token = first_token + threadIdx.x;
    int32_t slot = -1;
    int32_t entry = 0;
    if (token < params.num_tokens) {
      const int32_t request = params.batch_indices[token];
      if (request >= 0) {  // -1 is a padding slot: no byte of it is touched
        const int32_t position = params.positions[token];
        slot = params.page_indptr[request] + (position >> params.log2_page_size);
        entry = position & ((1 << params.log2_page_size) - 1);
      }
    }
    token_slot[threadIdx.x] = slot;
    token_entry[threadIdx.x] = entry;
  }
  for (int i = threadIdx.x; i < kTokensPerCta * params.rope_pairs; i += kAppendThreads) {
    const int t = i / params.rope_pairs;
    const int pair = i - t * params.rope_pairs;
    const int64_t token = first_token + t;
    if (token < params.num_tokens && params.batch_indices[token] >= 0) {
      // Angle in float32, as the reference computes it: float(position) * inv_freq.
      const float angle = static_cast<float>(params.positions[token]) * params.inv_freq[pair];
      float sine, cosine;
      sincosf(angle, &sine, &cosine);
      angles[t][pair] = make_float2(cosine, sine);
    }
  }
  __syncthreads();

#pragma unroll
  for (int j = 0; j < kMaxJobs; ++j) {
    const AppendJob& job = params.jobs[j];
    if (job.in == nullptr) continue;
    const int total = kTokensPerCta * job.segments_per_token;
    for (int segment = threadIdx.x; segment < total; segment += kAppendThreads) {
      const int t = segment / job.segments_per_token;
      const int32_t slot = token_slot[t];
      if (slot < 0) continue;
      const int in_token = segment - t * job.segments_per_token;
      const int head = in_token / job.segments_per_row;
      const int first_dim = (in_token - head * job.segments_per_row) * kSegment;
      const int64_t token = first_token + t;
      const InT* row = static_cast<const InT*>(job.in) +
                       (token * job.num_heads + head) * static_cast<int64_t>(job.width);
      float x[kSegment];
      Load16(row + first_dim, x);
      if (job.rotate && first_dim < 2 * params.rope_pairs) {
        Rotate16(x, row, first_dim, params.rope_pairs, params.interleaved, angles[t]);
      }
      if (job.page_ids == nullptr) {
        Store16(static_cast<InT*>(job.out) +
                    (token * job.num_heads + head) * static_cast<int64_t>(job.width) + first_dim,
                x);
      } else {
        if (job.scale != 1.0f) {
#pragma unroll
          for (int k = 0; k < kSegment; ++k) x[k] = __fdiv_rn(x[k], job.scale);
        }
        const int64_t page = job.page_ids[slot];
        Store16(static_cast<CacheT*>(job.out) + page * job.page_stride +
                    token_entry[t] * job.entry_stride + head * job.head_stride + first_dim,
                x);
      }
    }
  }
}

using AppendKernelFn = void (*)(AppendParams);

template <typename InT>
AppendKernelFn PickCache(DType cache_dtype) {
  switch (cache_dtype) {
    case DType::kFloat16:
      return &AppendKvKernel<InT, __half>;
    case DType::kBFloat16:
      return &AppendKvKernel<InT, __nv_bfloat16>;
    case DType::kFloat8E4M3:
      return &AppendKvKernel<InT, __nv_fp8_e4m3>;
    case DType::kFloat32:
      return nullptr;
  }
  return nullptr;
}

AppendKernelFn PickAppendKernel(DType in_dtype, DType cache_dtype) {
  if (in_dtype == DType::kFloat16) return PickCache<__half>(cache_dtype);
  if (in_dtype == DType::kBFloat16) return PickCache<__nv_bfloat16>(cache_dtype);
  return nullptr;
}

bool Aligned16(const void* pointer) { return reinterpret_cast<uintptr_t>(pointer) % 16 == 0; }

absl::Status CheckInput(const char* name, const TokenHeadsView& view, int64_t num_tokens,
                        DType dtype) {
  if (view.data == nullptr) return absl::InvalidArgumentError(absl::StrCat(name, ": null data"));
  if (view.num_tokens != num_tokens) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": ", view.num_tokens,
                                                   " tokens, expected ", num_tokens));
  }
  if (view.dtype != dtype) {
    return absl::InvalidArgumentError(absl::StrCat(name, ".dtype: expected ", DTypeName(dtype),
                                                   ", got ", DTypeName(view.dtype)));
  }
  if (view.num_heads <= 0 || view.head_dim <= 0 || view.head_dim % kSegment != 0) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": heads ", view.num_heads,
                                                   ", head_dim ", view.head_dim,
                                                   " (a positive multiple of 16)"));
  }
  if (!Aligned16(view.data)) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": not 16-byte aligned"));
  }
  return absl::OkStatus();
}

absl::Status CheckPool(const char* name, const PagedKvView& pool, const TokenHeadsView& in,
                       DType cache_dtype, int32_t page_size) {
  if (pool.data == nullptr || !Aligned16(pool.data)) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": null or not 16-byte aligned"));
  }
  if (pool.dtype != cache_dtype || pool.page_size != page_size) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": dtype ", DTypeName(pool.dtype),
                                                   " page_size ", pool.page_size, ", expected ",
                                                   DTypeName(cache_dtype), " and ", page_size));
  }
  if (pool.num_heads != in.num_heads || pool.head_dim != in.head_dim) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": [", pool.num_heads, "][",
                                                   pool.head_dim, "] per token, input has [",
                                                   in.num_heads, "][", in.head_dim, "]"));
  }
  return absl::OkStatus();
}

AppendJob DenseJob(const TokenHeadsView& in, const TokenHeadsView& out, bool rotate) {
  AppendJob job{};
  job.in = in.data;
  job.out = out.data;
  job.num_heads = in.num_heads;
  job.width = in.head_dim;
  job.segments_per_row = in.head_dim / kSegment;
  job.segments_per_token = in.num_heads * job.segments_per_row;
  job.rotate = rotate;
  job.scale = 1.0f;
  return job;
}

AppendJob PagedJob(const TokenHeadsView& in, const PagedKvView& pool, const int32_t* page_ids,
                   bool rotate, float scale) {
  AppendJob job = DenseJob(in, TokenHeadsView{}, rotate);
  job.out = pool.data;
  job.page_ids = page_ids;
  job.page_stride = pool.PageElements();
  if (pool.layout == KvLayout::kNHD) {
    job.entry_stride = int64_t{pool.num_heads} * pool.head_dim;
    job.head_stride = pool.head_dim;
  } else {
    job.entry_stride = pool.head_dim;
    job.head_stride = int64_t{pool.page_size} * pool.head_dim;
  }
  job.scale = scale;
  return job;
}

// Shared checks and launch of both entry points.
absl::Status LaunchAppend(AppendParams& params, const AppendIndexView& tokens,
                          const PageTableView& pages, RopeStyle rope_style,
                          const float* inv_freq, int32_t rotary_dim, DType in_dtype,
                          DType cache_dtype, cudaStream_t stream) {
  if (tokens.num_tokens == 0) return absl::OkStatus();
  if (tokens.batch_indices == nullptr || tokens.positions == nullptr || pages.indptr == nullptr ||
      pages.k_indices == nullptr || pages.v_indices == nullptr) {
    return absl::InvalidArgumentError("append: null token list or page table");
  }
  const int32_t page_size = pages.page_size;
  if (page_size <= 0 || (page_size & (page_size - 1)) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("page_size: expected a power of two, got ", page_size));
  }
  if (rope_style != RopeStyle::kNone) {
    if (rotary_dim <= 0 || rotary_dim % 2 != 0 || rotary_dim > 2 * kMaxRopePairs ||
        inv_freq == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(
          "rotary_dim: expected an even 2..256 with its inv_freq table, got ", rotary_dim));
    }
    for (const AppendJob& job : params.jobs) {
      if (job.in != nullptr && job.rotate && rotary_dim > job.width) {
        return absl::InvalidArgumentError(absl::StrCat("rotary_dim ", rotary_dim,
                                                       " exceeds a rotated head of ", job.width));
      }
    }
    params.inv_freq = inv_freq;
    params.rope_pairs = rotary_dim / 2;
    params.interleaved = rope_style == RopeStyle::kInterleaved;
  } else {
    for (AppendJob& job : params.jobs) job.rotate = false;
  }
  for (const AppendJob& job : params.jobs) {
    if (job.page_ids != nullptr && !(job.scale > 0.0f)) {
      return absl::InvalidArgumentError(absl::StrCat("scale: expected > 0, got ", job.scale));
    }
  }
  const AppendKernelFn kernel = PickAppendKernel(in_dtype, cache_dtype);
  if (kernel == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("append: no kernel for ", DTypeName(in_dtype),
                                                   " -> ", DTypeName(cache_dtype)));
  }
  params.num_tokens = tokens.num_tokens;
  params.batch_indices = tokens.batch_indices;
  params.positions = tokens.positions;
  params.page_indptr = pages.indptr;
  params.log2_page_size = 0;
  while ((1 << params.log2_page_size) < page_size) ++params.log2_page_size;

  const int64_t num_ctas = (tokens.num_tokens + kTokensPerCta - 1) / kTokensPerCta;
  void* kernel_args[] = {&params};
  CUDA_RETURN_IF_ERROR(cudaLaunchKernel(reinterpret_cast<const void*>(kernel),
                                        dim3(static_cast<unsigned>(num_ctas)), dim3(kAppendThreads),
                                        kernel_args, 0, stream));
  return absl::OkStatus();
}

}  // namespace

absl::Status AppendKv(const AppendKvArgs& args, cudaStream_t stream) {
  const int64_t num_tokens = args.tokens.num_tokens;
  if (num_tokens == 0) return absl::OkStatus();
  const DType in_dtype = args.k_in.dtype;
  if (in_dtype != DType::kFloat16 && in_dtype != DType::kBFloat16) {
    return absl::InvalidArgumentError(absl::StrCat("k_in.dtype: expected float16 or bfloat16, got ",
                                                   DTypeName(in_dtype)));
  }
  RETURN_IF_ERROR(CheckInput("k_in", args.k_in, num_tokens, in_dtype));
  RETURN_IF_ERROR(CheckInput("v_in", args.v_in, num_tokens, in_dtype));
  RETURN_IF_ERROR(
      CheckPool("k_cache", args.k_cache, args.k_in, args.k_cache.dtype, args.pages.page_size));
  RETURN_IF_ERROR(
      CheckPool("v_cache", args.v_cache, args.v_in, args.k_cache.dtype, args.pages.page_size));
  if (args.v_cache.layout != args.k_cache.layout) {
    return absl::InvalidArgumentError("v_cache: layout differs from k_cache");
  }
  const bool rotate = args.rope_style != RopeStyle::kNone;
  AppendParams params{};
  if (args.q_in.data != nullptr) {
    RETURN_IF_ERROR(CheckInput("q_in", args.q_in, num_tokens, in_dtype));
    RETURN_IF_ERROR(CheckInput("q_out", args.q_out, num_tokens, in_dtype));
    if (args.q_out.num_heads != args.q_in.num_heads || args.q_out.head_dim != args.q_in.head_dim) {
      return absl::InvalidArgumentError("q_out: shape differs from q_in");
    }
    params.jobs[0] = DenseJob(args.q_in, args.q_out, rotate);
  }
  params.jobs[1] = PagedJob(args.k_in, args.k_cache, args.pages.k_indices, rotate, args.k_scale);
  params.jobs[2] = PagedJob(args.v_in, args.v_cache, args.pages.v_indices, false, args.v_scale);
  return LaunchAppend(params, args.tokens, args.pages, args.rope_style, args.rope_inv_freq,
                      args.rotary_dim, in_dtype, args.k_cache.dtype, stream);
}

absl::Status AppendMla(const AppendMlaArgs& args, cudaStream_t stream) {
  const int64_t num_tokens = args.tokens.num_tokens;
  if (num_tokens == 0) return absl::OkStatus();
  const DType in_dtype = args.ckv_in.dtype;
  if (in_dtype != DType::kFloat16 && in_dtype != DType::kBFloat16) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ckv_in.dtype: expected float16 or bfloat16, got ", DTypeName(in_dtype)));
  }
  RETURN_IF_ERROR(CheckInput("ckv_in", args.ckv_in, num_tokens, in_dtype));
  RETURN_IF_ERROR(CheckInput("kpe_in", args.kpe_in, num_tokens, in_dtype));
  if (args.ckv_in.num_heads != 1 || args.kpe_in.num_heads != 1) {
    return absl::InvalidArgumentError("MLA: ckv and kpe have one head");
  }
  RETURN_IF_ERROR(CheckPool("ckv_cache", args.ckv_cache, args.ckv_in, args.ckv_cache.dtype,
                                   args.pages.page_size));
  RETURN_IF_ERROR(CheckPool("kpe_cache", args.kpe_cache, args.kpe_in, args.ckv_cache.dtype,
                                   args.pages.page_size));
  const bool rotate = args.rope_style != RopeStyle::kNone;
  const int32_t rope_dim = args.kpe_in.head_dim;
  AppendParams params{};
  if (args.q_pe_in.data != nullptr) {
    RETURN_IF_ERROR(CheckInput("q_pe_in", args.q_pe_in, num_tokens, in_dtype));
    RETURN_IF_ERROR(CheckInput("q_pe_out", args.q_pe_out, num_tokens, in_dtype));
    if (args.q_pe_in.head_dim != rope_dim || args.q_pe_out.head_dim != rope_dim ||
        args.q_pe_out.num_heads != args.q_pe_in.num_heads) {
      return absl::InvalidArgumentError("q_pe_in/q_pe_out: expected [T][H][rope_dim] each");
    }
    params.jobs[0] = DenseJob(args.q_pe_in, args.q_pe_out, rotate);
  }
  params.jobs[1] =
      PagedJob(args.ckv_in, args.ckv_cache, args.pages.k_indices, false, args.ckv_scale);
  params.jobs[2] = PagedJob(args.kpe_in, args.kpe_cache, args.pages.v_indices, rotate, args.kpe_scale);
  return LaunchAppend(params, args.tokens, args.pages, args.rope_style, args.rope_inv_freq,
                      rope_dim, in_dtype, args.ckv_cache.dtype, stream);
}

}  // namespace attnd::cuda
