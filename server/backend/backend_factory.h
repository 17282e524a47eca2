// Chooses and builds the backend: CUDA when requested or (auto) when a GPU is present and the
// build has CUDA, CPU otherwise.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "backend/backend.h"
#include "options.h"
#include "plan/decode_choice.h"
#include "plan/pod_choice.h"

namespace attnd {

struct BackendFactoryOptions {
  BackendKind kind = BackendKind::kAuto;
  std::vector<int32_t> devices;  // empty: every visible GPU (CUDA) / one device (CPU)
  int64_t kv_memory_bytes = 0;  // per device; 0: a fraction of free memory (CUDA) / 1 GiB (CPU)
  double kv_memory_fraction = 0.9;
  BackendObserver* observer = nullptr;
  // CUDA backend only (CudaBackendOptions): when a mixed step runs as one POD launch, which
  // decode kernel the decode planner may use, and how its completion threads wait ("blocking"
  // or "spin"; "" = blocking).
  plan::PodMode pod_mode = plan::PodMode::kAuto;
  plan::DecodeKernelChoice decode_kernel = plan::DecodeKernelChoice::kAuto;
  std::string cuda_completion_wait;
  int32_t channel_timing_stride = 16;  // CudaBackendOptions::channel_timing_stride
  bool channel_done_by_kernel = false;  // CudaBackendOptions::channel_done_by_kernel
  int32_t host_shm_parts = 2;          // CudaBackendOptions::host_shm_parts
  absl::Duration nccl_init_timeout = absl::Seconds(60);  // CudaBackendOptions::nccl_init_timeout
};

absl::StatusOr<std::unique_ptr<Backend>> MakeBackend(const BackendFactoryOptions& options);

}  // namespace attnd
