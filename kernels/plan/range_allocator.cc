#include "plan/range_allocator.h"

#include <algorithm>
#include <iterator>

namespace attnd::plan {

RangeAllocator::RangeAllocator(int64_t capacity_bytes, int64_t alignment)
    : capacity_bytes_(capacity_bytes & ~(alignment - 1)),
      alignment_(alignment),
      free_bytes_(capacity_bytes_) {
  if (capacity_bytes_ > 0) free_[0] = capacity_bytes_;
}

std::optional<int64_t> RangeAllocator::Allocate(int64_t bytes) {
  if (bytes <= 0) return std::nullopt;
  const int64_t size = Rounded(bytes);
  for (auto it = free_.begin(); it != free_.end(); ++it) {
    if (it->second < size) continue;
    const int64_t offset = it->first;
    const int64_t rest = it->second - size;
    free_.erase(it);
    if (rest > 0) free_[offset + size] = rest;
    free_bytes_ -= size;
    return offset;
  }
  return std::nullopt;
}

void RangeAllocator::Free(int64_t offset, int64_t bytes) {
  int64_t begin = offset;
  int64_t size = Rounded(bytes);
  free_bytes_ += size;
  auto next = free_.lower_bound(begin);
  if (next != free_.end() && begin + size == next->first) {
    size += next->second;
    next = free_.erase(next);
  }
  if (next != free_.begin()) {
    auto previous = std::prev(next);
    if (previous->first + previous->second == begin) {
      begin = previous->first;
      size += previous->second;
      free_.erase(previous);
    }
  }
  free_[begin] = size;
}

int64_t RangeAllocator::largest_free_range() const {
  int64_t largest = 0;
  for (const auto& [offset, size] : free_) largest = std::max(largest, size);
  return largest;
}

}  // namespace attnd::plan
