// Free-list allocator of one cache's page ids, with a reference count per page: a forked
// sequence shares its source's prefix pages (ForkSequence) and an export pins the pages it reads,
// so a page returns to the pool when its last holder lets go. Not thread-safe: the engine
// serialises access.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace attnd {

class PageAllocator {
 public:
  explicit PageAllocator(int64_t num_pages);

  int64_t num_pages() const { return static_cast<int64_t>(refs_.size()); }
  int64_t free_pages() const { return static_cast<int64_t>(free_.size()); }
  // Pages held at least once: a page shared by several sequences counts once.
  int64_t used_pages() const { return num_pages() - free_pages(); }
  // Pages held more than once (shared prefixes, pinned by exports).
  int64_t shared_pages() const { return shared_; }
  int32_t holders(int32_t page) const { return refs_[page]; }

  // Appends `count` page ids (each with one holder) to `out` and returns true, or returns
  // false and changes nothing when fewer than `count` pages are free.
  bool Allocate(int64_t count, std::vector<int32_t>& out);

  // Adds a holder to each page. Each must be allocated (checked, as in Free).
  void Share(std::span<const int32_t> pages);

  // Drops a holder of each page; a page with no holder left returns to the pool. Returns how
  // many did. Each must be allocated (checked: a double free is a bug in the engine and aborts
  // rather than corrupting another sequence's pages).
  int64_t Free(std::span<const int32_t> pages);

 private:
  void CheckAllocated(int32_t page) const;

  std::vector<int32_t> free_;  // stack: the most recently freed page is reused first
  std::vector<int32_t> refs_;  // holders per page; 0 = free
  int64_t shared_ = 0;         // pages with refs_ > 1
};

}  // namespace attnd
