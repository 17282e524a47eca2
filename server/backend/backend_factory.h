// Chooses and builds the backend: CUDA when requested or (auto) when a GPU is present and the
// build has CUDA, CPU otherwise.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "backend/backend.h"
#include "options.h"
#include "plan/pod_choice.h"

namespace attnd {

struct BackendFactoryOptions {
  BackendKind kind = BackendKind::kAuto;
  int64_t kv_memory_bytes = 0;  // 0: a fraction of free device memory (CUDA) / 1 GiB (CPU)
  double kv_memory_fraction = 0.9;
  BackendObserver* observer = nullptr;
  // CUDA backend only (CudaBackendOptions): when a mixed step runs as one POD launch, and how
  // its completion threads wait ("blocking" or "spin"; "" = blocking).
  plan::PodMode pod_mode = plan::PodMode::kAuto;
  std::string cuda_completion_wait;
};

absl::StatusOr<std::unique_ptr<Backend>> MakeBackend(const BackendFactoryOptions& options);

}  // namespace attnd
