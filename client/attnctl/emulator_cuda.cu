#include <cuda_runtime_api.h>

#include <string>

#include "emulator.h"

namespace attnd::attnctl {
namespace {

// One thread per four elements: one hash, one 8-byte store (the slot regions are 256-byte
// aligned; a region's tail of fewer than four elements is written element by element).
__device__ void FillRegionOf(uint16_t* out, int64_t count, uint64_t seed, bool bf16) {
  const int64_t groups = count / 4;
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  for (int64_t g = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; g < groups; g += stride) {
    const uint64_t z = EmulatedHash(seed, static_cast<uint64_t>(g));
    uint2 word;
    word.x = EmulatedValue(static_cast<uint32_t>(z), bf16) |
             (static_cast<uint32_t>(EmulatedValue(static_cast<uint32_t>(z >> 8), bf16)) << 16);
    word.y = EmulatedValue(static_cast<uint32_t>(z >> 16), bf16) |
             (static_cast<uint32_t>(EmulatedValue(static_cast<uint32_t>(z >> 24), bf16)) << 16);
    reinterpret_cast<uint2*>(out)[g] = word;
  }
  if (blockIdx.x == 0 && threadIdx.x < count - groups * 4) {
    const int64_t i = groups * 4 + threadIdx.x;
    out[i] = EmulatedElement(seed, static_cast<uint64_t>(i), bf16);
  }
}

struct FillRegions {
  FillRegion regions[kMaxFillRegions];
};

// Region blockIdx.y.
__global__ void FillRegionsKernel(FillRegions fill, bool bf16) {
  const FillRegion& region = fill.regions[blockIdx.y];
  FillRegionOf(static_cast<uint16_t*>(region.device), region.count, region.seed, bf16);
}

// Holds the stream for `ns` nanoseconds (so that what is enqueued behind it is timed on the GPU
// alone, not at the host's launch rate).
__global__ void SleepKernel(uint64_t ns) {
  uint64_t start = 0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  for (uint64_t now = start; now - start < ns;) {
    __nanosleep(1000);
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  }
}

}  // namespace

absl::Status FillRegionsOnStream(const FillRegion* regions, int num_regions, bool bf16,
                                 void* stream) {
  if (num_regions < 1 || num_regions > kMaxFillRegions) {
    return absl::InvalidArgumentError("emulator fill: 1 to 3 regions");
  }
  FillRegions fill;
  int64_t largest = 0;
  for (int r = 0; r < num_regions; ++r) {
    if (reinterpret_cast<uintptr_t>(regions[r].device) % 8 != 0) {
      return absl::InvalidArgumentError("emulator fill: the regions must be 8-byte aligned");
    }
    fill.regions[r] = regions[r];
    largest = regions[r].count > largest ? regions[r].count : largest;
  }
  if (largest == 0) return absl::OkStatus();
  const int64_t blocks = (largest / 4 + 255) / 256;
  const dim3 grid(static_cast<unsigned>(blocks < 1 ? 1 : blocks < 2048 ? blocks : 2048),
                  static_cast<unsigned>(num_regions));
  FillRegionsKernel<<<grid, 256, 0, static_cast<cudaStream_t>(stream)>>>(fill, bf16);
  const cudaError_t error = cudaGetLastError();
  if (error != cudaSuccess) {
    return absl::InternalError(std::string("emulator fill kernel: ") + cudaGetErrorString(error));
  }
  return absl::OkStatus();
}

}  // namespace attnd::attnctl

namespace attnd::attnctl {

absl::StatusOr<std::unique_ptr<EmulatorStream>> EmulatorStream::Create(int device,
                                                                       int num_events) {
  std::unique_ptr<EmulatorStream> stream(new EmulatorStream());
  if (cudaSetDevice(device) != cudaSuccess) {
    return absl::FailedPreconditionError(std::string("cudaSetDevice: ") +
                                         cudaGetErrorString(cudaGetLastError()));
  }
  cudaStream_t handle = nullptr;
  if (cudaStreamCreateWithFlags(&handle, cudaStreamNonBlocking) != cudaSuccess) {
    return absl::InternalError("cudaStreamCreateWithFlags failed");
  }
  stream->stream_ = handle;
  for (int i = 0; i < num_events; ++i) {
    cudaEvent_t event = nullptr;
    if (cudaEventCreate(&event) != cudaSuccess) return absl::InternalError("cudaEventCreate");
    stream->events_.push_back(event);
  }
  return stream;
}

EmulatorStream::~EmulatorStream() {
  for (void* event : events_) cudaEventDestroy(static_cast<cudaEvent_t>(event));
  if (stream_ != nullptr) cudaStreamDestroy(static_cast<cudaStream_t>(stream_));
}

absl::Status EmulatorStream::Record(int event) {
  if (cudaEventRecord(static_cast<cudaEvent_t>(events_[event]),
                      static_cast<cudaStream_t>(stream_)) != cudaSuccess) {
    return absl::InternalError("cudaEventRecord failed");
  }
  return absl::OkStatus();
}

absl::Status EmulatorStream::Sleep(int64_t microseconds) {
  SleepKernel<<<1, 1, 0, static_cast<cudaStream_t>(stream_)>>>(
      static_cast<uint64_t>(microseconds) * 1000);
  const cudaError_t error = cudaGetLastError();
  if (error != cudaSuccess) {
    return absl::InternalError(std::string("sleep kernel: ") + cudaGetErrorString(error));
  }
  return absl::OkStatus();
}

absl::Status EmulatorStream::WaitEvent(int event) {
  const cudaError_t error = cudaEventSynchronize(static_cast<cudaEvent_t>(events_[event]));
  if (error != cudaSuccess) {
    return absl::InternalError(std::string("cudaEventSynchronize: ") + cudaGetErrorString(error));
  }
  return absl::OkStatus();
}

absl::Status EmulatorStream::Synchronize() {
  const cudaError_t error = cudaStreamSynchronize(static_cast<cudaStream_t>(stream_));
  if (error != cudaSuccess) {
    return absl::InternalError(std::string("cudaStreamSynchronize: ") + cudaGetErrorString(error));
  }
  return absl::OkStatus();
}

double EmulatorStream::ElapsedMs(int from, int to) const {
  float ms = 0;
  if (cudaEventElapsedTime(&ms, static_cast<cudaEvent_t>(events_[from]),
                           static_cast<cudaEvent_t>(events_[to])) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return ms;
}

}  // namespace attnd::attnctl
