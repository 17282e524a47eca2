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
  EXPECT_EQ(plan::PrefillQueryTileRows(1, 128), 16);
  EXPECT_EQ(plan::PrefillQueryTileRows(16, 128), 16);
  EXPECT_EQ(plan::PrefillQueryTileRows(17, 128), 64);
  EXPECT_EQ(plan::PrefillQueryTileRows(64, 128), 64);
  EXPECT_EQ(plan::PrefillQueryTileRows(65, 128), 128);
  EXPECT_EQ(plan::PrefillQueryTileRows(65, 256), 64);

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
  // Group 4: 2 tokens -> 8 packed rows (tile 16, mma.sync); 100 tokens -> 400 rows (Hopper).
  const std::vector<int32_t> qo_indptr = {0, 2, 102};
  const std::vector<int32_t> kv_lengths = {50, 100};
  plan::PrefillPlanInput input = Input(qo_indptr, kv_lengths, 8, 2, 128);
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
  EXPECT_EQ(plan->launches[0].num_items, 5);  // 1 + ceil(400 / 128)

  // Without the Hopper kernel, auto stays on mma.sync and forcing it is an error.
  input.ctas_per_wave.hopper_tile128 = 0;
  EXPECT_EQ(plan::PlanPrefill(input).status().code(), absl::StatusCode::kFailedPrecondition);
  input.kernel = plan::PrefillKernel::kAuto;
  plan = plan::PlanPrefill(input);
  ASSERT_TRUE(plan.ok());
  for (const auto& launch : plan->launches) EXPECT_EQ(launch.kernel, plan::PrefillKernel::kMmaSync);
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
