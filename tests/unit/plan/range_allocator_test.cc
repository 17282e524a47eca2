// The CUDA backend's first-fit allocator of its KV budget (plan/range_allocator.h).
#include "plan/range_allocator.h"

#include <optional>

#include "gtest/gtest.h"

namespace attnd::plan {
namespace {

TEST(RangeAllocatorTest, TakesTheLowestRangeThatFits) {
  RangeAllocator ranges(4096, 256);
  EXPECT_EQ(ranges.Allocate(1000), 0);     // rounded to 1024
  EXPECT_EQ(ranges.Allocate(256), 1024);
  EXPECT_EQ(ranges.Allocate(512), 1280);
  EXPECT_EQ(ranges.free_bytes(), 4096 - 1792);
  ranges.Free(0, 1000);
  EXPECT_EQ(ranges.Allocate(512), 0);       // first fit, in the freed hole
  EXPECT_EQ(ranges.Allocate(2304), 1792);   // the tail
  EXPECT_EQ(ranges.Allocate(768), std::nullopt);
  EXPECT_EQ(ranges.Allocate(512), 512);
  EXPECT_EQ(ranges.free_bytes(), 0);
}

TEST(RangeAllocatorTest, FreedNeighboursMergeIntoOneRange) {
  RangeAllocator ranges(3 * 1024, 1024);
  const auto a = ranges.Allocate(1024);
  const auto b = ranges.Allocate(1024);
  const auto c = ranges.Allocate(1024);
  ASSERT_TRUE(a && b && c);
  ranges.Free(*a, 1024);
  ranges.Free(*c, 1024);
  EXPECT_EQ(ranges.largest_free_range(), 1024);
  EXPECT_EQ(ranges.Allocate(2048), std::nullopt);
  ranges.Free(*b, 1024);
  EXPECT_EQ(ranges.largest_free_range(), 3 * 1024);
  EXPECT_EQ(ranges.Allocate(3 * 1024), 0);
}

TEST(RangeAllocatorTest, RefusesEmptyAndOversizedRequests) {
  RangeAllocator ranges(1 << 20, 256);
  EXPECT_EQ(ranges.Allocate(0), std::nullopt);
  EXPECT_EQ(ranges.Allocate((1 << 20) + 1), std::nullopt);
  EXPECT_EQ(ranges.free_bytes(), 1 << 20);
}

}  // namespace
}  // namespace attnd::plan
