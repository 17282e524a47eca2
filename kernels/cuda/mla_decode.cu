// MLA decode launcher (DESIGN 4.6): validates the views, resolves the scales, launches the
// kernel of the (rank, dtypes) on one CTA per plan unit, then MergeStates for split requests.
#include <cuda.h>  // CUtensorMap and its enums (types only: cuTensorMapEncodeTiled is looked up)
#include <cuda_runtime.h>
#include <cudaTypedefs.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "attnd/kernels/cuda/cuda_check.h"
#include "attnd/kernels/cuda/merge.h"
#include "attnd/kernels/cuda/mla_decode.h"
#include "attnd/status_macros.h"
#include "mla_decode_kernel.cuh"

namespace attnd::cuda {
namespace {

constexpr int64_t kWorkspaceAlignment = 256;

bool Is16Bit(DType dtype) { return dtype == DType::kFloat16 || dtype == DType::kBFloat16; }

bool Aligned16(const void* pointer) { return reinterpret_cast<uintptr_t>(pointer) % 16 == 0; }

int64_t PartialLseOffsetBytes(int32_t num_partials, int32_t num_heads, int32_t kv_lora_rank) {
  const int64_t o_bytes = int64_t{num_partials} * num_heads * kv_lora_rank * 4;
  return (o_bytes + kWorkspaceAlignment - 1) / kWorkspaceAlignment * kWorkspaceAlignment;
}

// Whether this device runs the Hopper kernels: compute capability 9.0 and an sm_90a build.
bool HopperDevice() {
#if ATTND_MLA_HOPPER
  int device = 0, major = 0, minor = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) {
    return false;
  }
  return major == 9 && minor == 0;
#else
  return false;
#endif
}

// The shapes both Hopper kernels take: q 16-bit, rank 512 or 256, rope 64.
bool HopperShape(const MlaDecodeConfig& config) {
  return Is16Bit(config.q_dtype) && config.rope_dim == mla::kRopeDim &&
         (config.kv_lora_rank == 512 || config.kv_lora_rank == 256);
}

// The kernel that runs for `config` (scales_equal: kpe_scale == ckv_scale); error when a forced
// Hopper kernel does not apply. The wide-tile kernel takes caches of q's type or fp8 e4m3 and any
// scales; the split-K kernel (kHopper) caches of q's type with equal scales.
absl::StatusOr<MlaKernel> ResolveKernel(const MlaDecodeConfig& config, bool scales_equal) {
  const bool hopper = HopperShape(config) && HopperDevice();
  const bool wide = hopper && (config.kv_dtype == config.q_dtype || config.kv_dtype == DType::kFloat8E4M3);
  switch (config.kernel) {
    case MlaKernel::kMmaSync:
      return MlaKernel::kMmaSync;
    case MlaKernel::kHopper:
      if (!hopper || config.kv_dtype != config.q_dtype || !scales_equal) {
        return absl::InvalidArgumentError(
            "MLA decode: the split-K Hopper kernel needs compute capability 9.0, an sm_90a build, q and "
            "cache of one 16-bit type and kpe_scale == ckv_scale");
      }
      return MlaKernel::kHopper;
    case MlaKernel::kHopperWide:
      if (!wide) {
        return absl::InvalidArgumentError(
            "MLA decode: the wide-tile Hopper kernel needs compute capability 9.0, an sm_90a build, q 16-bit "
            "and a cache of q's type or fp8_e4m3");
      }
      return MlaKernel::kHopperWide;
    case MlaKernel::kAuto:
      break;
  }
  // The wide-tile kernel where it applies: on the H100 it took 64 x 8192 keys in 350 us against
  // the two-CTA kernel's 442, 16 and 128 x 8192 likewise faster (mla_bench --hopper_variant=both,
  // docs/benchmarks.md).
  return wide ? MlaKernel::kHopperWide : MlaKernel::kMmaSync;
}

// cuTensorMapEncodeTiled through the runtime's driver entry points (nothing links libcuda);
// null where the driver lacks it.
PFN_cuTensorMapEncodeTiled_v12000 TensorMapEncoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* function = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &function, 12000, cudaEnableDefault, &found) !=
            cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      cudaGetLastError();
      return static_cast<PFN_cuTensorMapEncodeTiled_v12000>(nullptr);
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(function);
  }();
  return encode;
}

// A 16-bit pool as the 2D tensor [rows][columns] with 64 x 64 boxes in the 128-byte swizzle.
bool EncodePoolMap(const void* pool, int64_t rows, int32_t columns, CUtensorMap* map) {
  const PFN_cuTensorMapEncodeTiled_v12000 encode = TensorMapEncoder();
  if (encode == nullptr) return false;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(columns), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(columns) * 2};
  const cuuint32_t box[2] = {64, 64};
  const cuuint32_t element_strides[2] = {1, 1};
  return encode(map, CU_TENSOR_MAP_DATA_TYPE_UINT16, 2, const_cast<void*>(pool), dims, strides, box, element_strides,
                CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// Whether the wide-tile kernel loads whole tiles with TMA: 16-bit caches with pages of 64+ keys
// whose rows a 32-bit coordinate reaches, unless ATTND_MLA_TMA=0 (for measurement). false where
// a map cannot be made: the kernel's cp.async loads serve every tile then. The maps bound every
// read to the pools the views describe.
bool SetUpTma(const MlaDecodeArgs& args, mla::MlaParams* params) {
  static const bool enabled = [] {
    const char* value = std::getenv("ATTND_MLA_TMA");
    return value == nullptr || std::strcmp(value, "0") != 0;
  }();
  const PagedKvView& ckv = args.ckv_cache;
  const PagedKvView& kpe = args.kpe_cache;
  const int64_t ckv_rows = ckv.num_pages * int64_t{ckv.page_size};
  const int64_t kpe_rows = kpe.num_pages * int64_t{kpe.page_size};
  constexpr int64_t kRowLimit = int64_t{1} << 31;  // the kernel's row coordinates are 32-bit
  if (!enabled || !args.allow_tma || !Is16Bit(ckv.dtype) || ckv.page_size < 64 || ckv_rows <= 0 || kpe_rows <= 0 ||
      ckv_rows >= kRowLimit || kpe_rows >= kRowLimit) {
    return false;
  }
  return EncodePoolMap(ckv.data, ckv_rows, ckv.head_dim, &params->ckv_map) &&
         EncodePoolMap(kpe.data, kpe_rows, mla::kRopeDim, &params->kpe_map);
}

// Whether the wide-tile kernel (with TMA) runs in clusters of two CTAs sharing their tiles: where
// a token's rows are whole pairs of 64-row units (num_heads % 128 == 0, so the planner's units
// pair up as consecutive even/odd CTAs), unless ATTND_MLA_CLUSTER=0 (for measurement).
bool ClusterPairs(const MlaDecodeArgs& args) {
  static const bool enabled = [] {
    const char* value = std::getenv("ATTND_MLA_CLUSTER");
    return value == nullptr || std::strcmp(value, "0") != 0;
  }();
  return enabled && args.allow_cluster && args.q_nope.num_heads % (2 * plan::kMlaRowsPerCta) == 0 &&
         args.work.num_units % 2 == 0;
}

cudaError_t Launch(const mla::MlaParams& params, const MlaDecodeConfig& config, MlaKernel kernel,
                   int32_t num_ctas, cudaStream_t stream, int* ctas_per_sm) {
#if ATTND_MLA_HOPPER
  if (kernel == MlaKernel::kHopper) {
    return mla::LaunchMlaHopper(params, config.kv_lora_rank, config.q_dtype, num_ctas, stream, ctas_per_sm);
  }
  if (kernel == MlaKernel::kHopperWide) {
    return mla::LaunchMlaHopperWide(params, config.kv_lora_rank, config.q_dtype, config.kv_dtype, num_ctas, stream,
                                    ctas_per_sm);
  }
#else
  (void)kernel;
#endif
  return config.kv_lora_rank == 512
             ? mla::LaunchMlaR512(params, config.q_dtype, config.kv_dtype, num_ctas, stream, ctas_per_sm)
             : mla::LaunchMlaR256(params, config.q_dtype, config.kv_dtype, num_ctas, stream, ctas_per_sm);
}

absl::Status Validate(const MlaDecodeArgs& args, int* page_size_log2) {
  const TokenHeadsView& q_nope = args.q_nope;
  const TokenHeadsView& q_pe = args.q_pe;
  const PagedKvView& ckv = args.ckv_cache;
  const PagedKvView& kpe = args.kpe_cache;
  const MlaDecodeConfig config{q_nope.dtype, ckv.dtype, ckv.head_dim, kpe.head_dim};
  if (!MlaDecodeSupports(config)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "MLA decode: no kernel for q ", DTypeName(q_nope.dtype), ", cache ", DTypeName(ckv.dtype),
        ", kv_lora_rank ", ckv.head_dim, ", rope_dim ", kpe.head_dim,
        " (q fp16/bf16; cache fp16/bf16/fp8_e4m3; rank 512 or 256; rope_dim 64)"));
  }
  if (q_pe.dtype != q_nope.dtype) {
    return absl::InvalidArgumentError("q_pe.dtype: expected q_nope's dtype");
  }
  if (!Is16Bit(args.o.dtype)) {
    return absl::InvalidArgumentError(absl::StrCat("o.dtype: expected float16 or bfloat16, got ",
                                                   DTypeName(args.o.dtype)));
  }
  const int32_t num_heads = q_nope.num_heads;
  if (num_heads <= 0 || num_heads > 1024 || q_pe.num_heads != num_heads || args.o.num_heads != num_heads) {
    return absl::InvalidArgumentError(absl::StrCat("num_heads: q_nope ", num_heads, ", q_pe ",
                                                   q_pe.num_heads, ", o ", args.o.num_heads,
                                                   " must agree, 1..1024"));
  }
  if (q_nope.head_dim != ckv.head_dim || args.o.head_dim != ckv.head_dim || q_pe.head_dim != kpe.head_dim) {
    return absl::InvalidArgumentError(absl::StrCat(
        "head dims: q_nope ", q_nope.head_dim, ", o ", args.o.head_dim, " and ckv ", ckv.head_dim,
        " must agree; q_pe ", q_pe.head_dim, " and kpe ", kpe.head_dim, " must agree"));
  }
  if (ckv.num_heads != 1 || kpe.num_heads != 1 || kpe.dtype != ckv.dtype ||
      kpe.page_size != ckv.page_size) {
    return absl::InvalidArgumentError(
        "ckv/kpe caches: expected one latent head each, one dtype and one page size");
  }
  const int32_t page_size = ckv.page_size;
  if (page_size <= 0 || (page_size & (page_size - 1)) != 0 || args.pages.page_size != page_size) {
    return absl::InvalidArgumentError(absl::StrCat(
        "page_size: expected a power of two shared by table and pools, got ", page_size,
        " (table ", args.pages.page_size, ")"));
  }
  *page_size_log2 = 0;
  while ((1 << *page_size_log2) < page_size) ++*page_size_log2;
  if (args.work.num_units > 0 &&
      (q_nope.data == nullptr || q_pe.data == nullptr || args.o.data == nullptr ||
       ckv.data == nullptr || kpe.data == nullptr || args.pages.indptr == nullptr ||
       args.pages.k_indices == nullptr || args.pages.v_indices == nullptr ||
       args.work.units == nullptr)) {
    return absl::InvalidArgumentError("MlaDecode: null tensor, page table or plan pointer");
  }
  if (!Aligned16(q_nope.data) || !Aligned16(q_pe.data) || !Aligned16(args.o.data) ||
      !Aligned16(ckv.data) || !Aligned16(kpe.data) || !Aligned16(args.work.units)) {
    return absl::InvalidArgumentError("MlaDecode: q, o, the pools and the plan must be 16-byte aligned");
  }
  const int64_t needed = MlaDecodeWorkspaceBytes(args.work.num_partials, num_heads, ckv.head_dim);
  if (args.workspace_bytes < needed || (needed > 0 && args.workspace == nullptr) ||
      reinterpret_cast<uintptr_t>(args.workspace) % kWorkspaceAlignment != 0) {
    return absl::InvalidArgumentError(absl::StrCat("workspace: need ", needed,
                                                   " bytes, 256-byte aligned; got ",
                                                   args.workspace_bytes));
  }
  if (!(args.params.k_scale > 0.0f) || !(args.params.v_scale > 0.0f) || !std::isfinite(args.params.k_scale) ||
      !std::isfinite(args.params.v_scale)) {
    return absl::InvalidArgumentError("k_scale (ckv) and v_scale (kpe) must be finite and > 0");
  }
  return absl::OkStatus();
}

}  // namespace

bool MlaDecodeSupports(const MlaDecodeConfig& config) {
  return Is16Bit(config.q_dtype) &&
         (Is16Bit(config.kv_dtype) || config.kv_dtype == DType::kFloat8E4M3) &&
         (config.kv_lora_rank == 512 || config.kv_lora_rank == 256) && config.rope_dim == mla::kRopeDim;
}

absl::StatusOr<int32_t> MlaDecodeCtasPerWave(const MlaDecodeConfig& config) {
  if (!MlaDecodeSupports(config)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "MLA decode: no kernel for q ", DTypeName(config.q_dtype), ", cache ",
        DTypeName(config.kv_dtype), ", kv_lora_rank ", config.kv_lora_rank, ", rope_dim ",
        config.rope_dim));
  }
  int device = 0;
  int num_sms = 0;
  int ctas_per_sm = 0;
  CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, device));
  ASSIGN_OR_RETURN(const MlaKernel kernel, ResolveKernel(config, /*scales_equal=*/true));
  CUDA_RETURN_IF_ERROR(Launch(mla::MlaParams{}, config, kernel, 0, nullptr, &ctas_per_sm));
  if (ctas_per_sm <= 0) {
    return absl::InternalError("MLA decode: the kernel does not fit on an SM of this device");
  }
  int32_t ctas = ctas_per_sm * num_sms;
  if (kernel == MlaKernel::kHopperWide && Is16Bit(config.kv_dtype)) {
    // Caches of 128+ heads launch it in clusters of two, which need two free SMs of one GPC: the
    // wave is the clusters the device holds at once, where those are fewer.
    mla::MlaParams clustered{};
    clustered.cluster_pairs = true;
    int clusters = 0;
    CUDA_RETURN_IF_ERROR(Launch(clustered, config, kernel, 0, nullptr, &clusters));
    if (clusters > 0) ctas = std::min(ctas, 2 * clusters);
  }
  return ctas;
}

int64_t MlaDecodeWorkspaceBytes(int32_t num_partials, int32_t num_heads, int32_t kv_lora_rank) {
  if (num_partials <= 0) return 0;
  return PartialLseOffsetBytes(num_partials, num_heads, kv_lora_rank) +
         int64_t{num_partials} * num_heads * 4;
}

absl::Status MlaDecode(const MlaDecodeArgs& args, cudaStream_t stream) {
  int page_size_log2 = 0;
  RETURN_IF_ERROR(Validate(args, &page_size_log2));
  if (args.work.num_units == 0) return absl::OkStatus();

  const PagedKvView& ckv = args.ckv_cache;
  const int32_t rank = ckv.head_dim;
  const int stored_bytes = DTypeBytes(ckv.dtype);
  const AttentionParams& attention = args.params;
  mla::MlaParams params{};
  params.q_nope = args.q_nope.data;
  params.q_pe = args.q_pe.data;
  params.o = args.o.data;
  params.lse = args.lse;
  params.ckv_pool = static_cast<const uint8_t*>(ckv.data);
  params.kpe_pool = static_cast<const uint8_t*>(args.kpe_cache.data);
  params.ckv_page_bytes = int64_t{ckv.page_size} * rank * stored_bytes;
  params.kpe_page_bytes = int64_t{ckv.page_size} * mla::kRopeDim * stored_bytes;
  params.page_indptr = args.pages.indptr;
  params.ckv_page_ids = args.pages.k_indices;
  params.kpe_page_ids = args.pages.v_indices;
  params.units = args.work.units;
  params.num_heads = args.q_nope.num_heads;
  params.page_size_log2 = page_size_log2;
  params.window_left = attention.window_left;
  const float score_scale = attention.sm_scale * attention.k_scale;
  params.score_scale_log2 = score_scale * kLog2e;
  const bool soft_cap = attention.logits_soft_cap > 0.0f;
  params.cap_input_scale = soft_cap ? score_scale / attention.logits_soft_cap : 0.0f;
  params.cap_log2 = soft_cap ? attention.logits_soft_cap * kLog2e : 0.0f;
  params.pe_ratio = attention.v_scale / attention.k_scale;
  params.o_scale = attention.k_scale;
  params.q_bf16 = args.q_nope.dtype == DType::kBFloat16;
  params.o_bf16 = args.o.dtype == DType::kBFloat16;
  params.causal = attention.causal;
  const int32_t num_partials = args.work.num_partials;
  uint8_t* workspace = static_cast<uint8_t*>(args.workspace);
  params.partial_o = num_partials > 0 ? reinterpret_cast<float*>(workspace) : nullptr;
  params.partial_lse =
      num_partials > 0
          ? reinterpret_cast<float*>(workspace + PartialLseOffsetBytes(num_partials, params.num_heads, rank))
          : nullptr;

  const MlaDecodeConfig config{args.q_nope.dtype, ckv.dtype, rank, args.kpe_cache.head_dim, args.kernel};
  ASSIGN_OR_RETURN(const MlaKernel kernel, ResolveKernel(config, attention.k_scale == attention.v_scale));
  params.tma = kernel == MlaKernel::kHopperWide && SetUpTma(args, &params);
  params.cluster_pairs = params.tma && ClusterPairs(args);
  CUDA_RETURN_IF_ERROR(Launch(params, config, kernel, args.work.num_units, stream, nullptr));
  if (args.work.num_merge_rows == 0) return absl::OkStatus();

  MergeStatesArgs merge;
  merge.partial_o = params.partial_o;
  merge.partial_lse = params.partial_lse;
  merge.indptr = args.work.merge_indptr;
  merge.out_rows = args.work.merge_q_row;
  merge.num_rows = args.work.num_merge_rows;
  merge.num_heads = params.num_heads;
  merge.head_dim = rank;
  merge.o = args.o;
  merge.lse = args.lse;
  return MergeStates(merge, stream);
}

}  // namespace attnd::cuda
