// CpuBackend: the reference implementation as a backend. Pools live in host memory; layers run
// on a small worker pool with the reference kernels in float32. This is what CI and machines
// without a GPU serve with, and what GPU results are compared against.
#pragma once

#include <memory>
#include <vector>

#include "backend/backend.h"

namespace attnd {

struct CpuBackendOptions {
  int64_t kv_budget_bytes = 1ll << 30;  // per device
  // Devices to pretend to have (their ordinals), each with kv_budget_bytes of its own: caches
  // are placed on one as on a multi-GPU host. Empty: one, device 0.
  std::vector<int32_t> devices;
  // Layers run concurrently on this many threads (0: one per core).
  int num_workers = 0;
  BackendObserver* observer = nullptr;  // may be null; must outlive the backend
};

std::unique_ptr<Backend> MakeCpuBackend(const CpuBackendOptions& options);

}  // namespace attnd
