#include "backend/backend_factory.h"

#include <cstdlib>
#include <string_view>

#include "absl/strings/str_cat.h"
#include "backend/cpu_backend.h"
#ifdef ATTND_HAVE_CUDA_BACKEND
#include "backend/cuda_backend.h"
#endif
#include "util/log.h"

namespace attnd {

absl::StatusOr<std::unique_ptr<Backend>> MakeBackend(const BackendFactoryOptions& options) {
#ifdef ATTND_HAVE_CUDA_BACKEND
  if (options.kind != BackendKind::kCpu) {
    // CUDA maps a context's streams onto this many hardware queues (default 8): a channel's
    // stream waiting on a client's ready word blocks whatever shares its queue, so streams get
    // a queue each as far as the GPU allows. Takes effect only before CUDA initialises in the
    // process, which nothing does before the backend is made (attnd's own process and the
    // tests' in-process servers alike); a value from the environment wins.
    setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", /*overwrite=*/0);
    const bool have_gpu = CudaDeviceCount() > 0;
    if (have_gpu) {
      CudaBackendOptions cuda;
      cuda.devices = options.devices;
      cuda.kv_budget_bytes = options.kv_memory_bytes;
      cuda.kv_memory_fraction = options.kv_memory_fraction;
      cuda.observer = options.observer;
      cuda.pod_mode = options.pod_mode;
      cuda.decode_kernel = options.decode_kernel;
      cuda.completion_wait = options.cuda_completion_wait;
      cuda.channel_timing_stride = options.channel_timing_stride;
      cuda.channel_done_by_kernel = options.channel_done_by_kernel;
      cuda.host_shm_parts = options.host_shm_parts;
      // ATTND_SIDE_BY_SIDE=0: mixed steps one kernel after the other (measurements).
      const char* side_by_side = std::getenv("ATTND_SIDE_BY_SIDE");
      cuda.side_by_side = side_by_side == nullptr || std::string_view(side_by_side) != "0";
      cuda.nccl_init_timeout = options.nccl_init_timeout;
      return MakeCudaBackend(cuda);
    }
    // Say why: a missing driver, a container without the GPU, CUDA_VISIBLE_DEVICES="".
    const std::string reason = CudaUnavailableReason();
    if (options.kind == BackendKind::kCuda) {
      return absl::FailedPreconditionError(
          absl::StrCat("--backend=cuda: no CUDA device is visible (", reason, ")"));
    }
    LogInfo(absl::StrCat("backend auto: no CUDA device is visible (", reason,
                         "); using the CPU backend"));
  }
#else
  if (options.kind == BackendKind::kCuda) {
    return absl::FailedPreconditionError(
        "--backend=cuda: this attnd was built without CUDA (ATTND_CUDA=OFF or no nvcc)");
  }
  if (options.kind == BackendKind::kAuto) {
    LogInfo("backend auto: this attnd was built without CUDA (ATTND_CUDA=OFF or no nvcc); "
            "using the CPU backend");
  }
#endif
  CpuBackendOptions cpu;
  cpu.devices = options.devices;
  cpu.kv_budget_bytes = options.kv_memory_bytes > 0 ? options.kv_memory_bytes : int64_t{1} << 30;
  cpu.observer = options.observer;
  return MakeCpuBackend(cpu);
}

}  // namespace attnd
