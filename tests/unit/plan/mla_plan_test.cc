#include "plan/mla_plan.h"

#include <algorithm>
#include <cstdint>
#include <map>
#include <numeric>
#include <tuple>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace attnd::plan {
namespace {

std::vector<int32_t> Rows(const std::vector<int32_t>& q_lens) {
  std::vector<int32_t> indptr = {0};
  for (int32_t q_len : q_lens) indptr.push_back(indptr.back() + q_len);
  return indptr;
}

std::vector<int32_t> DecodeRows(size_t batch_size) { return Rows(std::vector<int32_t>(batch_size, 1)); }

MlaPlanOptions Options(int32_t num_heads, int32_t ctas_per_wave, MlaSplitMode mode) {
  MlaPlanOptions options;
  options.num_heads = num_heads;
  options.ctas_per_wave = ctas_per_wave;
  options.split_mode = mode;
  return options;
}

int64_t ChunksOf(const MlaPlan& plan, int32_t request) {
  int64_t count = 0;
  for (const MlaWorkUnit& unit : plan.units) count += unit.request == request && unit.row_begin == 0;
  return count;
}

// Every (request, row tile) covers the request's keys exactly once, chunk after chunk; every
// row tile of the request appears for every chunk.
void ExpectCovers(const MlaPlan& plan, const std::vector<int32_t>& qo_indptr,
                  const std::vector<int64_t>& lengths, int32_t num_heads) {
  std::map<std::pair<int32_t, int32_t>, std::vector<std::pair<int32_t, int32_t>>> ranges;
  for (const MlaWorkUnit& unit : plan.units) {
    ASSERT_GE(unit.request, 0);
    EXPECT_EQ(unit.q_row, qo_indptr[unit.request]);
    EXPECT_EQ(unit.q_len, qo_indptr[unit.request + 1] - qo_indptr[unit.request]);
    EXPECT_EQ(unit.kv_len, lengths[unit.request]);
    EXPECT_EQ(unit.row_begin % kMlaRowsPerCta, 0);
    EXPECT_LT(unit.row_begin, unit.q_len * num_heads);
    ranges[{unit.request, unit.row_begin}].push_back({unit.kv_begin, unit.kv_end});
  }
  for (size_t b = 0; b < lengths.size(); ++b) {
    const int32_t q_len = qo_indptr[b + 1] - qo_indptr[b];
    const int32_t tiles = (q_len * num_heads + kMlaRowsPerCta - 1) / kMlaRowsPerCta;
    for (int32_t tile = 0; tile < tiles; ++tile) {
      auto found = ranges.find({static_cast<int32_t>(b), tile * kMlaRowsPerCta});
      ASSERT_NE(found, ranges.end()) << "request " << b << " tile " << tile;
      std::vector<std::pair<int32_t, int32_t>> chunks = found->second;
      std::sort(chunks.begin(), chunks.end());
      int64_t next = 0;
      for (const auto& [begin, end] : chunks) {
        EXPECT_EQ(begin, next) << "request " << b;
        EXPECT_LE(begin, end);
        next = end;
      }
      EXPECT_EQ(next, lengths[b]) << "request " << b;
    }
    if (q_len == 0) {
      EXPECT_EQ(ranges.count({static_cast<int32_t>(b), 0}), 0u) << "padding slot got work";
    }
  }
}

TEST(PlanMlaDecodeTest, PaddingSlotsGetNoWorkAndEmptyBatchesNoPlan) {
  const std::vector<int64_t> lengths = {100, 5000};
  auto plan = PlanMlaDecode(Rows({0, 0}), lengths, Options(128, 132, MlaSplitMode::kAuto));
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->num_units(), 0);
  EXPECT_EQ(plan->kv_chunk_tokens, 0);
  EXPECT_EQ(plan->num_partials, 0);
}

TEST(PlanMlaDecodeTest, CutsRowsIntoTilesOfTheKernelsRows) {
  // 128 heads x 3 tokens = 384 rows: 6 tiles; 20 heads x 4 tokens = 80 rows: 2 tiles.
  const std::vector<int32_t> qo_indptr = Rows({3});
  const std::vector<int64_t> lengths = {1000};
  auto plan = PlanMlaDecode(qo_indptr, lengths, Options(128, 132, MlaSplitMode::kNone));
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->num_units(), 6);
  ExpectCovers(*plan, qo_indptr, lengths, 128);
  auto small = PlanMlaDecode(Rows({4}), lengths, Options(20, 132, MlaSplitMode::kNone));
  ASSERT_TRUE(small.ok());
  EXPECT_EQ(small->num_units(), 2);
}

TEST(PlanMlaDecodeTest, NoSplitGivesOneChunkPerRequestWritingOutputDirectly) {
  const std::vector<int64_t> lengths = {131072, 4096, 0, 7};
  auto plan = PlanMlaDecode(DecodeRows(4), lengths, Options(128, 132, MlaSplitMode::kNone));
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->mode, MlaSplitMode::kNone);
  EXPECT_EQ(plan->num_units(), 8);
  EXPECT_EQ(plan->num_partials, 0);
  EXPECT_EQ(plan->num_merge_rows(), 0);
  for (const MlaWorkUnit& unit : plan->units) EXPECT_EQ(unit.partial_first, -1);
  ExpectCovers(*plan, DecodeRows(4), lengths, 128);
}

TEST(PlanMlaDecodeTest, OneWaveUsesTheSmallestChunkThatFitsTheWave) {
  const std::vector<int64_t> lengths = {131072, 4096, 8192, 16384};
  auto plan = PlanMlaDecode(DecodeRows(4), lengths, Options(128, 132, MlaSplitMode::kOneWave));
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->mode, MlaSplitMode::kOneWave);
  EXPECT_LE(plan->num_units(), 132);
  EXPECT_EQ(plan->kv_chunk_tokens % kMlaChunkTokens, 0);
  // One granule less would not fit.
  const int64_t smaller = plan->kv_chunk_tokens - kMlaChunkTokens;
  int64_t ctas = 0;
  for (int64_t length : lengths) ctas += 2 * std::max<int64_t>(1, (length + smaller - 1) / smaller);
  EXPECT_GT(ctas, 132);
  ExpectCovers(*plan, DecodeRows(4), lengths, 128);
}

TEST(PlanMlaDecodeTest, OneWaveCannotSplitWhenTheBatchFillsTheWave) {
  // 64 requests x 2 row tiles = 128 CTAs of 132: almost nothing left to split with.
  std::vector<int64_t> lengths(64, 4096);
  lengths[10] = 131072;
  auto plan = PlanMlaDecode(DecodeRows(64), lengths, Options(128, 132, MlaSplitMode::kOneWave));
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_GE(plan->kv_chunk_tokens, 131072 / 3);
}

TEST(PlanMlaDecodeTest, OversubscriptionChunkFollowsTheLongestSequence) {
  const std::vector<int64_t> lengths = {131072, 4096, 100, 0};
  MlaPlanOptions options = Options(128, 132, MlaSplitMode::kOversubscribe);
  options.min_tokens_per_cta = 2048;
  options.max_splits = 1000;
  options.max_waves = 100;
  options.oversubscribe_candidates = 1;  // the plain rule
  auto plan = PlanMlaDecode(DecodeRows(4), lengths, options);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->mode, MlaSplitMode::kOversubscribe);
  // ceil(131072 / 2048) = 64 splits of 2048 keys; short requests get fewer chunks.
  EXPECT_EQ(plan->kv_chunk_tokens, 2048);
  EXPECT_EQ(plan->max_chunks, 64);
  EXPECT_EQ(ChunksOf(*plan, 0), 64);
  EXPECT_EQ(ChunksOf(*plan, 1), 2);
  EXPECT_EQ(ChunksOf(*plan, 2), 1);
  EXPECT_EQ(ChunksOf(*plan, 3), 1);
  EXPECT_EQ(plan->num_units(), 2 * (64 + 2 + 1 + 1));
  ExpectCovers(*plan, DecodeRows(4), lengths, 128);
}

TEST(PlanMlaDecodeTest, OversubscriptionIsCappedByMaxSplitsAndMaxWaves) {
  const std::vector<int64_t> lengths = {131072, 65536, 32768};
  MlaPlanOptions options = Options(128, 132, MlaSplitMode::kOversubscribe);
  options.min_tokens_per_cta = 256;
  options.max_splits = 16;
  options.max_waves = 100;
  options.oversubscribe_candidates = 1;
  auto split_capped = PlanMlaDecode(DecodeRows(3), lengths, options);
  ASSERT_TRUE(split_capped.ok());
  EXPECT_EQ(split_capped->max_chunks, 16);
  EXPECT_EQ(split_capped->kv_chunk_tokens, 131072 / 16);

  options.max_splits = 1024;
  options.max_waves = 2;
  auto wave_capped = PlanMlaDecode(DecodeRows(3), lengths, options);
  ASSERT_TRUE(wave_capped.ok());
  EXPECT_LE(wave_capped->num_units(), 2 * 132);
  EXPECT_GT(wave_capped->num_units(), 132);
  ExpectCovers(*wave_capped, DecodeRows(3), lengths, 128);
}

TEST(PlanMlaDecodeTest, PartialSlotsAreContiguousPerTokenInChunkOrder) {
  // Two tokens, 16 heads, 3 chunks: token t of chunk c writes slot t * 3 + c.
  const std::vector<int32_t> qo_indptr = Rows({1, 2});
  const std::vector<int64_t> lengths = {10, 300};
  MlaPlanOptions options = Options(16, 132, MlaSplitMode::kAuto);
  options.fixed_split_tokens = 100;
  auto plan = PlanMlaDecode(qo_indptr, lengths, options);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->mode, MlaSplitMode::kFixed);
  EXPECT_EQ(plan->num_partials, 6);
  EXPECT_THAT(plan->merge_indptr, ::testing::ElementsAre(0, 3, 6));
  EXPECT_THAT(plan->merge_q_row, ::testing::ElementsAre(1, 2));
  for (const MlaWorkUnit& unit : plan->units) {
    if (unit.request == 0) {
      EXPECT_EQ(unit.partial_first, -1);
      continue;
    }
    EXPECT_EQ(unit.partial_stride, 3);
    EXPECT_EQ(unit.partial_first, unit.kv_begin / 100);
  }
  ExpectCovers(*plan, qo_indptr, lengths, 16);
}

TEST(PlanMlaDecodeTest, LaunchesLongestChunksFirstWithRowTilesAdjacent) {
  const std::vector<int64_t> lengths = {500, 131072, 3000, 70000};
  MlaPlanOptions options = Options(128, 132, MlaSplitMode::kOversubscribe);
  auto plan = PlanMlaDecode(DecodeRows(4), lengths, options);
  ASSERT_TRUE(plan.ok()) << plan.status();
  for (int32_t i = 1; i < plan->num_units(); ++i) {
    const MlaWorkUnit& a = plan->units[i - 1];
    const MlaWorkUnit& b = plan->units[i];
    EXPECT_GE(a.kv_end - a.kv_begin, b.kv_end - b.kv_begin) << "unit " << i;
  }
  for (int32_t i = 0; i + 1 < plan->num_units(); i += 2) {
    EXPECT_EQ(plan->units[i].row_begin, 0);
    EXPECT_EQ(plan->units[i + 1].row_begin, kMlaRowsPerCta);
    EXPECT_EQ(plan->units[i].kv_begin, plan->units[i + 1].kv_begin);
    EXPECT_EQ(plan->units[i].request, plan->units[i + 1].request);
  }
  options.longest_first = false;
  auto in_order = PlanMlaDecode(DecodeRows(4), lengths, options);
  ASSERT_TRUE(in_order.ok());
  EXPECT_EQ(in_order->units.front().request, 0);
  EXPECT_EQ(in_order->units.back().request, 3);
}

TEST(PlanMlaDecodeTest, DeterministicChunkingDependsOnTheRequestAlone) {
  MlaPlanOptions options = Options(64, 132, MlaSplitMode::kAuto);
  options.deterministic = true;
  const std::vector<int64_t> alone = {9000};
  const std::vector<int64_t> crowded = {131072, 5, 9000, 70000, 0};
  auto a = PlanMlaDecode(DecodeRows(1), alone, options);
  auto b = PlanMlaDecode(DecodeRows(5), crowded, options);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->kv_chunk_tokens, kMlaDeterministicChunkTokens);
  std::vector<std::tuple<int32_t, int32_t, int32_t>> ranges_a, ranges_b;
  for (const MlaWorkUnit& unit : a->units) ranges_a.emplace_back(unit.kv_begin, unit.kv_end, unit.partial_stride);
  for (const MlaWorkUnit& unit : b->units) {
    if (unit.request == 2) ranges_b.emplace_back(unit.kv_begin, unit.kv_end, unit.partial_stride);
  }
  std::sort(ranges_a.begin(), ranges_a.end());
  std::sort(ranges_b.begin(), ranges_b.end());
  EXPECT_EQ(ranges_a, ranges_b);
}

TEST(PlanMlaDecodeTest, AutoOversubscribesMixedLengthsTheWaveCannotSplit) {
  std::vector<int64_t> lengths(64, 4096);
  for (int i = 0; i < 64; i += 8) lengths[i] = 131072;
  auto plan = PlanMlaDecode(DecodeRows(64), lengths, Options(128, 132, MlaSplitMode::kAuto));
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->mode, MlaSplitMode::kOversubscribe) << plan->DebugString();
  EXPECT_LT(plan->oversubscribe_cost, plan->one_wave_cost);
  EXPECT_EQ(plan->estimated_cost, plan->oversubscribe_cost);
}

TEST(PlanMlaDecodeTest, AutoKeepsOneWaveWhenTheBatchFillsItEvenly) {
  // 132 equal requests of one row tile each fill the wave exactly: splitting only adds CTAs.
  const std::vector<int64_t> lengths(132, 4096);
  auto plan = PlanMlaDecode(DecodeRows(132), lengths, Options(64, 132, MlaSplitMode::kAuto));
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->mode, MlaSplitMode::kOneWave);
  EXPECT_EQ(plan->kv_chunk_tokens, 4096);
  EXPECT_EQ(plan->num_partials, 0);
}

TEST(PlanMlaDecodeTest, CostModelChargesTheLongestCtaAndTheAverageSlot) {
  MlaPlanOptions options = Options(64, 10, MlaSplitMode::kAuto);
  options.cta_overhead_tokens = 0;
  options.merge_tokens_per_partial_row = 0;
  const std::vector<int64_t> lengths = {1000, 100};
  // Unsplit: the longest CTA (1000) exceeds the average slot load (110).
  EXPECT_EQ(EstimatedCost(DecodeRows(2), lengths, 1000, options), 1000);
  // Chunks of 10: 110 CTAs of 10 keys on 10 slots: 110.
  EXPECT_EQ(EstimatedCost(DecodeRows(2), lengths, 10, options), 110);
}

TEST(PlanMlaDecodeTest, CostModelChargesPartlyFilledWaves) {
  MlaPlanOptions options = Options(64, 10, MlaSplitMode::kAuto);
  options.cta_overhead_tokens = 0;
  options.merge_tokens_per_partial_row = 0;
  // 11 CTAs of 100 keys on 10 slots: two rounds. 10 of 100 and one of 50: 150.
  EXPECT_EQ(EstimatedCost(DecodeRows(11), std::vector<int64_t>(11, 100), 100, options), 200);
  std::vector<int64_t> lengths(10, 100);
  lengths.push_back(50);
  EXPECT_EQ(EstimatedCost(DecodeRows(11), lengths, 100, options), 150);
}

TEST(PlanMlaDecodeTest, OversubscriptionPrefersAChunkThatFillsWholeWaves) {
  // 5 x 4000 keys on 10 slots: chunks of 1000 need two rounds of 10 CTAs, chunks of 2000 one.
  const std::vector<int64_t> lengths(5, 4000);
  MlaPlanOptions options = Options(64, 10, MlaSplitMode::kOversubscribe);
  options.min_tokens_per_cta = 1000;
  options.oversubscribe_candidates = 1;
  auto plain = PlanMlaDecode(DecodeRows(5), lengths, options);
  ASSERT_TRUE(plain.ok());
  EXPECT_EQ(plain->kv_chunk_tokens, 1024);
  options.oversubscribe_candidates = 4;
  auto searched = PlanMlaDecode(DecodeRows(5), lengths, options);
  ASSERT_TRUE(searched.ok());
  EXPECT_EQ(searched->kv_chunk_tokens, 2048);  // 2000 rounded up to whole 64-key chunks
  EXPECT_LT(searched->estimated_cost, plain->estimated_cost);
}

TEST(PlanMlaDecodeTest, RejectsBadInput) {
  const std::vector<int64_t> lengths = {10, 20};
  EXPECT_FALSE(PlanMlaDecode(Rows({1}), lengths, Options(16, 132, MlaSplitMode::kAuto)).ok());
  EXPECT_FALSE(PlanMlaDecode(std::vector<int32_t>{0, 2, 1}, lengths,
                             Options(16, 132, MlaSplitMode::kAuto)).ok());
  EXPECT_FALSE(PlanMlaDecode(DecodeRows(2), std::vector<int64_t>{10, -1},
                             Options(16, 132, MlaSplitMode::kAuto)).ok());
  EXPECT_FALSE(PlanMlaDecode(DecodeRows(2), lengths, Options(0, 132, MlaSplitMode::kAuto)).ok());
  EXPECT_FALSE(PlanMlaDecode(DecodeRows(2), lengths, Options(16, 0, MlaSplitMode::kOneWave)).ok());
  EXPECT_TRUE(PlanMlaDecode(DecodeRows(2), lengths, Options(16, 0, MlaSplitMode::kNone)).ok());
}

TEST(PlanMlaDecodeTest, PackAndViewRoundTrip) {
  const std::vector<int64_t> lengths = {5000, 70};
  MlaPlanOptions options = Options(128, 132, MlaSplitMode::kAuto);
  options.fixed_split_tokens = 1024;
  auto plan = PlanMlaDecode(DecodeRows(2), lengths, options);
  ASSERT_TRUE(plan.ok());
  std::vector<int32_t> packed = plan->Pack();
  const MlaWorkView view = plan->View(packed.data());
  ASSERT_EQ(view.num_units, plan->num_units());
  for (int32_t i = 0; i < view.num_units; ++i) {
    EXPECT_EQ(view.units[i].request, plan->units[i].request);
    EXPECT_EQ(view.units[i].kv_begin, plan->units[i].kv_begin);
    EXPECT_EQ(view.units[i].kv_end, plan->units[i].kv_end);
    EXPECT_EQ(view.units[i].partial_first, plan->units[i].partial_first);
    EXPECT_EQ(view.units[i].partial_stride, plan->units[i].partial_stride);
    EXPECT_EQ(view.units[i].row_begin, plan->units[i].row_begin);
  }
  EXPECT_EQ(view.num_merge_rows, 1);
  EXPECT_EQ(view.merge_indptr[0], 0);
  EXPECT_EQ(view.merge_indptr[1], 5);
  EXPECT_EQ(view.merge_q_row[0], 0);
  EXPECT_EQ(view.num_partials, 5);
}

}  // namespace
}  // namespace attnd::plan
