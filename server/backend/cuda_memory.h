// Owning handles of CUDA resources the backend reuses: device buffers, pinned host buffers,
// events and streams. Each frees its resource on destruction and ignores errors there (a
// faulted context cannot free anything anyway). None is thread-safe; owners lock.
//
// Buffers grow (Reserve) only at plan time: growing frees the old memory, so the caller must
// know that no queued work still uses it.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <vector>

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
  // so a slowly growing batch does not reallocate at every step. With `retired`, outgrown
  // memory is appended there instead of freed (the caller cudaFree's it later): for buffers
  // that grow while queued work may still use the old memory, or where a cudaFree, which
  // waits for the whole device, must not run.
  absl::Status Reserve(int64_t bytes, std::vector<uint8_t*>* retired = nullptr);
  void Release();

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

  // As DeviceBuffer::Reserve (retired memory is the caller's to cudaFreeHost).
  absl::Status Reserve(int64_t bytes, std::vector<uint8_t*>* retired = nullptr);
  void Release();

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

  // A non-blocking stream: it does not wait for the legacy default stream. greatest_priority:
  // the block scheduler dispatches its kernels' CTAs before those of default-priority streams.
  absl::Status Create(bool greatest_priority = false);
  cudaStream_t get() const { return stream_; }

 private:
  cudaStream_t stream_ = nullptr;
};

// Milliseconds between two completed timing events, in seconds; 0 when CUDA refuses.
double ElapsedSeconds(const CudaEvent& start, const CudaEvent& end);

}  // namespace attnd::cuda_backend
