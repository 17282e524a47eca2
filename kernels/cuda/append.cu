// Fused RoPE + quantise + paged append (DESIGN 4.1). A CTA takes kTokensPerCta tokens: it looks
// up each token's page slot and computes its rotary cos/sin once (shared by every head), while
// every thread already loads its first 16-element segment; then the threads walk the tokens'
// segments, loading the next segment before transforming the current one so two are in flight.
// A launch runs up to three "jobs" over the same tokens, walked as one flat segment list: MHA
// q (dense, rotated), k (paged, rotated), v (paged); MLA q_pe (dense, rotated), ckv (paged),
// kpe (paged, rotated). Loads and stores are 16 bytes wide.
#include <cuda_runtime.h>

#include "absl/strings/str_cat.h"
#include "attnd/kernels/cuda/append.h"
#include "attnd/status_macros.h"
#include "cuda_check.h"
#include "vec.cuh"

namespace attnd::cuda {
namespace {

constexpr int kAppendThreads = 256;
constexpr int kTokensPerCta = 8;
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
  int32_t log2_segments_per_row;  // width / 16 is a power of two (widths 64..512)
  int32_t segments_per_token;     // 0: job absent
  bool rotate;
  float scale;          // paged: stores value / scale ...
  float inverse_scale;  // ... computed as a correctly rounded quotient from 1 / scale
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

// value / scale, correctly rounded, from the reciprocal: q = value * (1/scale) is within an ulp,
// the residual value - q * scale is exact in one FMA, and one correction step rounds correctly
// (Markstein) — three instructions instead of a full division.
__device__ __forceinline__ float DivideByScale(float value, float scale, float inverse_scale) {
  const float quotient = value * inverse_scale;
  const float residual = fmaf(-quotient, scale, value);
  return fmaf(residual, inverse_scale, quotient);
}

// Where segment `index` of a CTA's flat list lies: job, token in the CTA, head, first dim.
struct Segment {
  int job;
  int token;  // in the CTA; >= the CTA's token count: nothing to do
  int head;
  int first_dim;
};

__device__ __forceinline__ Segment Locate(const AppendParams& params, int index) {
  Segment segment;
  segment.job = 0;
#pragma unroll
  for (int j = 0; j < kMaxJobs - 1; ++j) {
    const int job_segments = kTokensPerCta * params.jobs[segment.job].segments_per_token;
    if (index >= job_segments) {
      index -= job_segments;
      ++segment.job;
    }
  }
  const AppendJob& job = params.jobs[segment.job];
  segment.token = index / job.segments_per_token;
  const int in_token = index - segment.token * job.segments_per_token;
  segment.head = in_token >> job.log2_segments_per_row;
  segment.first_dim = (in_token - (segment.head << job.log2_segments_per_row)) * kSegment;
  return segment;
}

// The raw input bytes of a segment, and of its neox partner segment when that is one aligned
// vector (the half rotary width a multiple of 16).
struct SegmentData {
  uint4 value[2];
  uint4 partner[2];
};

template <typename InT>
__device__ __forceinline__ const InT* InputRow(const AppendParams& params, const Segment& segment,
                                               int64_t first_token) {
  const AppendJob& job = params.jobs[segment.job];
  return static_cast<const InT*>(job.in) +
         ((first_token + segment.token) * job.num_heads + segment.head) * static_cast<int64_t>(job.width);
}

__device__ __forceinline__ bool HasVectorPartner(const AppendParams& params, const Segment& segment) {
  return params.jobs[segment.job].rotate && !params.interleaved && params.rope_pairs % kSegment == 0 &&
         segment.first_dim + kSegment <= 2 * params.rope_pairs;
}

template <typename InT>
__device__ __forceinline__ void LoadSegment(const AppendParams& params, const Segment& segment,
                                            int64_t first_token, int tokens_here, SegmentData& data) {
  if (segment.token >= tokens_here) return;
  const InT* row = InputRow<InT>(params, segment, first_token);
  const uint4* source = reinterpret_cast<const uint4*>(row + segment.first_dim);
  data.value[0] = source[0];
  data.value[1] = source[1];
  if (HasVectorPartner(params, segment)) {
    const int pairs = params.rope_pairs;
    const int partner_dim = segment.first_dim < pairs ? segment.first_dim + pairs : segment.first_dim - pairs;
    const uint4* partner = reinterpret_cast<const uint4*>(row + partner_dim);
    data.partner[0] = partner[0];
    data.partner[1] = partner[1];
  }
}

// Rotates the elements of x (dims [first_dim, first_dim + 16) of `row`) that fall in the
// rotary range. Products and sums are rounded separately (no FMA contraction), as the
// reference's float arithmetic does, so both store the same bits for the same cos/sin.
template <typename InT>
__device__ __forceinline__ void Rotate16(float* x, const AppendParams& params, const Segment& segment,
                                         const SegmentData& data, const InT* row, const float2* angles) {
  const int pairs = params.rope_pairs;
  const int rotary_dim = 2 * pairs;
  const int first_dim = segment.first_dim;
  if (params.interleaved) {
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
  // Neox: dim pairs (i, i + pairs).
  float partner[kSegment];
  if (HasVectorPartner(params, segment)) {
    Raw8ToFloat<InT>(data.partner[0], partner);
    Raw8ToFloat<InT>(data.partner[1], partner + 8);
  } else {
#pragma unroll
    for (int k = 0; k < kSegment; ++k) {
      const int dim = first_dim + k;
      partner[k] = dim < rotary_dim ? LoadOne(row + (dim < pairs ? dim + pairs : dim - pairs)) : 0.0f;
    }
  }
#pragma unroll
  for (int k = 0; k < kSegment; ++k) {
    const int dim = first_dim + k;
    if (dim < pairs) {
      const float2 angle = angles[dim];
      x[k] = __fsub_rn(__fmul_rn(x[k], angle.x), __fmul_rn(partner[k], angle.y));
    } else if (dim < rotary_dim) {
      const float2 angle = angles[dim - pairs];
      x[k] = __fadd_rn(__fmul_rn(partner[k], angle.y), __fmul_rn(x[k], angle.x));
    }
  }
}

template <typename InT, typename CacheT>
// Capped at 80 registers (3 CTAs an SM): uncapped it takes 120 and halves the resident threads.
__global__ void __launch_bounds__(kAppendThreads, 3) AppendKvKernel(const AppendParams params) {
  __shared__ float2 angles[kTokensPerCta][kMaxRopePairs];  // (cos, sin) per token and pair
  __shared__ int32_t token_slot[kTokensPerCta];  // index into the page-id arrays; -1: skip
  __shared__ int32_t token_entry[kTokensPerCta];

  const int64_t first_token = static_cast<int64_t>(blockIdx.x) * kTokensPerCta;
  const int tokens_here = static_cast<int>(min(static_cast<int64_t>(kTokensPerCta), params.num_tokens - first_token));
  int total = 0;
#pragma unroll
  for (int j = 0; j < kMaxJobs; ++j) total += kTokensPerCta * params.jobs[j].segments_per_token;

  // The first segment's loads go out before the CTA waits for its tokens' slots and angles.
  int index = threadIdx.x;
  Segment segment{};
  SegmentData data{};
  if (index < total) {
    segment = Locate(params, index);
    LoadSegment<InT>(params, segment, first_token, tokens_here, data);
  }

  if (threadIdx.x < kTokensPerCta) {
    int32_t slot = -1;
    int32_t entry = 0;
    if (static_cast<int>(threadIdx.x) < tokens_here) {
      const int32_t request = params.batch_indices[first_token + threadIdx.x];
      if (request >= 0) {  // -1 is a padding slot: no byte of it is touched
        const int32_t position = params.positions[first_token + threadIdx.x];
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
    if (t < tokens_here && params.batch_indices[first_token + t] >= 0) {
      // Angle in float32 as the reference computes it, float(position) * inv_freq; cos and sin
      // in double, rounded once, so they are the correctly rounded values the host's float cos
      // and sin (nearly always) give too.
      const float angle = static_cast<float>(params.positions[first_token + t]) * params.inv_freq[pair];
      double sine, cosine;
      sincos(static_cast<double>(angle), &sine, &cosine);
      angles[t][pair] = make_float2(static_cast<float>(cosine), static_cast<float>(sine));
    }
  }
  __syncthreads();

  while (index < total) {
    // Load the next segment before transforming this one: two segments in flight per thread.
    const int next_index = index + kAppendThreads;
    Segment next = segment;
    SegmentData next_data{};
    if (next_index < total) {
      next = Locate(params, next_index);
      LoadSegment<InT>(params, next, first_token, tokens_here, next_data);
    }

    if (segment.token < tokens_here && token_slot[segment.token] >= 0) {
      const AppendJob& job = params.jobs[segment.job];
      const int64_t token = first_token + segment.token;
      float x[kSegment];
      Raw8ToFloat<InT>(data.value[0], x);
      Raw8ToFloat<InT>(data.value[1], x + 8);
      if (job.rotate && segment.first_dim < 2 * params.rope_pairs) {
        Rotate16<InT>(x, params, segment, data, InputRow<InT>(params, segment, first_token),
                      angles[segment.token]);
      }
      if (job.page_ids == nullptr) {
        Store16(static_cast<InT*>(job.out) +
                    (token * job.num_heads + segment.head) * static_cast<int64_t>(job.width) +
                    segment.first_dim,
                x);
      } else {
        if (job.scale != 1.0f) {
#pragma unroll
          for (int k = 0; k < kSegment; ++k) x[k] = DivideByScale(x[k], job.scale, job.inverse_scale);
        }
        const int64_t page = job.page_ids[token_slot[segment.token]];
        Store16(static_cast<CacheT*>(job.out) + page * job.page_stride +
                    token_entry[segment.token] * job.entry_stride + segment.head * job.head_stride +
                    segment.first_dim,
                x);
      }
    }
    index = next_index;
    segment = next;
    data = next_data;
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
  const int32_t segments_per_row = view.head_dim / kSegment;
  if (view.num_heads <= 0 || view.head_dim <= 0 || view.head_dim % kSegment != 0 ||
      (segments_per_row & (segments_per_row - 1)) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": heads ", view.num_heads,
                                                   ", head_dim ", view.head_dim,
                                                   " (16 times a power of two, e.g. 64..512)"));
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
  const int32_t segments_per_row = in.head_dim / kSegment;
  while ((1 << job.log2_segments_per_row) < segments_per_row) ++job.log2_segments_per_row;
  job.segments_per_token = in.num_heads * segments_per_row;
  job.rotate = rotate;
  job.scale = 1.0f;
  job.inverse_scale = 1.0f;
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
  job.inverse_scale = 1.0f / scale;
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
