// Host launcher of POD attention: the prefill launcher's steps (prefill_launch.h) around one
// fused launch. Plain C++ (no device code), so Abseil never goes through nvcc.
#include "attnd/kernels/cuda/pod.h"

#include <cstdint>
#include <string>

#include "attnd/kernels/cuda/cuda_check.h"
#include "attnd/status_macros.h"
#include "pod_params.h"
#include "prefill_launch.h"

namespace attnd::cuda {
namespace {

constexpr int64_t kAlignment = 256;

int64_t AlignUp(int64_t bytes) { return (bytes + kAlignment - 1) / kAlignment * kAlignment; }

// The counters sit after the prefill workspace.
int64_t CountersOffset(const plan::PodPlan& plan) { return AlignUp(BatchPrefillWorkspaceBytes(plan.prefill)); }

absl::Status Invalid(const std::string& message) { return absl::InvalidArgumentError("PodAttention: " + message); }

cudaError_t LaunchPod(const pod::PodKernelParams& params, int32_t head_dim, int32_t prefill_tile_rows, DType q_dtype,
                      DType kv_dtype, int32_t num_ctas, cudaStream_t stream, int* ctas_per_sm) {
  switch (head_dim) {
    case 64: return pod::LaunchPodD64(params, prefill_tile_rows, q_dtype, kv_dtype, num_ctas, stream, ctas_per_sm);
    case 128: return pod::LaunchPodD128(params, prefill_tile_rows, q_dtype, kv_dtype, num_ctas, stream, ctas_per_sm);
    case 256: return pod::LaunchPodD256(params, prefill_tile_rows, q_dtype, kv_dtype, num_ctas, stream, ctas_per_sm);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

absl::StatusOr<plan::PodWaveSizes> PodCtasPerWave(int32_t head_dim, DType q_dtype, DType kv_dtype) {
  if (head_dim != 64 && head_dim != 128 && head_dim != 256) return Invalid("head_dim " + std::to_string(head_dim));
  int device = 0;
  int num_sms = 0;
  CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, device));
  plan::PodWaveSizes waves;
  const pod::PodKernelParams unused{};
  for (int32_t tile_rows : {64, 128}) {
    if (head_dim == 256 && tile_rows == 128) continue;
    int ctas_per_sm = 0;
    CUDA_RETURN_IF_ERROR(LaunchPod(unused, head_dim, tile_rows, q_dtype, kv_dtype, 0, nullptr, &ctas_per_sm));
    (tile_rows == 64 ? waves.tile64 : waves.tile128) = ctas_per_sm * num_sms;
  }
  return waves;
}

int64_t PodWorkspaceBytes(const plan::PodPlan& plan) {
  return CountersOffset(plan) + AlignUp(int64_t{pod::kCounterWords} * 4);
}

absl::Status UploadPodPlan(const plan::PodPlan& plan, void* workspace, int64_t workspace_bytes, cudaStream_t stream) {
  if (workspace_bytes < PodWorkspaceBytes(plan)) {
    return Invalid("workspace: need " + std::to_string(PodWorkspaceBytes(plan)) + " bytes, got " +
                   std::to_string(workspace_bytes));
  }
  return UploadBatchPrefillPlan(plan.prefill, workspace, workspace_bytes, stream);
}

absl::Status PodAttention(const plan::PodPlan& plan, const BatchPrefillArgs& args, void* workspace,
                          int64_t workspace_bytes, cudaStream_t stream) {
  const plan::PrefillPlan& prefill = plan.prefill;
  if (prefill.items.empty()) return absl::OkStatus();
  if (workspace_bytes < PodWorkspaceBytes(plan)) {
    return Invalid("workspace: need " + std::to_string(PodWorkspaceBytes(plan)) + " bytes, got " +
                   std::to_string(workspace_bytes));
  }
  for (const plan::PrefillLaunch& launch : prefill.launches) {
    if (launch.kernel != plan::PrefillKernel::kMmaSync) return Invalid("POD plans run the mma.sync kernel only");
  }
  ASSIGN_OR_RETURN(const prefill::KernelParams params,
                   prefill::ResolveKernelParams(prefill, args, workspace, workspace_bytes));
  // The launches outside the fusion first (they share nothing with it but the partials).
  for (int32_t i = 0; i < static_cast<int32_t>(prefill.launches.size()); ++i) {
    if (plan.fused() && (i == plan.prefill_launch || i == plan.decode_launch)) continue;
    RETURN_IF_ERROR(prefill::LaunchPlanned(prefill, prefill.launches[i], params, args, stream));
  }
  if (plan.fused()) {
    const plan::PrefillLaunch& prefill_role = prefill.launches[plan.prefill_launch];
    const plan::PrefillLaunch& decode_role = prefill.launches[plan.decode_launch];
    if (decode_role.tile_rows != 16 || (prefill_role.tile_rows != 64 && prefill_role.tile_rows != 128) ||
        (prefill.head_dim == 256 && prefill_role.tile_rows != 64)) {
      return Invalid("the plan fuses tiles of " + std::to_string(prefill_role.tile_rows) + " and " +
                     std::to_string(decode_role.tile_rows) + " rows; the POD kernel has 64 or 128 with 16");
    }
    const int64_t total_ctas = plan.PrefillRoleCtas() + plan.DecodeRoleCtas();
    if (total_ctas > INT32_MAX) return Invalid("more than 2^31 CTAs");
    pod::PodKernelParams pod_params{};
    pod_params.base = params;
    pod_params.prefill_items = params.items + prefill_role.first_item;
    pod_params.decode_items = params.items + decode_role.first_item;
    pod_params.num_prefill_ctas = static_cast<int32_t>(plan.PrefillRoleCtas());
    pod_params.num_decode_ctas = static_cast<int32_t>(plan.DecodeRoleCtas());
    pod_params.counters = reinterpret_cast<int32_t*>(static_cast<uint8_t*>(workspace) + CountersOffset(plan));
    CUDA_RETURN_IF_ERROR(cudaMemsetAsync(pod_params.counters, 0, int64_t{pod::kCounterWords} * 4, stream));
    CUDA_RETURN_IF_ERROR(LaunchPod(pod_params, prefill.head_dim, prefill_role.tile_rows, args.q.dtype,
                                   args.k_cache.dtype, static_cast<int32_t>(total_ctas), stream, nullptr));
  }
  return prefill::MergePlannedPartials(prefill, args, workspace, stream);
}

}  // namespace attnd::cuda
