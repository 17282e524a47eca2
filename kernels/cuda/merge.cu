// Merge of attention partials (DESIGN 4.4). A CTA owns one output row (a slice of its heads);
// each thread owns 4 dims of one head and walks the row's partials in slot order, so the sum
// has one fixed order whatever the rest of the batch is. No atomics.
#include <cuda_runtime.h>

#include <cmath>

#include "absl/strings/str_cat.h"
#include "attnd/kernels/cuda/merge.h"
#include "cuda_check.h"
#include "vec.cuh"

namespace attnd::cuda {
namespace {

constexpr int kMergeThreads = 128;

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
};

__global__ void __launch_bounds__(kMergeThreads) MergeStatesKernel(const MergeParams params) {
  const int row = blockIdx.x;
  const int slices_per_head = params.head_dim / 4;
  const int slice = blockIdx.y * kMergeThreads + threadIdx.x;
  if (slice >= params.num_heads * slices_per_head) return;
  const int head = slice / slices_per_head;
  const int dim = (slice % slices_per_head) * 4;
  const int32_t begin = params.indptr[row];
  const int32_t end = params.indptr[row + 1];
  const int64_t out_row = params.out_rows != nullptr ? params.out_rows[row] : row;

  float max_lse = -INFINITY;
  for (int32_t p = begin; p < end; ++p)
    max_lse = fmaxf(max_lse, params.partial_lse[int64_t{p} * params.num_heads + head]);

  float4 sum = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  float lse = -INFINITY;
  if (max_lse != -INFINITY) {
    float denominator = 0.0f;
    for (int32_t p = begin; p < end; ++p) {
      const int64_t partial_row = int64_t{p} * params.num_heads + head;
      // A partial that saw no key has lse -inf: weight 0, and its o is 0, not NaN.
      const float weight = expf(params.partial_lse[partial_row] - max_lse);
      const float4 value =
          *reinterpret_cast<const float4*>(params.partial_o + partial_row * params.head_dim + dim);
      denominator += weight;
      sum.x = fmaf(weight, value.x, sum.x);
      sum.y = fmaf(weight, value.y, sum.y);
      sum.z = fmaf(weight, value.z, sum.z);
      sum.w = fmaf(weight, value.w, sum.w);
    }
    const float inverse = 1.0f / denominator;
    sum = make_float4(sum.x * inverse, sum.y * inverse, sum.z * inverse, sum.w * inverse);
    lse = max_lse + logf(denominator);
  }

  const int64_t offset = (out_row * params.num_heads + head) * params.head_dim + dim;
  switch (params.o_dtype) {
    case DType::kFloat32:
      *reinterpret_cast<float4*>(static_cast<float*>(params.o) + offset) = sum;
      break;
    case DType::kBFloat16:
      *reinterpret_cast<uint2*>(static_cast<uint16_t*>(params.o) + offset) =
          make_uint2(PackFloat2(sum.x, sum.y, static_cast<__nv_bfloat16*>(nullptr)),
                     PackFloat2(sum.z, sum.w, static_cast<__nv_bfloat16*>(nullptr)));
      break;
    default:
      *reinterpret_cast<uint2*>(static_cast<uint16_t*>(params.o) + offset) =
          make_uint2(PackFloat2(sum.x, sum.y, static_cast<__half*>(nullptr)),
                     PackFloat2(sum.z, sum.w, static_cast<__half*>(nullptr)));
      break;
  }
  if (params.lse != nullptr && dim == 0) params.lse[out_row * params.num_heads + head] = lse;
}

}  // namespace

absl::Status MergeStates(const MergeStatesArgs& args, cudaStream_t stream) {
  if (args.num_rows < 0 || args.num_heads <= 0 || args.head_dim <= 0 || args.head_dim % 4 != 0) {
    return absl::InvalidArgumentError(absl::StrCat("MergeStates: rows ", args.num_rows, ", heads ",
                                                   args.num_heads, ", head_dim ", args.head_dim,
                                                   " (a multiple of 4)"));
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
                     args.lse};
  const int slices = args.num_heads * (args.head_dim / 4);
  const dim3 grid(args.num_rows, (slices + kMergeThreads - 1) / kMergeThreads);
  MergeStatesKernel<<<grid, kMergeThreads, 0, stream>>>(params);
  CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return absl::OkStatus();
}

}  // namespace attnd::cuda
