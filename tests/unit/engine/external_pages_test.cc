// EXTERNAL page tables: the client owns allocation and every id is range-checked.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "engine/engine.h"
#include "engine_test_util.h"

namespace attnd {
namespace {

using ::attnd::testing::EngineFixture;
using ::attnd::testing::ForwardSync;
using ::attnd::testing::LayerTensors;
using ::attnd::testing::RandomLayer;
using ::attnd::testing::SmallCache;
using ::testing::HasSubstr;

PlanEntrySpec External(int32_t new_tokens, int64_t kv_len, std::vector<int32_t> pages,
                       std::vector<int32_t> v_pages = {}) {
  PlanEntrySpec entry;
  entry.sequence_id = 1;
  entry.num_new_tokens = new_tokens;
  entry.has_pages = true;
  entry.kv_len = kv_len;
  entry.page_ids = std::move(pages);
  entry.v_page_ids = std::move(v_pages);
  return entry;
}

class ExternalPagesTest : public ::testing::TestWithParam<bool>, public EngineFixture {
 protected:
  void SetUp() override {
    spec_.external_pages = true;
    spec_.separate_kv = GetParam();
    ASSERT_TRUE(engine->CreateCache(spec_).ok());
  }
  absl::Status PlanStatus(PlanEntrySpec entry) {
    PlanSpec plan;
    plan.cache = "x";
    plan.entries.push_back(std::move(entry));
    return engine->Plan(plan).status();
  }
  std::vector<int32_t> V(std::vector<int32_t> ids) { return GetParam() ? ids : std::vector<int32_t>{}; }
  std::vector<uint8_t> Pool(bool v_pool) {
    std::vector<uint8_t> bytes(16 * spec_.geometry.KPageBytes());
    EXPECT_TRUE(engine->ReadPages("x", 0, v_pool, 0, bytes).ok());
    return bytes;
  }
  CacheSpec spec_ = SmallCache("x");
};

TEST_P(ExternalPagesTest, RequiresPagesForEveryEntryWithTokens) {
  PlanEntrySpec entry;
  entry.num_new_tokens = 1;
  const absl::Status status = PlanStatus(entry);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("entries[0].pages: required"));
}

TEST_P(ExternalPagesTest, ChecksThePageCountAgainstKvLen) {
  const absl::Status status = PlanStatus(External(1, 9, {0, 1}, V({2, 3})));
  EXPECT_THAT(status.message(), HasSubstr("entries[0].pages.page_ids: expected 3 ids (kv_len 9"));
  const absl::Status short_len = PlanStatus(External(5, 4, {0}, V({1})));
  EXPECT_THAT(short_len.message(), HasSubstr("entries[0].pages.kv_len"));
}

TEST_P(ExternalPagesTest, RangeChecksEveryId) {
  const absl::Status status = PlanStatus(External(1, 5, {3, 16}, V({1, 2})));
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(),
              HasSubstr("entries[0].pages.page_ids[1]: expected a page id in [0, 16), got 16"));
  const absl::Status negative = PlanStatus(External(1, 5, {3, -1}, V({1, 2})));
  EXPECT_THAT(negative.message(), HasSubstr("page_ids[1]"));
  if (GetParam()) {
    const absl::Status v_bad = PlanStatus(External(1, 5, {3, 4}, {1, 99}));
    EXPECT_THAT(v_bad.message(), HasSubstr("entries[0].pages.v_page_ids[1]"));
    const absl::Status v_count = PlanStatus(External(1, 5, {3, 4}, {1}));
    EXPECT_THAT(v_count.message(), HasSubstr("v_page_ids: expected 2 ids"));
  } else {
    const absl::Status v_shared = PlanStatus(External(1, 5, {3, 4}, {1, 2}));
    EXPECT_THAT(v_shared.message(), HasSubstr("only for SEPARATE_KV"));
  }
}

TEST_P(ExternalPagesTest, RefusesAPageRepeatedWithinOneEntry) {
  // Positions 0..3 and 4..7 would share page 5's four slots.
  const absl::Status status = PlanStatus(External(8, 8, {5, 5}, V({1, 2})));
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(),
              HasSubstr("entries[0].pages.page_ids[1]: page 5 repeats page_ids[0]"));
  if (GetParam()) {
    const absl::Status v_repeat = PlanStatus(External(1, 9, {1, 2, 3}, {7, 4, 7}));
    EXPECT_EQ(v_repeat.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(v_repeat.message(),
                HasSubstr("entries[0].pages.v_page_ids[2]: page 7 repeats v_page_ids[0]"));
  }
  // The same ids in a later plan are fine once the table names distinct pages.
  EXPECT_TRUE(PlanStatus(External(8, 8, {5, 6}, V({1, 2}))).ok());
}

TEST_P(ExternalPagesTest, RefusesTwoEntriesWritingOneSlot) {
  PlanSpec plan;
  plan.cache = "x";
  // Entry 0 writes page 2 slots 1..3; entry 2 writes page 2 slot 3 (position 7 of its table).
  plan.entries.push_back(External(3, 8, {1, 2}, V({1, 2})));
  plan.entries.push_back(External(0, 0, {}));
  plan.entries.push_back(External(1, 8, {4, 2}, V({3, 2})));
  const absl::Status status = engine->Plan(plan).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(),
              HasSubstr("entries[2].pages: its new tokens write page 2 slot 3 that entries[0] "
                        "also writes"));
  EXPECT_EQ(engine->OpenSteps(), 0);
  if (GetParam()) {
    // SEPARATE_KV: distinct K pages but one V slot.
    plan.entries[2] = External(1, 8, {4, 3}, {3, 2});
    const absl::Status v_clash = engine->Plan(plan).status();
    EXPECT_EQ(v_clash.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(v_clash.message(), HasSubstr("write V page 2 slot 3 that entries[0]"));
  }
}

TEST_P(ExternalPagesTest, AllowsSharedPrefixPagesAndDisjointSlots) {
  PlanSpec plan;
  plan.cache = "x";
  // Both read prefix page 0 and write their own pages; the third writes slot 0 of page 2,
  // which the first writes from slot 1 on.
  plan.entries.push_back(External(3, 8, {0, 2}, V({0, 2})));
  plan.entries.push_back(External(2, 6, {0, 3}, V({0, 3})));
  plan.entries.push_back(External(1, 1, {2}, V({2})));
  auto planned = engine->Plan(plan);
  ASSERT_TRUE(planned.ok()) << planned.status();
}

TEST_P(ExternalPagesTest, WritesOnlyTheNamedPages) {
  const std::vector<uint8_t> k_before = Pool(false);
  const std::vector<uint8_t> v_before = Pool(true);
  PlanSpec plan;
  plan.cache = "x";
  // Tokens 4..5 of a 6-token sequence: they land in the second page of each table.
  plan.entries.push_back(External(2, 6, {9, 3}, V({5, 12})));
  auto planned = engine->Plan(plan);
  ASSERT_TRUE(planned.ok()) << planned.status();
  EXPECT_EQ(planned->entries[0].start_position, 4);
  const CacheGeometry& g = spec_.geometry;
  const LayerTensors t = RandomLayer(g, 2, 7);
  ASSERT_TRUE(ForwardSync(*engine, t.Args(planned->step_id, 0, g, 2))->status.ok());
  const std::vector<uint8_t> k_after = Pool(false);
  const std::vector<uint8_t> v_after = Pool(true);
  const int64_t page_bytes = g.KPageBytes();
  const int32_t k_page = 3;
  const int32_t v_page = GetParam() ? 12 : 3;
  for (int32_t page = 0; page < 16; ++page) {
    const auto k_first = k_before.begin() + page * page_bytes;
    const bool k_same = std::equal(k_first, k_first + page_bytes, k_after.begin() + page * page_bytes);
    EXPECT_EQ(k_same, page != k_page) << "K page " << page;
    const auto v_first = v_before.begin() + page * page_bytes;
    const bool v_same = std::equal(v_first, v_first + page_bytes, v_after.begin() + page * page_bytes);
    EXPECT_EQ(v_same, page != v_page) << "V page " << page;
  }
}

TEST_P(ExternalPagesTest, FreeSequencesIsForManagedCachesOnly) {
  EXPECT_EQ(engine->FreeSequences("x", {1}).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

INSTANTIATE_TEST_SUITE_P(Forms, ExternalPagesTest, ::testing::Bool(),
                         [](const auto& info) { return info.param ? "SeparateKv" : "Shared"; });

}  // namespace
}  // namespace attnd
