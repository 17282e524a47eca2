#include "engine/page_allocator.h"

#include <cstdio>
#include <cstdlib>

namespace attnd {

PageAllocator::PageAllocator(int64_t num_pages) : refs_(num_pages, 0) {
  free_.reserve(num_pages);
  // Hand out low ids first: pages in use stay packed at the front of the pool.
  for (int64_t page = num_pages - 1; page >= 0; --page) free_.push_back(static_cast<int32_t>(page));
}

bool PageAllocator::Allocate(int64_t count, std::vector<int32_t>& out) {
  if (count < 0 || count > free_pages()) return false;
  for (int64_t i = 0; i < count; ++i) {
    const int32_t page = free_.back();
    free_.pop_back();
    refs_[page] = 1;
    out.push_back(page);
  }
  return true;
}

void PageAllocator::CheckAllocated(int32_t page) const {
  if (page < 0 || page >= num_pages() || refs_[page] == 0) {
    std::fprintf(stderr, "attnd: internal error: page %d is not allocated\n", page);
    std::abort();
  }
}

void PageAllocator::Share(std::span<const int32_t> pages) {
  for (const int32_t page : pages) {
    CheckAllocated(page);
    if (++refs_[page] == 2) ++shared_;
  }
}

int64_t PageAllocator::Free(std::span<const int32_t> pages) {
  int64_t returned = 0;
  for (const int32_t page : pages) {
    CheckAllocated(page);
    const int32_t left = --refs_[page];
    if (left == 1) --shared_;
    if (left == 0) {
      free_.push_back(page);
      ++returned;
    }
  }
  return returned;
}

}  // namespace attnd
