#include "attnd/kernels/cuda/flag_gate.h"

#include <string>

#include "launch.cuh"

namespace attnd::cuda {
namespace {

__global__ void FlagGateKernel(const uint32_t* word, uint32_t value, uint64_t* seen_ns) {
  for (;;) {
    uint32_t now = 0;
    // System scope: the writer may be another process's stream or a peer GPU.
    asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(now) : "l"(word) : "memory");
    if (static_cast<int32_t>(now - value) >= 0) break;
    __nanosleep(32);
  }
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
  if (seen_ns != nullptr) {
    uint64_t time = 0;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(time));
    *seen_ns = time;
  }
}

__global__ void FlagSignalKernel(uint32_t* word, uint32_t value) {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
  __threadfence_system();
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(word), "r"(value) : "memory");
}

}  // namespace

absl::Status LaunchFlagSignal(cudaStream_t stream, void* word, uint32_t value) {
  uint32_t* target = static_cast<uint32_t*>(word);
  void* args[] = {&target, &value};
  const cudaError_t error = LaunchAfterPrecedingGrid(reinterpret_cast<const void*>(&FlagSignalKernel),
                                                     dim3(1), dim3(1), 0, stream, args);
  if (error != cudaSuccess) {
    cudaGetLastError();
    return absl::InternalError(std::string("flag signal kernel: ") + cudaGetErrorString(error));
  }
  return absl::OkStatus();
}

absl::Status LaunchFlagGate(cudaStream_t stream, const void* word, uint32_t value,
                            uint64_t* seen_ns) {
  FlagGateKernel<<<1, 1, 0, stream>>>(static_cast<const uint32_t*>(word), value, seen_ns);
  const cudaError_t error = cudaGetLastError();
  if (error != cudaSuccess) {
    return absl::InternalError(std::string("flag gate kernel: ") + cudaGetErrorString(error));
  }
  return absl::OkStatus();
}

}  // namespace attnd::cuda
