#include "engine/page_allocator.h"

#include <cstdio>
#include <cstdlib>

namespace attnd {

PageAllocator::PageAllocator(int64_t num_pages) : in_use_(num_pages, false) {
  free_.reserve(num_pages);
  // Hand out low ids first: pages in use stay packed at the front of the pool.
  for (int64_t page = num_pages - 1; page >= 0; --page) free_.push_back(static_cast<int32_t>(page));
}

bool PageAllocator::Allocate(int64_t count, std::vector<int32_t>& out) {
  if (count < 0 || count > free_pages()) return false;
  for (int64_t i = 0; i < count; ++i) {
    const int32_t page = free_.back();
    free_.pop_back();
    in_use_[page] = true;
    out.push_back(page);
  }
  return true;
}

void PageAllocator::Free(std::span<const int32_t> pages) {
  for (const int32_t page : pages) {
    if (page < 0 || page >= num_pages() || !in_use_[page]) {
      std::fprintf(stderr, "attnd: internal error: freeing page %d that is not allocated\n", page);
      std::abort();
    }
    in_use_[page] = false;
    free_.push_back(page);
  }
}

}  // namespace attnd
