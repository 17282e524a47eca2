#include <cuda_runtime.h>

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

__device__ uint64_t GlobalTimer() {
  uint64_t now = 0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  return now;
}

// Region blockIdx.y.
__global__ void FillRegionsKernel(FillRegions fill, bool bf16, FillStamps* stamps) {
#if __CUDA_ARCH__ >= 900
  // The ready write after it may be scheduled now; launched as a programmatic dependent of the
  // done wait, this grid waits for it before writing the slot (plainly launched: no wait).
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
  if (stamps != nullptr && blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) {
    stamps->start_ns = GlobalTimer();
  }
  const FillRegion& region = fill.regions[blockIdx.y];
  FillRegionOf(static_cast<uint16_t*>(region.device), region.count, region.seed, bf16);
  if (stamps != nullptr) {
    __syncthreads();
    if (threadIdx.x == 0) {
      __threadfence();
      const unsigned long long total = gridDim.x * gridDim.y;
      if (atomicAdd(reinterpret_cast<unsigned long long*>(&stamps->finished_blocks), 1ull) ==
          total - 1) {
        stamps->end_ns = GlobalTimer();
      }
    }
  }
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
                                 void* stream, FillStamps* stamps, bool after_preceding_grid) {
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
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = dim3(256);
  config.stream = static_cast<cudaStream_t>(stream);
  cudaLaunchAttribute attribute;
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  config.attrs = &attribute;
  config.numAttrs = after_preceding_grid ? 1 : 0;
  cudaLaunchKernelEx(&config, FillRegionsKernel, fill, bf16, stamps);
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

absl::StatusOr<std::unique_ptr<StampBuffer>> StampBuffer::Create(int64_t count) {
  std::unique_ptr<StampBuffer> buffer(new StampBuffer());
  if (cudaMalloc(reinterpret_cast<void**>(&buffer->device_), sizeof(FillStamps) * count) !=
          cudaSuccess ||
      cudaMemset(buffer->device_, 0, sizeof(FillStamps) * count) != cudaSuccess) {
    return absl::ResourceExhaustedError(std::string("stamp buffer: ") +
                                        cudaGetErrorString(cudaGetLastError()));
  }
  buffer->count_ = count;
  return buffer;
}

StampBuffer::~StampBuffer() {
  if (device_ != nullptr) cudaFree(device_);
}

absl::StatusOr<std::vector<FillStamps>> StampBuffer::Read() const {
  std::vector<FillStamps> out(count_);
  if (cudaMemcpy(out.data(), device_, sizeof(FillStamps) * count_, cudaMemcpyDeviceToHost) !=
      cudaSuccess) {
    return absl::InternalError(std::string("reading stamps: ") +
                               cudaGetErrorString(cudaGetLastError()));
  }
  return out;
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
