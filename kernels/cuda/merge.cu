// Merge of attention partials (DESIGN 4.4). A CTA owns one (output row, head). Its threads
// are (4-dim slice of the head) x (partial group): group g sums partials g, g + groups, ... in
// slot order, then the groups are added in group order. Every assignment is fixed by the row's
// partial count alone, so the sum has one order whatever the rest of the batch is. No atomics.
// Splitting a row's partials over groups (and unrolling each group's loop) keeps many loads in
// flight: a one-request decode split 64 ways would otherwise wait out 64 L2 round trips.
#include <cuda_runtime.h>

#include <cmath>

#include "absl/strings/str_cat.h"
#include "attnd/kernels/cuda/cuda_check.h"
#include "attnd/kernels/cuda/merge.h"
#include "grid_signal.cuh"
#include "launch.cuh"
#include "vec.cuh"

namespace attnd::cuda {
namespace {

constexpr int kMergeThreads = 128;
constexpr int kMaxHeadDim = 4 * kMergeThreads;  // one 4-dim slice per thread at least
constexpr int kUnroll = 4;

struct MergeParams {
  const float* partial_o;
  const float* partial_lse;
  const int32_t* indptr;
  const int32_t* out_rows;
  int32_t num_heads;
  int32_t head_dim;
  void* o;
  DType o_dtype;
  float* lse;
  GridSignal done;
};

__device__ __forceinline__ void Accumulate(float weight, const float4& value, float4& sum) {
  sum.x = fmaf(weight, value.x, sum.x);
  sum.y = fmaf(weight, value.y, sum.y);
  sum.z = fmaf(weight, value.z, sum.z);
  sum.w = fmaf(weight, value.w, sum.w);
}

__global__ void __launch_bounds__(kMergeThreads) MergeStatesKernel(const MergeParams params) {
  __shared__ float4 group_sums[kMergeThreads];
  __shared__ float group_denominators[kMergeThreads];
  __shared__ float warp_maxima[kMergeThreads / 32];

  // Launched as a programmatic dependent of the kernel that wrote the partials: wait for it. The
  // kernel after this one (the next layer's decode or prefill, programmatic dependents too) may
  // be scheduled at once: it reads its plan and page table while this grid runs, and waits for
  // it before reading anything a kernel writes.
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
  const int row = blockIdx.x;
  const int head = blockIdx.y;
  const int num_heads = params.num_heads;
  const int slices = params.head_dim / 4;
  const int groups = kMergeThreads / slices;
  const int slice = threadIdx.x % slices;
  const int group = threadIdx.x / slices;
  const int32_t begin = params.indptr[row];
  const int32_t end = params.indptr[row + 1];
  const int64_t out_row = params.out_rows != nullptr ? params.out_rows[row] : row;

  // The largest lse of the head over the row's partials (a max: exact in any order). A NaN lse
  // (a partial that saw a non-finite input: its o is NaN too) lifts it to +inf, which fmaxf
  // keeps: every weight is then exp(finite - inf) = 0 or NaN, so the row comes out NaN in o and
  // lse, never masked (NaN in, NaN out; fmaxf alone would drop the NaN).
  float max_lse = -INFINITY;
  for (int32_t p = begin + threadIdx.x; p < end; p += kMergeThreads) {
    const float lse = params.partial_lse[int64_t{p} * num_heads + head];
    max_lse = isnan(lse) ? INFINITY : fmaxf(max_lse, lse);
  }
#pragma unroll
  for (int offset = 16; offset >= 1; offset /= 2)
    max_lse = fmaxf(max_lse, __shfl_xor_sync(0xffffffffu, max_lse, offset));
  if (threadIdx.x % 32 == 0) warp_maxima[threadIdx.x / 32] = max_lse;
  __syncthreads();
  max_lse = warp_maxima[0];
#pragma unroll
  for (int w = 1; w < kMergeThreads / 32; ++w) max_lse = fmaxf(max_lse, warp_maxima[w]);

  float4 sum = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  float denominator = 0.0f;
  if (group < groups && max_lse != -INFINITY) {
    // A partial that saw no key has lse -inf: weight 0, and its o is 0, not NaN.
    const int64_t column = int64_t{head} * params.head_dim + slice * 4;
    const int64_t row_stride = int64_t{num_heads} * params.head_dim;
    int32_t p = begin + group;
    for (; p + (kUnroll - 1) * groups < end; p += kUnroll * groups) {
      float lse[kUnroll];
      float4 value[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t partial = p + u * groups;
        lse[u] = params.partial_lse[partial * num_heads + head];
        value[u] = *reinterpret_cast<const float4*>(params.partial_o + partial * row_stride + column);
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const float weight = expf(lse[u] - max_lse);
        denominator += weight;
        Accumulate(weight, value[u], sum);
      }
    }
    for (; p < end; p += groups) {
      const float weight = expf(params.partial_lse[int64_t{p} * num_heads + head] - max_lse);
      denominator += weight;
      Accumulate(weight, *reinterpret_cast<const float4*>(params.partial_o + p * row_stride + column), sum);
    }
  }
  group_sums[threadIdx.x] = sum;
  group_denominators[threadIdx.x] = denominator;
  __syncthreads();
  // Group 0 stores the row; the others stay for the grid's done signal.
  if (group == 0) {
    float lse = -INFINITY;
    if (max_lse != -INFINITY) {
      sum = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      denominator = 0.0f;
      for (int g = 0; g < groups; ++g) {
        const float4 part = group_sums[g * slices + slice];
        sum.x += part.x;
        sum.y += part.y;
        sum.z += part.z;
        sum.w += part.w;
        denominator += group_denominators[g * slices + slice];
      }
      const float inverse = 1.0f / denominator;
      sum = make_float4(sum.x * inverse, sum.y * inverse, sum.z * inverse, sum.w * inverse);
      lse = max_lse + logf(denominator);
    }
    const int64_t offset = (out_row * num_heads + head) * params.head_dim + slice * 4;
    switch (params.o_dtype) {
      case DType::kFloat32:
        *reinterpret_cast<float4*>(static_cast<float*>(params.o) + offset) = sum;
        break;
      case DType::kBFloat16:
        *reinterpret_cast<uint2*>(static_cast<uint16_t*>(params.o) + offset) =
            make_uint2(PackFloat2<__nv_bfloat16>(sum.x, sum.y),
                       PackFloat2<__nv_bfloat16>(sum.z, sum.w));
        break;
      default:
        *reinterpret_cast<uint2*>(static_cast<uint16_t*>(params.o) + offset) =
            make_uint2(PackFloat2<__half>(sum.x, sum.y),
                       PackFloat2<__half>(sum.z, sum.w));
        break;
    }
    if (params.lse != nullptr && slice == 0) params.lse[out_row * num_heads + head] = lse;
  }
  SignalWhenGridDone(params.done);
}

}  // namespace

absl::Status MergeStates(const MergeStatesArgs& args, cudaStream_t stream) {
  if (args.num_rows < 0 || args.num_heads <= 0 || args.num_heads > 65535 || args.head_dim <= 0 ||
      args.head_dim % 4 != 0 || args.head_dim > kMaxHeadDim) {
    return absl::InvalidArgumentError(absl::StrCat("MergeStates: rows ", args.num_rows, ", heads ",
                                                   args.num_heads, ", head_dim ", args.head_dim,
                                                   " (a multiple of 4, at most ", kMaxHeadDim, ")"));
  }
  if (args.o.dtype == DType::kFloat8E4M3) {
    return absl::InvalidArgumentError("MergeStates: o must be float16, bfloat16 or float32");
  }
  if (args.o.num_heads != args.num_heads || args.o.head_dim != args.head_dim) {
    return absl::InvalidArgumentError(absl::StrCat("MergeStates: o is [*][", args.o.num_heads,
                                                   "][", args.o.head_dim, "], expected [*][",
                                                   args.num_heads, "][", args.head_dim, "]"));
  }
  if (args.num_rows == 0) return absl::OkStatus();
  if (args.partial_o == nullptr || args.partial_lse == nullptr || args.indptr == nullptr ||
      args.o.data == nullptr) {
    return absl::InvalidArgumentError("MergeStates: null partials, indptr or o");
  }
  if (reinterpret_cast<uintptr_t>(args.partial_o) % 16 != 0 ||
      reinterpret_cast<uintptr_t>(args.o.data) % 16 != 0) {
    return absl::InvalidArgumentError("MergeStates: partial_o and o must be 16-byte aligned");
  }
  MergeParams params{args.partial_o, args.partial_lse, args.indptr, args.out_rows,
                     args.num_heads,  args.head_dim,    args.o.data, args.o.dtype,
                     args.lse,        args.done};
  // Programmatic stream serialization (launch.cuh): the merge may be scheduled while the kernel
  // before it finishes (it waits for that kernel's results in griddepcontrol.wait).
  void* kernel_args[] = {&params};
  CUDA_RETURN_IF_ERROR(LaunchAfterPrecedingGrid(reinterpret_cast<const void*>(&MergeStatesKernel),
                                                dim3(args.num_rows, args.num_heads),
                                                dim3(kMergeThreads), 0, stream, kernel_args));
  return absl::OkStatus();
}

}  // namespace attnd::cuda
