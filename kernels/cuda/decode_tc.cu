// Batch decode on tensor cores (issue 14): the instantiations of decode_tc.cuh and their
// launcher. Twenty-four kernels: head_dim 64/128/256 x fp16/bf16 (q and cache of one type), and
// fp16/bf16 q over an fp8 e4m3 cache at head_dim 128 (two pipelines) and 256, each with or
// without a soft cap; the group (1..16, padded to 16 rows) and the output type are runtime
// parameters.
#include <cuda_runtime.h>

#include "absl/strings/str_cat.h"
#include "attnd/kernels/cuda/decode.h"
#include "attnd/kernels/cuda/cuda_check.h"
#include "decode_tc.cuh"
#include "decode_tc_launch.h"
#include "launch.cuh"
#include "softmax.cuh"

namespace attnd::cuda {
namespace {

using decode_tc::TcDecodeParams;
using decode_tc::TcShape;
using KernelFn = void (*)(TcDecodeParams);

struct Kernel {
  KernelFn function = nullptr;
  int smem_bytes = 0;
};

template <int kHeadDim, typename T, typename KvT, bool kShallow = false>
Kernel Instance(bool soft_cap) {
  return {soft_cap ? &decode_tc::TensorCoreDecodeKernel<kHeadDim, T, KvT, true, kShallow>
                   : &decode_tc::TensorCoreDecodeKernel<kHeadDim, T, KvT, false, kShallow>,
          TcShape<kHeadDim, sizeof(KvT), kShallow>::kSmemBytes};
}

// q's type T over a cache of T itself or, from head_dim 128 (8+ chunks a row), of fp8 (at 128,
// `shallow` picks its 4-stage pipeline).
template <int kHeadDim, typename T>
Kernel PickCache(DType kv_dtype, DType q_dtype, bool soft_cap, bool shallow) {
  if (kv_dtype == q_dtype) return Instance<kHeadDim, T, T>(soft_cap);
  if constexpr (kHeadDim == 128) {
    if (kv_dtype == DType::kFloat8E4M3) {
      return shallow ? Instance<kHeadDim, T, __nv_fp8_e4m3, true>(soft_cap)
                     : Instance<kHeadDim, T, __nv_fp8_e4m3>(soft_cap);
    }
  } else if constexpr (kHeadDim > 128) {
    if (kv_dtype == DType::kFloat8E4M3) return Instance<kHeadDim, T, __nv_fp8_e4m3>(soft_cap);
  }
  return {};
}

template <int kHeadDim>
Kernel PickType(const DecodeKernelConfig& config, bool soft_cap, bool shallow) {
  switch (config.q_dtype) {
    case DType::kFloat16:
      return PickCache<kHeadDim, __half>(config.kv_dtype, config.q_dtype, soft_cap, shallow);
    case DType::kBFloat16:
      return PickCache<kHeadDim, __nv_bfloat16>(config.kv_dtype, config.q_dtype, soft_cap, shallow);
    default:
      return {};
  }
}

// The kernel of `config` (with or without the soft cap's code: both have the same shared memory
// and occupancy, so the occupancy query may take either; the wave is the default pipeline's).
Kernel PickKernel(const DecodeKernelConfig& config, bool soft_cap = false, bool shallow = false) {
  // Every group, down to 1 (MHA): most of the MMA's 16 rows are padding there, but the kernel's
  // loads are what bound it, and on an H200 (2026-12-02, docs/benchmarks.md) it beat the CUDA-core
  // kernel at groups 1 and 2 too (e.g. Hq 32 / Hkv 32 / D 128, 16 x 1024 keys: 64.0 against
  // 88.4 us; Hq 16 / Hkv 8 / D 256, 16 x 4096: 124.9 against 143.7).
  if (config.group_size < 1 || config.group_size > decode_tc::kMaxGroup) return {};
  switch (config.head_dim) {
    case 64:
      return PickType<64>(config, soft_cap, shallow);
    case 128:
      return PickType<128>(config, soft_cap, shallow);
    case 256:
      return PickType<256>(config, soft_cap, shallow);
  }
  return {};
}

absl::Status Unsupported(const DecodeKernelConfig& config) {
  return absl::InvalidArgumentError(absl::StrCat(
      "tensor-core decode: no kernel for q ", DTypeName(config.q_dtype), ", kv ",
      DTypeName(config.kv_dtype), ", head_dim ", config.head_dim, ", group ", config.group_size,
      " (q fp16 or bf16 with a cache of q's type at head_dim 64/128/256, or of fp8 e4m3 at "
      "head_dim 128/256; group 1..16)"));
}

// Opts the kernel into its dynamic shared memory (above the 48 KB default); idempotent.
cudaError_t Prepare(const Kernel& kernel) {
  return cudaFuncSetAttribute(reinterpret_cast<const void*>(kernel.function),
                              cudaFuncAttributeMaxDynamicSharedMemorySize, kernel.smem_bytes);
}

}  // namespace

bool TensorCoreDecodeSupports(const DecodeKernelConfig& config) {
  return PickKernel(config).function != nullptr;
}

absl::StatusOr<int32_t> TensorCoreDecodeCtasPerWave(const DecodeKernelConfig& config) {
  const Kernel kernel = PickKernel(config);
  if (kernel.function == nullptr) return Unsupported(config);
  int device = 0;
  int num_sms = 0;
  int ctas_per_sm = 0;
  CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, device));
  int max_smem_bytes = 0;
  CUDA_RETURN_IF_ERROR(
      cudaDeviceGetAttribute(&max_smem_bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  if (kernel.smem_bytes > max_smem_bytes) return 0;  // e.g. head_dim 256 on an A100
  CUDA_RETURN_IF_ERROR(Prepare(kernel));
  CUDA_RETURN_IF_ERROR(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
      &ctas_per_sm, reinterpret_cast<const void*>(kernel.function), decode_tc::kThreads,
      kernel.smem_bytes));
  return ctas_per_sm * num_sms;
}

absl::Status LaunchTensorCoreDecode(const BatchDecodeArgs& args, int32_t log2_page_size,
                                    float* partial_o, float* partial_lse, cudaStream_t stream) {
  const PagedKvView& k = args.k_cache;
  const DecodeKernelConfig config{args.q.dtype, k.dtype, args.q.head_dim,
                                  args.q.num_heads / k.num_heads};
  // The one scaling and soft-cap rule (softmax.cuh); cap_log2 stays 0 without a cap.
  const float score_scale = args.params.sm_scale * args.params.k_scale;
  const SoftmaxParams softmax = SoftmaxParams::Of(score_scale, args.params.logits_soft_cap);
  // fp8 at head_dim 128 has two pipelines: 5 stages at 2 CTAs an SM (its wave, the planner's),
  // and 4 stages at 3, which pays only for launches of more CTAs than the first's wave with chunks
  // under 1024 keys. On an H200 (2026-12-02, docs/benchmarks.md) the deep one took 1 x 4096 keys in
  // 8.2 us against 10.9, 16 x 1024 in 17.5 against 22.2 and 256 x 4096 in 524 against 543; the
  // shallow one 128 x 512 in 42.7 against 48.0 and 128 x 65 in 16.4 against 19.2.
  const int64_t ctas = int64_t{args.work.num_items} * k.num_heads;
  bool shallow = false;
  if (k.dtype == DType::kFloat8E4M3 && config.head_dim == 128 && args.work.kv_chunk_tokens < 1024) {
    int device = 0;
    int num_sms = 0;
    CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
    CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, device));
    shallow = ctas > int64_t{TcShape<128, 1>::kMinCtasPerSm} * num_sms;
  }
  const Kernel kernel = PickKernel(config, softmax.soft_cap, shallow);
  if (kernel.function == nullptr) return Unsupported(config);

  const int64_t element_bytes = DTypeBytes(k.dtype);
  TcDecodeParams params{};
  params.q = args.q.data;
  params.o = args.o.data;
  params.lse = args.lse;
  params.k_pool = static_cast<const uint8_t*>(k.data);
  params.v_pool = static_cast<const uint8_t*>(args.v_cache.data);
  params.page_stride_bytes = k.PageElements() * element_bytes;
  if (k.layout == KvLayout::kNHD) {
    params.entry_stride_bytes = int64_t{k.num_heads} * k.head_dim * element_bytes;
    params.head_stride_bytes = int64_t{k.head_dim} * element_bytes;
  } else {
    params.entry_stride_bytes = int64_t{k.head_dim} * element_bytes;
    params.head_stride_bytes = int64_t{k.page_size} * k.head_dim * element_bytes;
  }
  params.page_indptr = args.pages.indptr;
  params.k_indices = args.pages.k_indices;
  params.v_indices = args.pages.v_indices;
  params.work = args.work;
  params.partial_o = partial_o;
  params.partial_lse = partial_lse;
  params.num_qo_heads = args.q.num_heads;
  params.num_kv_heads = k.num_heads;
  params.group_size = config.group_size;
  params.log2_page_size = log2_page_size;
  params.score_scale_log2 = score_scale * kLog2e;
  params.cap_input_scale = softmax.cap_input_scale;
  params.cap_log2 = softmax.soft_cap ? softmax.cap_log2 : 0.0f;
  params.v_scale = args.params.v_scale;
  params.o_bf16 = args.o.dtype == DType::kBFloat16;
  // The last grid of the launch signals: the merge where the plan splits (BatchDecode).
  if (args.work.num_merge_rows == 0) params.done = args.done;

  CUDA_RETURN_IF_ERROR(Prepare(kernel));
  void* kernel_args[] = {&params};
  CUDA_RETURN_IF_ERROR(LaunchAfterPrecedingGrid(
      reinterpret_cast<const void*>(kernel.function),
      dim3(static_cast<unsigned>(ctas)),
      dim3(decode_tc::kThreads), static_cast<size_t>(kernel.smem_bytes), stream, kernel_args));
  return absl::OkStatus();
}

}  // namespace attnd::cuda
