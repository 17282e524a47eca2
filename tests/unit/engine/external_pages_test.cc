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
