// Free-list allocator of one cache's page ids. Not thread-safe: the engine serialises access.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace attnd {

class PageAllocator {
 public:
  explicit PageAllocator(int64_t num_pages);

  int64_t num_pages() const { return static_cast<int64_t>(in_use_.size()); }
  int64_t free_pages() const { return static_cast<int64_t>(free_.size()); }
  int64_t used_pages() const { return num_pages() - free_pages(); }

  // Appends `count` page ids to `out` and returns true, or returns false and changes nothing
  // when fewer than `count` pages are free.
  bool Allocate(int64_t count, std::vector<int32_t>& out);

  // Returns pages to the pool. Each must be allocated (checked: a double free is a bug in the
  // engine and aborts rather than corrupting another sequence's pages).
  void Free(std::span<const int32_t> pages);

 private:
  std::vector<int32_t> free_;  // stack: the most recently freed page is reused first
  std::vector<bool> in_use_;
};

}  // namespace attnd
