#include "attnd/kernels/cuda/timer_stamp.h"

#include <string>

namespace attnd::cuda {
namespace {

__global__ void TimerStampKernel(uint64_t* where) {
  uint64_t now = 0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  *where = now;
}

}  // namespace

absl::Status LaunchTimerStamp(uint64_t* where, cudaStream_t stream) {
  TimerStampKernel<<<1, 1, 0, stream>>>(where);
  const cudaError_t error = cudaGetLastError();
  if (error != cudaSuccess) {
    return absl::InternalError(std::string("timer stamp kernel: ") + cudaGetErrorString(error));
  }
  return absl::OkStatus();
}

}  // namespace attnd::cuda
