#include "engine/page_allocator.h"

#include <algorithm>

#include <gtest/gtest.h>

namespace attnd {
namespace {

TEST(PageAllocatorTest, HandsOutEveryPageOnceThenRefuses) {
  PageAllocator allocator(8);
  std::vector<int32_t> pages;
  ASSERT_TRUE(allocator.Allocate(8, pages));
  std::vector<int32_t> sorted = pages;
  std::sort(sorted.begin(), sorted.end());
  EXPECT_EQ(sorted, (std::vector<int32_t>{0, 1, 2, 3, 4, 5, 6, 7}));
  EXPECT_EQ(allocator.free_pages(), 0);
  EXPECT_FALSE(allocator.Allocate(1, pages));
  EXPECT_EQ(pages.size(), 8u);
}

TEST(PageAllocatorTest, FailedAllocationChangesNothing) {
  PageAllocator allocator(4);
  std::vector<int32_t> pages;
  ASSERT_TRUE(allocator.Allocate(3, pages));
  EXPECT_FALSE(allocator.Allocate(2, pages));
  EXPECT_EQ(pages.size(), 3u);
  EXPECT_EQ(allocator.free_pages(), 1);
  EXPECT_EQ(allocator.used_pages(), 3);
}

TEST(PageAllocatorTest, FreedPagesAreReused) {
  PageAllocator allocator(2);
  std::vector<int32_t> pages;
  ASSERT_TRUE(allocator.Allocate(2, pages));
  allocator.Free(std::span<const int32_t>(pages).subspan(0, 1));
  std::vector<int32_t> again;
  ASSERT_TRUE(allocator.Allocate(1, again));
  EXPECT_EQ(again[0], pages[0]);
}

TEST(PageAllocatorTest, SharedPageReturnsWithItsLastHolder) {
  PageAllocator allocator(4);
  std::vector<int32_t> pages;
  ASSERT_TRUE(allocator.Allocate(2, pages));
  allocator.Share(pages);
  allocator.Share(std::span<const int32_t>(pages).subspan(0, 1));
  EXPECT_EQ(allocator.used_pages(), 2);  // counted once however many hold them
  EXPECT_EQ(allocator.shared_pages(), 2);
  EXPECT_EQ(allocator.holders(pages[0]), 3);
  EXPECT_EQ(allocator.Free(pages), 0);
  EXPECT_EQ(allocator.shared_pages(), 1);
  EXPECT_EQ(allocator.Free(pages), 1);  // pages[1]'s last holder
  EXPECT_EQ(allocator.shared_pages(), 0);
  EXPECT_EQ(allocator.used_pages(), 1);
  EXPECT_EQ(allocator.Free(std::span<const int32_t>(pages).subspan(0, 1)), 1);
  EXPECT_EQ(allocator.free_pages(), 4);
}

TEST(PageAllocatorDeathTest, SharingAFreePageAborts) {
  PageAllocator allocator(2);
  const std::vector<int32_t> pages = {1};
  EXPECT_DEATH(allocator.Share(pages), "not allocated");
}

TEST(PageAllocatorDeathTest, DoubleFreeAbortsInsteadOfCorrupting) {
  PageAllocator allocator(2);
  std::vector<int32_t> pages;
  ASSERT_TRUE(allocator.Allocate(1, pages));
  allocator.Free(pages);
  EXPECT_DEATH(allocator.Free(pages), "not allocated");
}

}  // namespace
}  // namespace attnd
