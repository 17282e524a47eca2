// Owning handles of CUDA resources the backend reuses: device buffers, pinned host buffers,
// events and streams. Each frees its resource on destruction and ignores errors there (a
// faulted context cannot free anything anyway). None is thread-safe; owners lock.
//
// Buffers grow (Reserve) only at plan time: growing frees the old memory, so the caller must
// know that no queued work still uses it.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "absl/status/status.h"
#include "plan/buffer_alignment.h"

namespace attnd::cuda_backend {

using plan::AlignUp;
using plan::kBufferAlignment;

// Device memory from cudaMalloc.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() { Release(); }

  // Ensures at least `bytes` of capacity; contents are not kept. Grows geometrically (1.5x)
  // so a slowly growing batch does not reallocate at every step.
  absl::Status Reserve(int64_t bytes);
  void Release();
  // Gives up the memory without freeing it (the caller frees it with cudaFree later): for
  // buffers that must grow while queued work may still use the old memory and a cudaFree,
  // which waits for the whole device, must not run.
  uint8_t* Detach() {
    uint8_t* data = data_;
    data_ = nullptr;
    capacity_ = 0;
    return data;
  }

  uint8_t* data() const { return data_; }
  int64_t capacity() const { return capacity_; }

 private:
  uint8_t* data_ = nullptr;
  int64_t capacity_ = 0;
};

// Page-locked host memory from cudaHostAlloc: the source or target of asynchronous copies.
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  ~PinnedBuffer() { Release(); }

  absl::Status Reserve(int64_t bytes);  // as DeviceBuffer::Reserve
  void Release();
  // As DeviceBuffer::Detach (the caller frees it with cudaFreeHost later).
  uint8_t* Detach() {
    uint8_t* data = data_;
    data_ = nullptr;
    capacity_ = 0;
    return data;
  }

  uint8_t* data() const { return data_; }
  int64_t capacity() const { return capacity_; }

 private:
  uint8_t* data_ = nullptr;
  int64_t capacity_ = 0;
};

class CudaEvent {
 public:
  CudaEvent() = default;
  CudaEvent(const CudaEvent&) = delete;
  CudaEvent& operator=(const CudaEvent&) = delete;
  ~CudaEvent();

  // timing: the event can be an end of cudaEventElapsedTime; otherwise it is cheaper to
  // record and to wait on. blocking_sync: cudaEventSynchronize sleeps until the event instead
  // of spinning a core.
  absl::Status Create(bool timing, bool blocking_sync = false);
  cudaEvent_t get() const { return event_; }

 private:
  cudaEvent_t event_ = nullptr;
};

class CudaStream {
 public:
  CudaStream() = default;
  CudaStream(const CudaStream&) = delete;
  CudaStream& operator=(const CudaStream&) = delete;
  ~CudaStream();

  // A non-blocking stream: it does not wait for the legacy default stream.
  absl::Status Create();
  cudaStream_t get() const { return stream_; }

 private:
  cudaStream_t stream_ = nullptr;
};

// Milliseconds between two completed timing events, in seconds; 0 when CUDA refuses.
double ElapsedSeconds(const CudaEvent& start, const CudaEvent& end);

}  // namespace attnd::cuda_backend
