#include <cuda_runtime.h>

#include <algorithm>
#include <string>

#include "emulator.h"

namespace attnd::attnctl {
namespace {

// Every region as one run of 16-byte chunks (8 elements, two hashes): a chunk index below
// chunk_end[0] is region 0's, below chunk_end[1] region 1's, and so on. A region's tail of
// fewer than eight elements is written element by element.
struct FillRegions {
  FillRegion regions[kMaxFillRegions];
  int64_t chunk_end[kMaxFillRegions];
  int num_regions;
};

__device__ uint64_t GlobalTimer() {
  uint64_t now = 0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  return now;
}

__device__ uint32_t PackedPair(uint64_t z, int shift, bool bf16) {
  return EmulatedValue(static_cast<uint32_t>(z >> shift), bf16) |
         (static_cast<uint32_t>(EmulatedValue(static_cast<uint32_t>(z >> (shift + 8)), bf16))
          << 16);
}

// Two chunks a thread, in a grid of one wave at most (8 blocks of 256 threads per SM; larger
// fills loop): a decode layer's 1.5 MB is ~100k chunks, 192 blocks. On an H200 (back to back,
// launch gaps included) the kernel before (one block per 1024 elements of the largest region,
// in a grid of 3 of those: 1.5 waves of short blocks, 8-byte stores) took 8.7 us a decode
// layer, this one 4.8 (5.4 at one chunk a thread); setting ready from the last block adds
// ~1.8 us to it, and saves more than that in the handoff (docs/benchmarks.md, Channels).
__global__ void FillRegionsKernel(FillRegions fill, bool bf16, FillStamps* stamps,
                                  FillSignal signal) {
#if __CUDA_ARCH__ >= 900
  // The ready write after it may be scheduled now; launched as a programmatic dependent of the
  // done wait, this grid waits for it before writing the slot (plainly launched: no wait).
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
  if (stamps != nullptr && blockIdx.x == 0 && threadIdx.x == 0) stamps->start_ns = GlobalTimer();
  const int64_t chunks = fill.chunk_end[fill.num_regions - 1];
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  for (int64_t c = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; c < chunks; c += stride) {
    int r = 0;
    while (c >= fill.chunk_end[r]) ++r;
    const int64_t local = c - (r == 0 ? 0 : fill.chunk_end[r - 1]);
    const FillRegion& region = fill.regions[r];
    const uint64_t z0 = EmulatedHash(region.seed, static_cast<uint64_t>(2 * local));
    const uint64_t z1 = EmulatedHash(region.seed, static_cast<uint64_t>(2 * local + 1));
    uint4 word;
    word.x = PackedPair(z0, 0, bf16);
    word.y = PackedPair(z0, 16, bf16);
    word.z = PackedPair(z1, 0, bf16);
    word.w = PackedPair(z1, 16, bf16);
    reinterpret_cast<uint4*>(region.device)[local] = word;
  }
  if (blockIdx.x == 0 && threadIdx.x < 8 * fill.num_regions) {
    const FillRegion& region = fill.regions[threadIdx.x / 8];
    const int64_t i = region.count / 8 * 8 + threadIdx.x % 8;
    if (i < region.count) {
      static_cast<uint16_t*>(region.device)[i] =
          EmulatedElement(region.seed, static_cast<uint64_t>(i), bf16);
    }
  }
  if (stamps != nullptr || signal.word != nullptr) {
    // The block's writes, seen by thread 0 through the barrier, before its count (the usual
    // last-block pattern): the last block to count sees every block's.
    __syncthreads();
    if (threadIdx.x == 0) {
      __threadfence();
      if (stamps != nullptr &&
          atomicAdd(reinterpret_cast<unsigned long long*>(&stamps->finished_blocks), 1ull) ==
              gridDim.x - 1) {
        stamps->end_ns = GlobalTimer();
      }
      if (signal.word != nullptr && atomicAdd(signal.counter, 1u) == gridDim.x - 1) {
        *signal.counter = 0;  // for the next fill on the stream, which starts after this grid
        __threadfence_system();
        asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(signal.word), "r"(signal.value)
                     : "memory");
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
                                 void* stream, FillStamps* stamps, bool after_preceding_grid,
                                 const FillSignal* signal) {
  if (signal != nullptr && (signal->word == nullptr || signal->counter == nullptr)) {
    return absl::InvalidArgumentError("emulator fill: a signal needs its word and counter");
  }
  if (num_regions < 1 || num_regions > kMaxFillRegions) {
    return absl::InvalidArgumentError("emulator fill: 1 to 3 regions");
  }
  FillRegions fill = {};
  fill.num_regions = num_regions;
  int64_t chunks = 0;
  for (int r = 0; r < num_regions; ++r) {
    if (reinterpret_cast<uintptr_t>(regions[r].device) % 16 != 0 || regions[r].count < 0) {
      return absl::InvalidArgumentError("emulator fill: the regions must be 16-byte aligned");
    }
    fill.regions[r] = regions[r];
    chunks += regions[r].count / 8;
    fill.chunk_end[r] = chunks;
  }
  int device = 0;
  int sms = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
    return absl::InternalError("emulator fill: no device");
  }
  constexpr int64_t kThreads = 256;
  constexpr int64_t kChunksPerThread = 2;
  const int64_t wanted = (chunks + kThreads * kChunksPerThread - 1) / (kThreads * kChunksPerThread);
  const int64_t blocks = std::max<int64_t>(1, std::min<int64_t>(wanted, 8 * int64_t{sms}));
  const dim3 grid(static_cast<unsigned>(blocks));
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = dim3(kThreads);
  config.stream = static_cast<cudaStream_t>(stream);
  cudaLaunchAttribute attribute;
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  config.attrs = &attribute;
  config.numAttrs = after_preceding_grid ? 1 : 0;
  cudaLaunchKernelEx(&config, FillRegionsKernel, fill, bf16, stamps,
                     signal != nullptr ? *signal : FillSignal{});
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
  if (cudaMalloc(reinterpret_cast<void**>(&stream->signal_counter_), 2 * sizeof(uint32_t)) !=
          cudaSuccess ||
      cudaMemset(stream->signal_counter_, 0, 2 * sizeof(uint32_t)) != cudaSuccess) {
    return absl::ResourceExhaustedError(std::string("emulator signal counter: ") +
                                        cudaGetErrorString(cudaGetLastError()));
  }
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
  if (signal_counter_ != nullptr) cudaFree(signal_counter_);
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
