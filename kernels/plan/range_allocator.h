// First-fit allocation of byte ranges inside one reservation (the CUDA backend's KV budget,
// cudaMalloc'd once at start): caches carve their pools from it and give them back on
// destruction. Plain C++ over offsets, so it is tested without a GPU. Not thread-safe.
#pragma once

#include <cstdint>
#include <map>
#include <optional>

namespace attnd::plan {

class RangeAllocator {
 public:
  // Ranges start at multiples of `alignment` (a power of two) and are rounded up to it.
  RangeAllocator(int64_t capacity_bytes, int64_t alignment);

  // Offset of a free range of at least `bytes` (the lowest that fits), or nullopt.
  std::optional<int64_t> Allocate(int64_t bytes);
  // Returns a range from Allocate (same offset and requested size); merges with neighbours.
  void Free(int64_t offset, int64_t bytes);

  int64_t capacity_bytes() const { return capacity_bytes_; }
  int64_t free_bytes() const { return free_bytes_; }
  int64_t largest_free_range() const;

 private:
  int64_t Rounded(int64_t bytes) const { return (bytes + alignment_ - 1) & ~(alignment_ - 1); }

  int64_t capacity_bytes_;
  int64_t alignment_;
  int64_t free_bytes_;
  std::map<int64_t, int64_t> free_;  // offset -> size of each maximal free range
};

}  // namespace attnd::plan
