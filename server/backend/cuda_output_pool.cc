#include "backend/cuda_output_pool.h"

#include <utility>

#include "attnd/status_macros.h"

namespace attnd::cuda_backend {

absl::Status OutputPool::Reserve(int count, int64_t bytes) {
  std::vector<Buffer*> grown;
  {
    std::lock_guard lock(mu_);
    int large_enough = 0;
    for (Buffer* buffer : free_) large_enough += buffer->memory.capacity() >= bytes ? 1 : 0;
    // Take the small free buffers to grow them outside the lock, and make new ones.
    for (size_t i = 0; i < free_.size() && large_enough + static_cast<int>(grown.size()) < count;) {
      if (free_[i]->memory.capacity() < bytes) {
        grown.push_back(free_[i]);
        free_.erase(free_.begin() + static_cast<std::ptrdiff_t>(i));
      } else {
        ++i;
      }
    }
    while (large_enough + static_cast<int>(grown.size()) < count) {
      all_.push_back(std::make_unique<Buffer>());
      grown.push_back(all_.back().get());
    }
  }
  absl::Status status;
  for (Buffer* buffer : grown) {
    if (status.ok()) status = buffer->memory.Reserve(bytes);
  }
  std::lock_guard lock(mu_);
  free_.insert(free_.end(), grown.begin(), grown.end());
  return status;
}

absl::StatusOr<OutputPool::Buffer*> OutputPool::Take(int64_t bytes) {
  Buffer* buffer = nullptr;
  {
    std::lock_guard lock(mu_);
    for (size_t i = free_.size(); i-- > 0;) {
      if (free_[i]->memory.capacity() >= bytes) {
        buffer = free_[i];
        free_.erase(free_.begin() + static_cast<std::ptrdiff_t>(i));
        break;
      }
    }
    if (buffer == nullptr && !free_.empty()) {
      buffer = free_.back();
      free_.pop_back();
    }
    if (buffer == nullptr) {
      all_.push_back(std::make_unique<Buffer>());
      buffer = all_.back().get();
    }
  }
  if (absl::Status grown = buffer->memory.Reserve(bytes); !grown.ok()) {
    std::lock_guard lock(mu_);
    free_.push_back(buffer);
    return grown;
  }
  buffer->owner = shared_from_this();
  return buffer;
}

void OutputPool::Return(Buffer* buffer) {
  // The buffer's reference may be the pool's last (its cache is gone): drop it after unlocking.
  std::shared_ptr<OutputPool> owner = std::move(buffer->owner);
  std::lock_guard lock(owner->mu_);
  owner->free_.push_back(buffer);
}

}  // namespace attnd::cuda_backend
