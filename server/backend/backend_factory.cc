#include "backend/backend_factory.h"

#include "backend/cpu_backend.h"
#ifdef ATTND_HAVE_CUDA_BACKEND
#include "backend/cuda_backend.h"
#endif

namespace attnd {

absl::StatusOr<std::unique_ptr<Backend>> MakeBackend(const BackendFactoryOptions& options) {
#ifdef ATTND_HAVE_CUDA_BACKEND
  if (options.kind != BackendKind::kCpu) {
    const bool have_gpu = CudaDeviceCount() > 0;
    if (have_gpu) {
      CudaBackendOptions cuda;
      cuda.kv_budget_bytes = options.kv_memory_bytes;
      cuda.kv_memory_fraction = options.kv_memory_fraction;
      cuda.observer = options.observer;
      return MakeCudaBackend(cuda);
    }
    if (options.kind == BackendKind::kCuda) {
      return absl::FailedPreconditionError("--backend=cuda: no CUDA device is visible");
    }
  }
#else
  if (options.kind == BackendKind::kCuda) {
    return absl::FailedPreconditionError(
        "--backend=cuda: this attnd was built without CUDA (ATTND_CUDA=OFF or no nvcc)");
  }
#endif
  CpuBackendOptions cpu;
  cpu.kv_budget_bytes = options.kv_memory_bytes > 0 ? options.kv_memory_bytes : int64_t{1} << 30;
  cpu.observer = options.observer;
  return MakeCpuBackend(cpu);
}

}  // namespace attnd
