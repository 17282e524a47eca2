// Host launcher of batch prefill: validates the views against the plan, resolves strides and
// scales into KernelParams, and launches one kernel per query tile size of the plan. Plain C++
// (no device code), so Abseil never goes through nvcc.
#include "attnd/kernels/cuda/prefill.h"

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>

#include "attnd/status_macros.h"
#include "cuda_check.h"
#include "prefill_params.h"

namespace attnd::cuda {
namespace {

constexpr int64_t kWorkspaceAlignment = 256;

static_assert(sizeof(plan::PrefillWorkItem) == sizeof(prefill::WorkItem) &&
                  offsetof(plan::PrefillWorkItem, kv_chunk_end) == offsetof(prefill::WorkItem, kv_chunk_end),
              "the plan's items are copied bytewise into the kernel's");

bool Aligned16(const void* pointer) { return reinterpret_cast<uintptr_t>(pointer) % 16 == 0; }

absl::Status Invalid(const std::string& message) { return absl::InvalidArgumentError("BatchPrefill: " + message); }

absl::Status Validate(const plan::PrefillPlan& plan, const BatchPrefillArgs& args) {
  const int32_t head_dim = plan.head_dim;
  if (args.q.num_heads != plan.num_qo_heads || args.q.head_dim != head_dim) {
    return Invalid("q: expected [*][" + std::to_string(plan.num_qo_heads) + "][" + std::to_string(head_dim) +
                   "], got [*][" + std::to_string(args.q.num_heads) + "][" + std::to_string(args.q.head_dim) + "]");
  }
  if (args.q.num_tokens < plan.num_qo_rows) {
    return Invalid("q: the plan has " + std::to_string(plan.num_qo_rows) + " rows, q has " +
                   std::to_string(args.q.num_tokens));
  }
  if (args.q.dtype != DType::kFloat16 && args.q.dtype != DType::kBFloat16) {
    return absl::UnimplementedError("BatchPrefill: q dtype must be fp16 or bf16, got " +
                                    std::string(DTypeName(args.q.dtype)));
  }
  if (args.o.dtype != args.q.dtype || args.o.num_heads != args.q.num_heads || args.o.head_dim != head_dim ||
      args.o.num_tokens < plan.num_qo_rows) {
    return Invalid("o: expected q's dtype and shape");
  }
  for (const PagedKvView* cache : {&args.k_cache, &args.v_cache}) {
    if (cache->num_heads != plan.num_kv_heads || cache->head_dim != head_dim) {
      return Invalid("kv cache: expected " + std::to_string(plan.num_kv_heads) + " heads of " +
                     std::to_string(head_dim) + ", got " + std::to_string(cache->num_heads) + " of " +
                     std::to_string(cache->head_dim));
    }
    if (cache->dtype != DType::kFloat16 && cache->dtype != DType::kBFloat16 && cache->dtype != DType::kFloat8E4M3) {
      return absl::UnimplementedError("BatchPrefill: kv dtype must be fp16, bf16 or fp8_e4m3, got " +
                                      std::string(DTypeName(cache->dtype)));
    }
    if (cache->page_size != args.pages.page_size) return Invalid("kv cache page_size differs from the page table's");
    if (cache->data == nullptr || !Aligned16(cache->data)) return Invalid("kv cache data must be 16-byte aligned");
  }
  if (args.k_cache.dtype != args.v_cache.dtype || args.k_cache.layout != args.v_cache.layout) {
    return Invalid("k and v caches differ in dtype or layout");
  }
  const int32_t page_size = args.pages.page_size;
  if (page_size <= 0 || (page_size & (page_size - 1)) != 0) {
    return Invalid("page_size must be a power of two, got " + std::to_string(page_size));
  }
  if (args.pages.batch_size != plan.batch_size) {
    return Invalid("page table batch " + std::to_string(args.pages.batch_size) + " differs from the plan's " +
                   std::to_string(plan.batch_size));
  }
  if (args.qo_indptr == nullptr || args.pages.indptr == nullptr || args.pages.k_indices == nullptr ||
      args.pages.v_indices == nullptr || args.pages.last_page_len == nullptr) {
    return Invalid("qo_indptr and every page table array must be set");
  }
  if (!Aligned16(args.q.data) || !Aligned16(args.o.data)) return Invalid("q and o must be 16-byte aligned");
  const AttentionParams& params = args.params;
  if (!(params.sm_scale > 0.0f) || !std::isfinite(params.sm_scale)) return Invalid("sm_scale must be > 0");
  if (!(params.logits_soft_cap >= 0.0f) || !std::isfinite(params.logits_soft_cap)) {
    return Invalid("logits_soft_cap must be >= 0");
  }
  if (!std::isfinite(params.k_scale) || !std::isfinite(params.v_scale) || !(params.k_scale > 0.0f)) {
    return Invalid("k_scale must be > 0 and v_scale finite");
  }
  return absl::OkStatus();
}

}  // namespace

int64_t BatchPrefillWorkspaceBytes(const plan::PrefillPlan& plan) {
  const int64_t item_bytes = static_cast<int64_t>(plan.items.size() * sizeof(plan::PrefillWorkItem));
  return (item_bytes + kWorkspaceAlignment - 1) / kWorkspaceAlignment * kWorkspaceAlignment;
}

absl::Status UploadBatchPrefillPlan(const plan::PrefillPlan& plan, void* workspace, int64_t workspace_bytes,
                                    cudaStream_t stream) {
  const int64_t needed = BatchPrefillWorkspaceBytes(plan);
  if (workspace_bytes < needed || (needed > 0 && workspace == nullptr)) {
    return Invalid("workspace: need " + std::to_string(needed) + " bytes, got " + std::to_string(workspace_bytes));
  }
  if (plan.items.empty()) return absl::OkStatus();
  CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(workspace, plan.items.data(),
                                               plan.items.size() * sizeof(plan::PrefillWorkItem),
                                               cudaMemcpyHostToDevice, stream));
  return absl::OkStatus();
}

absl::Status BatchPrefill(const plan::PrefillPlan& plan, const BatchPrefillArgs& args, void* workspace,
                          int64_t workspace_bytes, cudaStream_t stream) {
  if (plan.items.empty()) return absl::OkStatus();
  RETURN_IF_ERROR(Validate(plan, args));
  if (workspace == nullptr || workspace_bytes < BatchPrefillWorkspaceBytes(plan)) {
    return Invalid("workspace: need " + std::to_string(BatchPrefillWorkspaceBytes(plan)) + " bytes, got " +
                   std::to_string(workspace_bytes));
  }

  const PagedKvView& k_cache = args.k_cache;
  prefill::KernelParams params{};
  params.q = args.q.data;
  params.o = args.o.data;
  params.lse = args.lse;
  params.k_pool = k_cache.data;
  params.v_pool = args.v_cache.data;
  params.qo_indptr = args.qo_indptr;
  params.page_indptr = args.pages.indptr;
  params.k_page_ids = args.pages.k_indices;
  params.v_page_ids = args.pages.v_indices;
  params.last_page_len = args.pages.last_page_len;
  params.kv_page_stride = k_cache.PageElements();
  params.kv_entry_stride = k_cache.Offset(0, 1, 0);
  params.kv_head_stride = k_cache.Offset(0, 0, 1);
  params.num_qo_heads = plan.num_qo_heads;
  params.num_kv_heads = plan.num_kv_heads;
  params.group_size = plan.num_qo_heads / plan.num_kv_heads;
  int32_t log2 = 0;
  while ((1 << log2) < args.pages.page_size) ++log2;
  params.page_size_log2 = log2;
  // k_scale multiplies every score; folding it into sm_scale saves a multiply per key.
  params.score_scale = args.params.sm_scale * args.params.k_scale;
  params.soft_cap = args.params.logits_soft_cap;
  params.v_scale = args.params.v_scale;
  params.window_left = args.params.window_left < 0 ? -1 : args.params.window_left;
  params.causal = args.params.causal;

  const auto* items = static_cast<const prefill::WorkItem*>(workspace);
  for (const plan::PrefillLaunch& launch : plan.launches) {
    params.items = items + launch.first_item;
    const int32_t num_ctas = launch.num_items * plan.num_kv_heads;
    cudaError_t error = cudaErrorInvalidValue;
    switch (plan.head_dim) {
      case 64:
        error = prefill::LaunchPrefillD64(params, launch.tile_rows, args.q.dtype, k_cache.dtype, num_ctas, stream);
        break;
      case 128:
        error = prefill::LaunchPrefillD128(params, launch.tile_rows, args.q.dtype, k_cache.dtype, num_ctas, stream);
        break;
      case 256:
        error = prefill::LaunchPrefillD256(params, launch.tile_rows, args.q.dtype, k_cache.dtype, num_ctas, stream);
        break;
      default:
        return Invalid("head_dim " + std::to_string(plan.head_dim));
    }
    CUDA_RETURN_IF_ERROR(error);
  }
  return absl::OkStatus();
}

}  // namespace attnd::cuda
