// The shared pool behind every reference op (reference/parallel.h).
#include "reference/parallel.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <thread>
#include <vector>

#include <sched.h>

namespace attnd::reference {
namespace {

TEST(ParallelFor, RunsEveryIndexExactlyOnce) {
  for (const int64_t count : {0, 1, 2, 3, 1000}) {
    std::vector<std::atomic<int>> runs(count);
    ParallelFor(count, [&](int64_t i) { runs[i].fetch_add(1); });
    for (int64_t i = 0; i < count; ++i) ASSERT_EQ(runs[i].load(), 1) << i << " of " << count;
  }
}

TEST(ParallelFor, UsesEveryCpuTheProcessMayRunOn) {
  int usable = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  cpu_set_t allowed;
  ASSERT_EQ(sched_getaffinity(0, sizeof allowed, &allowed), 0);
  usable = std::min(usable, CPU_COUNT(&allowed));
  EXPECT_EQ(ParallelismLevel(), usable);
}

TEST(ParallelFor, ConcurrentCallersEachCompleteTheirOwnWork) {
  constexpr int kCallers = 6;
  std::vector<std::atomic<int64_t>> sums(kCallers);
  std::vector<std::thread> callers;
  for (int c = 0; c < kCallers; ++c) {
    callers.emplace_back([&, c] {
      for (int repeat = 0; repeat < 50; ++repeat)
        ParallelFor(100, [&](int64_t i) { sums[c].fetch_add(i + 1); });
    });
  }
  for (std::thread& caller : callers) caller.join();
  for (int c = 0; c < kCallers; ++c) EXPECT_EQ(sums[c].load(), 50 * 5050) << c;
}

TEST(ParallelFor, NestedCallsFromInsideATaskDoNotDeadlock) {
  std::atomic<int64_t> total{0};
  ParallelFor(8, [&](int64_t) { ParallelFor(8, [&](int64_t j) { total.fetch_add(j); }); });
  EXPECT_EQ(total.load(), 8 * 28);
}

}  // namespace
}  // namespace attnd::reference
