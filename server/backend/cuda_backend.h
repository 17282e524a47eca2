// CudaBackend: KV pools in GPU memory, attention on the GPU (DESIGN 3). At start it reserves the
// KV budget with one cudaMalloc; each cache carves its pools from that reservation (first fit)
// and gives them back when deleted. Caches, steps and the layer pipeline are in cuda_cache.h and
// cuda_step.h. This header is CUDA-free so that the backend factory can include it.
//
// Supported caches: MHA/GQA with fp16/bf16 q, fp16/bf16/fp8_e4m3 KV, head_dim 64/128/256, NHD
// or HND, SHARED or SEPARATE_KV page tables; MLA with kv_lora_rank 512 or 256, rope_dim 64, 1 to
// 1024 heads, the same dtypes and tables (append, then the MLA decode kernel for decode and
// prefill rows alike). Anything else is refused at CreateCache (UNIMPLEMENTED, naming the field).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "backend/backend.h"
#include "plan/decode_choice.h"
#include "plan/pod_choice.h"

namespace attnd {

struct CudaBackendOptions {
  // Device ordinals to serve (--devices); empty: every visible device.
  std::vector<int32_t> devices;
  int64_t kv_budget_bytes = 0;      // per device; > 0: reserve exactly this; 0: the fraction
  double kv_memory_fraction = 0.9;  // of each device's memory free at start, in (0, 1]
  BackendObserver* observer = nullptr;  // may be null; must outlive the backend
  // How the completion threads wait for a layer's outputs (cuda_cache.h, CompletionWait):
  // "blocking" or "spin" (attnd's --cuda_completion, for measuring both). Empty: "blocking".
  std::string completion_wait;
  // When a mixed step runs as one POD launch (plan/pod_choice.h; attnd's --pod).
  plan::PodMode pod_mode = plan::PodMode::kAuto;
  // The decode kernel each cache's decode planner may use (plan/decode_choice.h; attnd's
  // --decode_kernel): auto, or one forced for measurements where the cache has it.
  plan::DecodeKernelChoice decode_kernel = plan::DecodeKernelChoice::kAuto;
  // CUDA_IPC channels time the kernels of one layer in this many (1: all, 0: none; attnd's
  // --channel_kernel_timing). The Forward path times every layer.
  int32_t channel_timing_stride = 16;
  bool channel_done_by_kernel = false;  // CudaCacheOptions::channel_done_by_kernel
  // A HOST_SHM channel's decode layer runs in this many parts of its rows (attnd's
  // --host_shm_parts; CudaStep).
  int32_t host_shm_parts = 2;
  // Mixed steps the planner marks side by side (StepPlan::side_by_side_prefill_ctas) run their
  // decode and prefill on two streams of a cache's lane; false runs them one after the other
  // (the environment variable ATTND_SIDE_BY_SIDE=0, for measurements and tests).
  bool side_by_side = true;
  // How long an NCCL channel waits for its client to join (attnd's --nccl_init_timeout).
  absl::Duration nccl_init_timeout = absl::Seconds(60);
};

// Visible CUDA devices; 0 on any error (no driver, no device), so callers can fall back.
int CudaDeviceCount();

// Why CudaDeviceCount() is 0, in the runtime's words (e.g. "cudaGetDeviceCount: no
// CUDA-capable device is detected (cudaErrorNoDevice)"); empty when a device is visible.
std::string CudaUnavailableReason();

// Reserves a KV budget on each device of options.devices (every visible one by default); each
// cache lives on one of them. RESOURCE_EXHAUSTED when a reservation fails, FAILED_PRECONDITION
// without a device, INVALID_ARGUMENT for a device not visible.
absl::StatusOr<std::unique_ptr<Backend>> MakeCudaBackend(const CudaBackendOptions& options);

}  // namespace attnd
