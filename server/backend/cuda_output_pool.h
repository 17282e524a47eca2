// Pinned host buffers that a layer's outputs are copied into (device -> host) and then lent to
// the service, which sends them from there (OutputLease) instead of copying them into a
// message. A lent buffer may outlive its step and its cache (gRPC releases it once the bytes
// are written), so the pool is shared: each lent buffer holds a reference to it.
//
// Thread-safe. Take never blocks on the device; it allocates only when no free buffer is large
// enough (the first steps, or a larger step), which Reserve does ahead of time at plan time.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "absl/status/statusor.h"
#include "backend/cuda_memory.h"

namespace attnd::cuda_backend {

class OutputPool : public std::enable_shared_from_this<OutputPool> {
 public:
  struct Buffer {
    PinnedBuffer memory;
    std::shared_ptr<OutputPool> owner;  // set while taken
  };

  static std::shared_ptr<OutputPool> Create() { return std::shared_ptr<OutputPool>(new OutputPool); }

  // Makes sure `count` free buffers of at least `bytes` exist.
  absl::Status Reserve(int count, int64_t bytes);
  // A buffer of at least `bytes`, owned by the caller until Return (or Release through the
  // buffer's owner reference).
  absl::StatusOr<Buffer*> Take(int64_t bytes);
  static void Return(Buffer* buffer);
  // OutputLease::release: `arg` is a Buffer*.
  static void ReleaseLease(void* arg) { Return(static_cast<Buffer*>(arg)); }

 private:
  OutputPool() = default;

  std::mutex mu_;
  std::vector<Buffer*> free_;
  std::vector<std::unique_ptr<Buffer>> all_;  // owns every buffer, free or taken
};

}  // namespace attnd::cuda_backend
