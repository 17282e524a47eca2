// Host launcher of batch prefill: validates the views against the plan, resolves strides and
// scales into KernelParams, and launches one kernel per query tile size of the plan. Plain C++
// (no device code), so Abseil never goes through nvcc.
#include "attnd/kernels/cuda/prefill.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "attnd/kernels/cuda/cuda_check.h"
#include "attnd/kernels/cuda/merge.h"
#include "attnd/status_macros.h"
#include "fast_divider.h"
#include "prefill_launch.h"
#include "prefill_params.h"

namespace attnd::cuda {
namespace {

constexpr int64_t kWorkspaceAlignment = 256;

int64_t AlignUp(int64_t bytes) { return (bytes + kWorkspaceAlignment - 1) / kWorkspaceAlignment * kWorkspaceAlignment; }

// Workspace sections, each 256-byte aligned: what UploadBatchPrefillPlan copies (items, merge
// indptr, merge rows), then the partials the kernels write.
struct WorkspaceLayout {
  static constexpr int64_t kCounterBytes = 2 * sizeof(int32_t);
  int64_t items = 0;
  int64_t merge_indptr = 0;
  int64_t merge_out_rows = 0;
  int64_t counters = 0;  // two int32 per launch (BatchPrefillArgs::works_on_demand), uploaded as 0
  int64_t uploaded_bytes = 0;
  int64_t partial_o = 0;
  int64_t partial_lse = 0;
  int64_t total_bytes = 0;

  explicit WorkspaceLayout(const plan::PrefillPlan& plan) {
    int64_t offset = 0;
    items = offset;
    offset += AlignUp(static_cast<int64_t>(plan.items.size() * sizeof(plan::PrefillWorkItem)));
    merge_indptr = offset;
    offset += plan.split_kv() ? AlignUp(static_cast<int64_t>(plan.merge_indptr.size() * sizeof(int32_t))) : 0;
    merge_out_rows = offset;
    offset += plan.split_kv() ? AlignUp(static_cast<int64_t>(plan.merge_out_rows.size() * sizeof(int32_t))) : 0;
    counters = offset;
    offset += AlignUp(static_cast<int64_t>(plan.launches.size() * kCounterBytes));
    uploaded_bytes = offset;
    partial_o = offset;
    offset += AlignUp(int64_t{plan.num_partials} * plan.num_qo_heads * plan.head_dim * 4);
    partial_lse = offset;
    offset += AlignUp(int64_t{plan.num_partials} * plan.num_qo_heads * 4);
    total_bytes = offset;
  }
};

static_assert(sizeof(plan::PrefillWorkItem) == sizeof(prefill::WorkItem) &&
                  offsetof(plan::PrefillWorkItem, kv_chunk_end) == offsetof(prefill::WorkItem, kv_chunk_end) &&
                  offsetof(plan::PrefillWorkItem, partial_stride) == offsetof(prefill::WorkItem, partial_stride) &&
                  offsetof(plan::PrefillWorkItem, kv_head) == offsetof(prefill::WorkItem, kv_head),
              "the plan's items are copied bytewise into the kernel's");

// A second grid shares the Hopper launches' works (BatchPrefillTail), so the merge waits for
// MergeBatchPrefill.
bool HasTail(const BatchPrefillArgs& args) { return args.works_on_demand && args.tail_ctas > 0; }

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

// Whether this build and device can run the Hopper kernel for these shapes: built with sm_90a
// code, a compute capability 9.0 device (sm_90a code runs on no other), supported dtypes.
bool HopperAvailable(int device, int32_t head_dim, DType q_dtype, DType kv_dtype) {
#ifdef ATTND_PREFILL_HOPPER
  int major = 0, minor = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) {
    return false;
  }
  return major == 9 && minor == 0 && prefill::HopperPrefillSupports(head_dim, q_dtype, kv_dtype);
#else
  (void)device;
  (void)head_dim;
  (void)q_dtype;
  (void)kv_dtype;
  return false;
#endif
}

}  // namespace

absl::StatusOr<plan::PrefillWaveSizes> BatchPrefillCtasPerWave(int32_t head_dim, DType q_dtype, DType kv_dtype) {
  int device = 0;
  int num_sms = 0;
  CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, device));
  plan::PrefillWaveSizes waves;
  waves.num_sms = num_sms;
  for (int32_t tile_rows : {16, 64, 128}) {
    // The mma.sync kernels' tile (128 -> 64 at D256).
    const int32_t planned = plan::PrefillQueryTileRows(tile_rows, head_dim, /*hopper=*/false);
    int ctas_per_sm = 0;
    const prefill::KernelParams unused{};
    cudaError_t error = cudaErrorInvalidValue;
    switch (head_dim) {
      case 64: error = prefill::LaunchPrefillD64(unused, planned, q_dtype, kv_dtype, 0, nullptr, &ctas_per_sm); break;
      case 128: error = prefill::LaunchPrefillD128(unused, planned, q_dtype, kv_dtype, 0, nullptr, &ctas_per_sm); break;
      case 256: error = prefill::LaunchPrefillD256(unused, planned, q_dtype, kv_dtype, 0, nullptr, &ctas_per_sm); break;
      default: return Invalid("head_dim " + std::to_string(head_dim));
    }
    CUDA_RETURN_IF_ERROR(error);
    (tile_rows == 16 ? waves.tile16 : tile_rows == 64 ? waves.tile64 : waves.tile128) = ctas_per_sm * num_sms;
  }
  if (HopperAvailable(device, head_dim, q_dtype, kv_dtype)) {
#ifdef ATTND_PREFILL_HOPPER
    int ctas_per_sm = 0;
    CUDA_RETURN_IF_ERROR(prefill::LaunchPrefillHopper(prefill::KernelParams{}, head_dim, q_dtype, 0, 0, nullptr, &ctas_per_sm));
    waves.hopper_tile128 = ctas_per_sm * num_sms;
#endif
  }
  return waves;
}

int64_t BatchPrefillWorkspaceBytes(const plan::PrefillPlan& plan) { return WorkspaceLayout(plan).total_bytes; }

absl::Status UploadBatchPrefillPlan(const plan::PrefillPlan& plan, void* workspace, int64_t workspace_bytes,
                                    cudaStream_t stream) {
  const WorkspaceLayout layout(plan);
  if (workspace_bytes < layout.total_bytes || (layout.total_bytes > 0 && workspace == nullptr)) {
    return Invalid("workspace: need " + std::to_string(layout.total_bytes) + " bytes, got " +
                   std::to_string(workspace_bytes));
  }
  if (layout.uploaded_bytes == 0) return absl::OkStatus();
  // One copy: the sections are packed on the host exactly as they sit in the workspace.
  std::vector<uint8_t> packed(layout.uploaded_bytes, 0);
  std::memcpy(packed.data() + layout.items, plan.items.data(), plan.items.size() * sizeof(plan::PrefillWorkItem));
  if (plan.split_kv()) {
    std::memcpy(packed.data() + layout.merge_indptr, plan.merge_indptr.data(), plan.merge_indptr.size() * sizeof(int32_t));
    std::memcpy(packed.data() + layout.merge_out_rows, plan.merge_out_rows.data(),
                plan.merge_out_rows.size() * sizeof(int32_t));
  }
  CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(workspace, packed.data(), packed.size(), cudaMemcpyHostToDevice, stream));
  return absl::OkStatus();
}

namespace prefill {

absl::StatusOr<KernelParams> ResolveKernelParams(const plan::PrefillPlan& plan, const BatchPrefillArgs& args,
                                                 void* workspace, int64_t workspace_bytes) {
  RETURN_IF_ERROR(Validate(plan, args));
  const WorkspaceLayout layout(plan);
  if (workspace == nullptr || workspace_bytes < layout.total_bytes) {
    return Invalid("workspace: need " + std::to_string(layout.total_bytes) + " bytes, got " +
                   std::to_string(workspace_bytes));
  }
  uint8_t* workspace_base = static_cast<uint8_t*>(workspace);

  const PagedKvView& k_cache = args.k_cache;
  KernelParams params{};
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
  // Strides fit in 32 bits (a page is at most 128 x heads x 256 elements), so offsets are one
  // 32 x 32 -> 64-bit multiply-add on the device.
  if (k_cache.PageElements() > INT32_MAX) return Invalid("a KV page holds more than 2^31 elements");
  params.kv_page_stride = static_cast<int32_t>(k_cache.PageElements());
  params.kv_entry_stride = static_cast<int32_t>(k_cache.Offset(0, 1, 0));
  params.kv_head_stride = static_cast<int32_t>(k_cache.Offset(0, 0, 1));
  params.num_qo_heads = plan.num_qo_heads;
  params.num_kv_heads = plan.num_kv_heads;
  params.group_size = plan.num_qo_heads / plan.num_kv_heads;
  params.group_multiplier = FastDivider::MultiplierOf(params.group_size);
  int32_t log2 = 0;
  while ((1 << log2) < args.pages.page_size) ++log2;
  params.page_size_log2 = log2;
  // k_scale multiplies every score; folding it into sm_scale saves a multiply per key.
  params.score_scale = args.params.sm_scale * args.params.k_scale;
  params.soft_cap = args.params.logits_soft_cap;
  params.v_scale = args.params.v_scale;
  params.window_left = args.params.window_left < 0 ? -1 : args.params.window_left;
  params.causal = args.params.causal;

  params.partial_o = reinterpret_cast<float*>(workspace_base + layout.partial_o);
  params.partial_lse = reinterpret_cast<float*>(workspace_base + layout.partial_lse);
  params.items = reinterpret_cast<const WorkItem*>(workspace_base + layout.items);
  // Launch i's counter is work_counter + 2 i (LaunchPlanned).
  params.work_counter =
      args.works_on_demand ? reinterpret_cast<int32_t*>(workspace_base + layout.counters) : nullptr;
  params.counter_ctas = 0;
  params.counter_base = 0;
  params.first_from_counter = false;
  return params;
}

absl::Status LaunchPlanned(const plan::PrefillPlan& plan, const plan::PrefillLaunch& launch, KernelParams params,
                           const BatchPrefillArgs& args, cudaStream_t stream, bool tail) {
  if (tail && (launch.kernel != plan::PrefillKernel::kHopper || params.work_counter == nullptr)) {
    return absl::OkStatus();
  }
  const PagedKvView& k_cache = args.k_cache;
  params.items += launch.first_item;
  const int32_t num_ctas = static_cast<int32_t>(launch.NumCtas(plan.num_kv_heads));
  cudaError_t error = cudaErrorInvalidValue;
  if (launch.kernel == plan::PrefillKernel::kHopper) {
    if (!HopperPrefillSupports(plan.head_dim, args.q.dtype, k_cache.dtype) || launch.tile_rows != kHopperTileRows) {
      return Invalid("the plan chose the Hopper kernel, which needs q and KV of one 16-bit type, head_dim 64, "
                     "128 or 256 and 128-row tiles");
    }
    if (!launch.per_head) return Invalid("the plan's Hopper launch needs one item per KV head");
    params.balanced_grid = launch.balanced_grid;
#ifdef ATTND_PREFILL_HOPPER
    int32_t grid_ctas = launch.grid_ctas;
    if (args.max_persistent_ctas > 0) {
      grid_ctas = grid_ctas > 0 ? std::min(grid_ctas, args.max_persistent_ctas) : args.max_persistent_ctas;
    }
    if (params.work_counter != nullptr) {
      // Both grids count every CTA that shares the counter (the kernel's grid: at most one CTA
      // a work).
      const int32_t main_grid = grid_ctas > 0 ? std::min(num_ctas, grid_ctas) : num_ctas;
      const int32_t tail_grid = std::min(num_ctas, std::max(args.tail_ctas, 0));
      params.work_counter += 2 * (&launch - plan.launches.data());
      params.counter_ctas = main_grid + tail_grid;
      params.counter_base = main_grid;
      params.first_from_counter = tail;
      if (tail) grid_ctas = tail_grid;
      if (tail && tail_grid == 0) return absl::OkStatus();
    }
    CUDA_RETURN_IF_ERROR(LaunchPrefillHopper(params, plan.head_dim, args.q.dtype, num_ctas, grid_ctas, stream,
                                             nullptr, launch.short_works && args.pipeline_short_works));
    return absl::OkStatus();
#else
    return absl::UnimplementedError("BatchPrefill: this build has no sm_90a code for the Hopper kernel");
#endif
  }
  if (launch.per_head) return Invalid("the mma.sync kernel takes one item per query tile and chunk, not per KV head");
  switch (plan.head_dim) {
    case 64:
      error = LaunchPrefillD64(params, launch.tile_rows, args.q.dtype, k_cache.dtype, num_ctas, stream, nullptr);
      break;
    case 128:
      error = LaunchPrefillD128(params, launch.tile_rows, args.q.dtype, k_cache.dtype, num_ctas, stream, nullptr);
      break;
    case 256:
      error = LaunchPrefillD256(params, launch.tile_rows, args.q.dtype, k_cache.dtype, num_ctas, stream, nullptr);
      break;
    default:
      return Invalid("head_dim " + std::to_string(plan.head_dim));
  }
  CUDA_RETURN_IF_ERROR(error);
  return absl::OkStatus();
}

absl::Status MergePlannedPartials(const plan::PrefillPlan& plan, const BatchPrefillArgs& args, void* workspace,
                                  cudaStream_t stream) {
  if (!plan.split_kv()) return absl::OkStatus();
  const WorkspaceLayout layout(plan);
  uint8_t* workspace_base = static_cast<uint8_t*>(workspace);
  MergeStatesArgs merge;
  merge.partial_o = reinterpret_cast<const float*>(workspace_base + layout.partial_o);
  merge.partial_lse = reinterpret_cast<const float*>(workspace_base + layout.partial_lse);
  merge.indptr = reinterpret_cast<const int32_t*>(workspace_base + layout.merge_indptr);
  merge.out_rows = reinterpret_cast<const int32_t*>(workspace_base + layout.merge_out_rows);
  merge.num_rows = plan.num_merge_rows();
  merge.num_heads = plan.num_qo_heads;
  merge.head_dim = plan.head_dim;
  merge.o = args.o;
  merge.lse = args.lse;
  return MergeStates(merge, stream);
}

}  // namespace prefill

absl::Status BatchPrefill(const plan::PrefillPlan& plan, const BatchPrefillArgs& args, void* workspace,
                          int64_t workspace_bytes, cudaStream_t stream) {
  if (plan.items.empty()) return absl::OkStatus();
  ASSIGN_OR_RETURN(const prefill::KernelParams params,
                   prefill::ResolveKernelParams(plan, args, workspace, workspace_bytes));
  for (const plan::PrefillLaunch& launch : plan.launches) {
    RETURN_IF_ERROR(prefill::LaunchPlanned(plan, launch, params, args, stream));
  }
  if (HasTail(args)) return absl::OkStatus();  // MergeBatchPrefill's, after both grids
  return prefill::MergePlannedPartials(plan, args, workspace, stream);
}

absl::Status BatchPrefillTail(const plan::PrefillPlan& plan, const BatchPrefillArgs& args, void* workspace,
                              int64_t workspace_bytes, cudaStream_t stream) {
  if (plan.items.empty() || !HasTail(args)) return absl::OkStatus();
  ASSIGN_OR_RETURN(const prefill::KernelParams params,
                   prefill::ResolveKernelParams(plan, args, workspace, workspace_bytes));
  for (const plan::PrefillLaunch& launch : plan.launches) {
    RETURN_IF_ERROR(prefill::LaunchPlanned(plan, launch, params, args, stream, /*tail=*/true));
  }
  return absl::OkStatus();
}

absl::Status MergeBatchPrefill(const plan::PrefillPlan& plan, const BatchPrefillArgs& args, void* workspace,
                               int64_t workspace_bytes, cudaStream_t stream) {
  if (plan.items.empty() || !HasTail(args)) return absl::OkStatus();  // BatchPrefill merged
  RETURN_IF_ERROR(prefill::ResolveKernelParams(plan, args, workspace, workspace_bytes).status());
  return prefill::MergePlannedPartials(plan, args, workspace, stream);
}

}  // namespace attnd::cuda
