#include "backend/cuda_memory.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "attnd/kernels/cuda/cuda_check.h"

namespace attnd::cuda_backend {
namespace {

// Small buffers are rounded up so that the first few steps do not each grow them.
constexpr int64_t kMinCapacityBytes = 64 << 10;

int64_t GrownCapacity(int64_t current, int64_t needed) {
  return AlignUp(std::max({needed, current + current / 2, kMinCapacityBytes}), kBufferAlignment);
}

}  // namespace

absl::Status DeviceBuffer::Reserve(int64_t bytes, std::vector<uint8_t*>* retired) {
  if (bytes <= capacity_) return absl::OkStatus();
  const int64_t capacity = GrownCapacity(capacity_, bytes);
  if (retired != nullptr && data_ != nullptr) {
    retired->push_back(data_);
    data_ = nullptr;
    capacity_ = 0;
  }
  Release();
  void* data = nullptr;
  const cudaError_t error = cudaMalloc(&data, static_cast<size_t>(capacity));
  if (error != cudaSuccess) {
    cudaGetLastError();  // an allocation failure is not sticky; do not leave it pending
    return absl::ResourceExhaustedError(absl::StrCat("device allocation of ", capacity,
                                                     " bytes failed: ", cudaGetErrorString(error)));
  }
  data_ = static_cast<uint8_t*>(data);
  capacity_ = capacity;
  return absl::OkStatus();
}

void DeviceBuffer::Release() {
  if (data_ != nullptr) cudaFree(data_);
  data_ = nullptr;
  capacity_ = 0;
}

absl::Status PinnedBuffer::Reserve(int64_t bytes, std::vector<uint8_t*>* retired) {
  if (bytes <= capacity_) return absl::OkStatus();
  const int64_t capacity = GrownCapacity(capacity_, bytes);
  if (retired != nullptr && data_ != nullptr) {
    retired->push_back(data_);
    data_ = nullptr;
    capacity_ = 0;
  }
  Release();
  void* data = nullptr;
  const cudaError_t error =
      cudaHostAlloc(&data, static_cast<size_t>(capacity), cudaHostAllocDefault);
  if (error != cudaSuccess) {
    cudaGetLastError();
    return absl::ResourceExhaustedError(absl::StrCat("pinned host allocation of ", capacity,
                                                     " bytes failed: ", cudaGetErrorString(error)));
  }
  data_ = static_cast<uint8_t*>(data);
  capacity_ = capacity;
  return absl::OkStatus();
}

void PinnedBuffer::Release() {
  if (data_ != nullptr) cudaFreeHost(data_);
  data_ = nullptr;
  capacity_ = 0;
}

CudaEvent::~CudaEvent() {
  if (event_ != nullptr) cudaEventDestroy(event_);
}

absl::Status CudaEvent::Create(bool timing, bool blocking_sync) {
  unsigned int flags = timing ? cudaEventDefault : cudaEventDisableTiming;
  if (blocking_sync) flags |= cudaEventBlockingSync;
  CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&event_, flags));
  return absl::OkStatus();
}

CudaStream::~CudaStream() {
  if (stream_ != nullptr) cudaStreamDestroy(stream_);
}

absl::Status CudaStream::Create(bool greatest_priority) {
  if (!greatest_priority) {
    CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    return absl::OkStatus();
  }
  int least = 0;
  int greatest = 0;
  CUDA_RETURN_IF_ERROR(cudaDeviceGetStreamPriorityRange(&least, &greatest));
  CUDA_RETURN_IF_ERROR(cudaStreamCreateWithPriority(&stream_, cudaStreamNonBlocking, greatest));
  return absl::OkStatus();
}

double ElapsedSeconds(const CudaEvent& start, const CudaEvent& end) {
  float milliseconds = 0.0f;
  if (cudaEventElapsedTime(&milliseconds, start.get(), end.get()) != cudaSuccess) {
    cudaGetLastError();
    return 0.0;
  }
  return milliseconds * 1e-3;
}

}  // namespace attnd::cuda_backend
