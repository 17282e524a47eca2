// Chooses and builds the backend: CUDA when requested or (auto) when a GPU is present and the
// build has CUDA, CPU otherwise.
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "backend/backend.h"
#include "server.h"

namespace attnd {

struct BackendFactoryOptions {
  BackendKind kind = BackendKind::kAuto;
  int64_t kv_memory_bytes = 0;  // 0: a fraction of free device memory (CUDA) / 1 GiB (CPU)
  double kv_memory_fraction = 0.9;
  BackendObserver* observer = nullptr;
};

absl::StatusOr<std::unique_ptr<Backend>> MakeBackend(const BackendFactoryOptions& options);

}  // namespace attnd
