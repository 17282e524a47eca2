// The batch prefill planner (plan/prefill_plan.h): query tiles, split-KV, the Hopper kernel's
// requests, determinism.
#include "plan/prefill_plan.h"

#include <algorithm>
#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "gtest/gtest.h"
#include "step_batch_test_util.h"  // Input

namespace attnd {
namespace {

using testing::Input;

TEST(PrefillPlanTest, PicksTheQueryTilePerRequestFromItsOwnLength) {
  EXPECT_EQ(plan::PrefillQueryTileRows(1, 128, false), 16);
  EXPECT_EQ(plan::PrefillQueryTileRows(16, 128, false), 16);
  EXPECT_EQ(plan::PrefillQueryTileRows(17, 128, false), 64);
  EXPECT_EQ(plan::PrefillQueryTileRows(64, 128, false), 64);
  EXPECT_EQ(plan::PrefillQueryTileRows(65, 128, false), 128);
  EXPECT_EQ(plan::PrefillQueryTileRows(65, 256, false), 64);
  EXPECT_EQ(plan::PrefillQueryTileRows(65, 256, true), 128);  // the Hopper kernel: 128 at every head_dim
  EXPECT_EQ(plan::PrefillQueryTileRows(64, 256, true), 64);

  // Group 4: 2 tokens -> 8 packed rows (tile 16); 100 tokens -> 400 rows (tile 128).
  const std::vector<int32_t> qo_indptr = {0, 2, 102, 102};
  const std::vector<int32_t> kv_lengths = {50, 100, 7};
  auto plan = plan::PlanPrefill(Input(qo_indptr, kv_lengths, 8, 2, 128));
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_EQ(plan->launches.size(), 2u);
  EXPECT_EQ(plan->launches[0].tile_rows, 128);
  EXPECT_EQ(plan->launches[0].num_items, 4);  // ceil(400 / 128)
  EXPECT_EQ(plan->launches[1].tile_rows, 16);
  EXPECT_EQ(plan->launches[1].num_items, 1);
  EXPECT_EQ(plan->NumCtas(), 10);
  // Heaviest first: the causal diagonal makes the last query tile the longest.
  EXPECT_EQ(plan->items[0].packed_row_start, 384);
  for (const plan::PrefillWorkItem& item : plan->items) EXPECT_NE(item.request, 2) << "padding slot got a CTA";
}

TEST(PrefillPlanTest, SplitsKvWhenTheBatchUnderfillsTheWave) {
  // One request, 8 packed rows -> one tile-16 CTA per KV head: 2 CTAs for a wave of 264.
  const std::vector<int32_t> qo_indptr = {0, 2};
  const std::vector<int32_t> kv_lengths = {10000};
  plan::PrefillPlanInput input = Input(qo_indptr, kv_lengths, 8, 2, 128);
  input.ctas_per_wave = {264, 264, 264, 132};
  auto plan = plan::PlanPrefill(input);
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_TRUE(plan->split_kv());
  const int32_t chunk = plan->request_chunk_tokens[0];
  EXPECT_GE(chunk, 256);
  EXPECT_EQ(chunk % 64, 0);
  EXPECT_LE(plan->NumCtas(), 264);
  const int32_t chunks = (10000 + chunk - 1) / chunk;
  EXPECT_EQ(plan->num_partials, 2 * chunks);
  EXPECT_EQ(plan->num_merge_rows(), 2);
  EXPECT_EQ(plan->merge_indptr, (std::vector<int32_t>{0, chunks, 2 * chunks}));
  // Chunks cover the keys in order, without overlap.
  std::vector<plan::PrefillWorkItem> items = plan->items;
  std::sort(items.begin(), items.end(), [](const auto& a, const auto& b) { return a.kv_chunk_start < b.kv_chunk_start; });
  int32_t next = 0;
  for (const auto& item : items) {
    EXPECT_EQ(item.kv_chunk_start, next);
    next = item.kv_chunk_end;
  }
  EXPECT_EQ(next, 10000);

  input.disable_split_kv = true;
  EXPECT_FALSE(plan::PlanPrefill(input)->split_kv());
  input.disable_split_kv = false;
  input.ctas_per_wave = {};
  EXPECT_FALSE(plan::PlanPrefill(input)->split_kv());
}

TEST(PrefillPlanTest, DeterministicChunkDependsOnTheRequestAlone) {
  plan::PrefillPlanInput input;
  input.num_qo_heads = 8;
  input.num_kv_heads = 2;
  input.head_dim = 128;
  input.ctas_per_wave = {264, 264, 264, 132};
  input.deterministic = true;
  const std::vector<int32_t> alone_qo = {0, 100};
  const std::vector<int32_t> alone_kv = {5000};
  input.qo_indptr = alone_qo;
  input.kv_lengths = alone_kv;
  const int32_t alone_chunk = plan::PlanPrefill(input)->request_chunk_tokens[0];
  EXPECT_GT(alone_chunk, 0);
  // In a batch that fills the device on its own, the request keeps its chunk.
  std::vector<int32_t> batch_qo = {0, 4000, 4100};
  const std::vector<int32_t> batch_kv = {4000, 5000};
  input.qo_indptr = batch_qo;
  input.kv_lengths = batch_kv;
  EXPECT_EQ(plan::PlanPrefill(input)->request_chunk_tokens[1], alone_chunk);
  input.deterministic = false;
  EXPECT_EQ(plan::PlanPrefill(input)->request_chunk_tokens[1], 0) << "a full batch needs no split";
}

TEST(PrefillPlanTest, HopperTakesTheLongRequestsWhenAvailable) {
  // Group 4: 2 tokens -> 8 packed rows (tile 16, mma.sync); 100 tokens -> 400 rows (Hopper, in
  // 128-row tiles at head_dim 256 too, where the mma.sync kernel stops at 64).
  for (int32_t head_dim : {128, 256}) {
    SCOPED_TRACE(head_dim);
    const std::vector<int32_t> qo_indptr = {0, 2, 102};
    const std::vector<int32_t> kv_lengths = {50, 100};
    plan::PrefillPlanInput input = Input(qo_indptr, kv_lengths, 8, 2, head_dim);
    input.ctas_per_wave = {264, 264, 264, 132, 132};
    auto plan = plan::PlanPrefill(input);
    ASSERT_TRUE(plan.ok()) << plan.status();
    ASSERT_EQ(plan->launches.size(), 2u);
    EXPECT_EQ(plan->launches[0].kernel, plan::PrefillKernel::kHopper);
    EXPECT_EQ(plan->launches[0].tile_rows, 128);
    EXPECT_EQ(plan->launches[0].grid_ctas, 132);  // persistent: one wave
    EXPECT_EQ(plan->launches[1].kernel, plan::PrefillKernel::kMmaSync);
    EXPECT_EQ(plan->launches[1].grid_ctas, 0);
    EXPECT_EQ(plan->launches[1].tile_rows, 16);

    input.kernel = plan::PrefillKernel::kMmaSync;
    plan = plan::PlanPrefill(input);
    ASSERT_TRUE(plan.ok());
    for (const auto& launch : plan->launches) EXPECT_EQ(launch.kernel, plan::PrefillKernel::kMmaSync);

    // Forced: every request in 128-row tiles on the Hopper kernel.
    input.kernel = plan::PrefillKernel::kHopper;
    plan = plan::PlanPrefill(input);
    ASSERT_TRUE(plan.ok());
    ASSERT_EQ(plan->launches.size(), 1u);
    EXPECT_EQ(plan->launches[0].kernel, plan::PrefillKernel::kHopper);
    EXPECT_TRUE(plan->launches[0].per_head);
    EXPECT_EQ(plan->launches[0].num_items, 10);  // (1 + ceil(400 / 128)) x 2 KV heads
    EXPECT_EQ(plan->NumCtas(), 10);

    // Without the Hopper kernel, auto stays on mma.sync (64-row tiles at most at head_dim 256) and
    // forcing it is an error.
    input.ctas_per_wave.hopper_tile128 = 0;
    EXPECT_EQ(plan::PlanPrefill(input).status().code(), absl::StatusCode::kFailedPrecondition);
    input.kernel = plan::PrefillKernel::kAuto;
    plan = plan::PlanPrefill(input);
    ASSERT_TRUE(plan.ok());
    for (const auto& launch : plan->launches) {
      EXPECT_EQ(launch.kernel, plan::PrefillKernel::kMmaSync);
      if (head_dim == 256) {
        EXPECT_LE(launch.tile_rows, 64);
      }
    }
  }
}

// A Hopper launch whose works all have at most one 128-key tile's keys is "short" (its kernel
// pipelines the tile loop across works); one longer work makes the launch long.
TEST(PrefillPlanTest, HopperLaunchIsShortWhenEveryWorkHasAtMost128Keys) {
  struct Case {
    std::vector<int32_t> q_lens, kv_lens;
    bool short_works;
  };
  const Case cases[] = {
      {{64, 64, 64}, {64, 64, 64}, true},
      {{128, 30}, {128, 0}, true},
      {{100, 100}, {128, 129}, false},
      {{32, 32}, {256, 256}, false},
      {{2048}, {2048}, false},
  };
  for (const Case& c : cases) {
    std::vector<int32_t> qo_indptr = {0};
    for (int32_t q : c.q_lens) qo_indptr.push_back(qo_indptr.back() + q);
    plan::PrefillPlanInput input = Input(qo_indptr, c.kv_lens, 32, 8, 128);
    input.ctas_per_wave = {264, 264, 264, 132, 132};
    input.kernel = plan::PrefillKernel::kHopper;
    input.disable_split_kv = true;
    auto plan = plan::PlanPrefill(input);
    ASSERT_TRUE(plan.ok()) << plan.status();
    ASSERT_EQ(plan->launches.size(), 1u);
    EXPECT_EQ(plan->launches[0].short_works, c.short_works) << "kv " << c.kv_lens[0] << ", " << c.kv_lens.back();
  }
}

// The 128-key tiles a Hopper work visits (the planner estimates its time as twice that plus 3).
int64_t HopperWorkTiles(const plan::PrefillWorkItem& item, std::span<const int32_t> qo_indptr,
                        std::span<const int32_t> kv_lengths, int32_t group) {
  const int32_t q_len = qo_indptr[item.request + 1] - qo_indptr[item.request];
  const int32_t kv_len = kv_lengths[item.request];
  const int32_t last_row = std::min(item.packed_row_start + 128, q_len * group) - 1;
  const int64_t keys = std::clamp<int64_t>(kv_len - q_len + last_row / group + 1 - item.kv_chunk_start, 0,
                                           item.kv_chunk_end - item.kv_chunk_start);
  return (keys + 127) / 128;
}

TEST(PrefillPlanTest, HopperWorkIsBalancedOverItsPersistentGrid) {
  // Causal 8 x 2048 and 1 x 8192 + 3 x 1000 (Hq 32, Hkv 8): every (query tile, KV head) once; CTA
  // b of a 132-CTA grid takes items b, b + 132, ...; its estimated time is within one heaviest
  // work of the mean.
  for (const std::vector<int32_t>& q_lens :
       {std::vector<int32_t>(8, 2048), std::vector<int32_t>{8192, 1000, 1000, 1000}}) {
    std::vector<int32_t> qo_indptr = {0};
    for (int32_t q_len : q_lens) qo_indptr.push_back(qo_indptr.back() + q_len);
    const std::vector<int32_t> kv_lengths = q_lens;
    plan::PrefillPlanInput input = Input(qo_indptr, kv_lengths, 32, 8, 128);
    constexpr int32_t kGrid = 132;
    input.ctas_per_wave = {264, 264, 132, 132, kGrid};
    auto plan = plan::PlanPrefill(input);
    ASSERT_TRUE(plan.ok()) << plan.status();
    ASSERT_EQ(plan->launches.size(), 1u);
    const plan::PrefillLaunch& launch = plan->launches[0];
    ASSERT_EQ(launch.kernel, plan::PrefillKernel::kHopper);
    ASSERT_TRUE(launch.per_head);
    EXPECT_EQ(launch.grid_ctas, kGrid);
    EXPECT_EQ(launch.balanced_grid, kGrid);
    EXPECT_FALSE(plan->split_kv());

    // Every (request, tile, head) exactly once.
    std::vector<std::vector<int32_t>> seen(q_lens.size());
    for (size_t r = 0; r < q_lens.size(); ++r) seen[r].assign((q_lens[r] * 4 + 127) / 128 * 8, 0);
    for (const plan::PrefillWorkItem& item : plan->items) {
      ASSERT_GE(item.kv_head, 0);
      ASSERT_LT(item.kv_head, 8);
      ASSERT_EQ(item.packed_row_start % 128, 0);
      ++seen[item.request].at(item.packed_row_start / 128 * 8 + item.kv_head);
    }
    for (const auto& request : seen) {
      for (int32_t count : request) EXPECT_EQ(count, 1);
    }
    ASSERT_EQ(static_cast<int64_t>(plan->items.size()), plan->NumCtas());

    std::vector<int64_t> load(kGrid, 0);
    int64_t total = 0, heaviest = 0;
    for (size_t i = 0; i < plan->items.size(); ++i) {
      const int64_t cost = 2 * HopperWorkTiles(plan->items[i], qo_indptr, kv_lengths, 4) + 3;
      load[i % kGrid] += cost;
      total += cost;
      heaviest = std::max(heaviest, cost);
    }
    EXPECT_LE(*std::max_element(load.begin(), load.end()), total / kGrid + heaviest);
  }
}

TEST(PrefillPlanTest, HopperWorkSharesKvAcrossConcurrentCtas) {
  // Causal 8 x 2048, Hq 32, Hkv 8: 64 (request, KV head) pairs, 64 MB of KV. A round of the grid
  // (the works that run at once) of works longer than 4 tiles reads the KV of at most 4 pairs;
  // the light works (the first 4 tiles of every pair: 16 MB) come last.
  const std::vector<int32_t> q_lens(8, 2048);
  std::vector<int32_t> qo_indptr = {0};
  for (int32_t q_len : q_lens) qo_indptr.push_back(qo_indptr.back() + q_len);
  plan::PrefillPlanInput input = Input(qo_indptr, q_lens, 32, 8, 128);
  constexpr int32_t kGrid = 132;
  input.ctas_per_wave = {264, 264, 132, 132, kGrid};
  auto plan = plan::PlanPrefill(input);
  ASSERT_TRUE(plan.ok()) << plan.status();
  bool light_seen = false;
  for (size_t round = 0; round * kGrid < plan->items.size(); ++round) {
    std::vector<int32_t> pairs;
    bool all_light = true;
    for (size_t i = round * kGrid; i < std::min(plan->items.size(), (round + 1) * kGrid); ++i) {
      const plan::PrefillWorkItem& item = plan->items[i];
      const int64_t tiles = HopperWorkTiles(item, qo_indptr, q_lens, 4);
      all_light &= tiles <= 4;
      if (tiles > 4) {
        EXPECT_FALSE(light_seen) << "round " << round << ": a heavy work after the light ones";
        pairs.push_back(item.request * 8 + item.kv_head);
      }
    }
    light_seen |= all_light;
    std::sort(pairs.begin(), pairs.end());
    EXPECT_LE(std::unique(pairs.begin(), pairs.end()) - pairs.begin(), 4) << "round " << round;
  }
  EXPECT_TRUE(light_seen);
}

TEST(PrefillPlanTest, HopperWorkBelowOneWaveKeepsItsOrder) {
  // 2 tiles x 2 heads on a 132-CTA wave: one CTA per work, heaviest first.
  const std::vector<int32_t> qo_indptr = {0, 64};
  const std::vector<int32_t> kv_lengths = {1000};
  plan::PrefillPlanInput input = Input(qo_indptr, kv_lengths, 8, 2, 128);
  input.ctas_per_wave = {264, 264, 132, 132, 132};
  input.disable_split_kv = true;
  auto plan = plan::PlanPrefill(input);
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_EQ(plan->launches.size(), 1u);
  EXPECT_EQ(plan->launches[0].balanced_grid, 4);
  ASSERT_EQ(plan->items.size(), 4u);
  EXPECT_EQ(plan->items[0].packed_row_start, 128);
  EXPECT_EQ(plan->items[0].kv_head, 0);
  EXPECT_EQ(plan->items[1].kv_head, 1);
  EXPECT_EQ(plan->items[3].packed_row_start, 0);
}

TEST(PrefillPlanTest, RejectsInconsistentInputs) {
  const std::vector<int32_t> qo_indptr = {0, 4};
  const std::vector<int32_t> kv_lengths = {4, 4};
  EXPECT_FALSE(plan::PlanPrefill(Input(qo_indptr, kv_lengths, 8, 2, 128)).ok());
  const std::vector<int32_t> one_kv = {4};
  EXPECT_FALSE(plan::PlanPrefill(Input(qo_indptr, one_kv, 8, 3, 128)).ok());
  EXPECT_FALSE(plan::PlanPrefill(Input(qo_indptr, one_kv, 8, 2, 96)).ok());
  EXPECT_TRUE(plan::PlanPrefill(Input(qo_indptr, one_kv, 8, 2, 64)).ok());
}

}  // namespace
}  // namespace attnd
