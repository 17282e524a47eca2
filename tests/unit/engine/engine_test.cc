#include "engine/engine.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "engine_test_util.h"

namespace attnd {
namespace {

using ::attnd::testing::Decode;
using ::attnd::testing::EndStepSync;
using ::attnd::testing::EngineFixture;
using ::attnd::testing::ForwardSync;
using ::attnd::testing::LayerTensors;
using ::attnd::testing::RandomLayer;
using ::attnd::testing::RunAllLayers;
using ::attnd::testing::SmallCache;
using ::testing::HasSubstr;

class EngineTest : public ::testing::Test, public EngineFixture {
 protected:
  void SetUp() override { ASSERT_TRUE(engine->CreateCache(SmallCache("c")).ok()); }
  int64_t UsedPages() { return engine->GetCache("c")->used_pages; }
  int64_t Length(uint64_t id) { return engine->SequenceLength("c", id).value(); }
  const CacheGeometry& geometry() { return spec_.geometry; }
  CacheSpec spec_ = SmallCache("c");
};

TEST_F(EngineTest, CommitsAfterTheLastLayer) {
  auto plan = engine->Plan(Decode("c", {{7, 6}}));
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->num_tokens, 6);
  EXPECT_EQ(plan->entries[0].start_position, 0);
  EXPECT_EQ(UsedPages(), 2);  // 6 tokens in pages of 4
  EXPECT_EQ(Length(7), 0);    // not committed yet

  const LayerTensors t0 = RandomLayer(geometry(), 6, 1);
  auto first = ForwardSync(*engine, t0.Args(plan->step_id, 0, geometry(), 6));
  ASSERT_TRUE(first->status.ok()) << first->status;
  EXPECT_FALSE(first->outputs.step_committed);
  EXPECT_EQ(first->o.size(), 6u * 4 * 64 * 2);
  const LayerTensors t1 = RandomLayer(geometry(), 6, 2);
  auto last = ForwardSync(*engine, t1.Args(plan->step_id, 1, geometry(), 6));
  ASSERT_TRUE(last->status.ok()) << last->status;
  EXPECT_TRUE(last->outputs.step_committed);
  EXPECT_EQ(Length(7), 6);
  EXPECT_EQ(engine->OpenSteps(), 0);

  auto next = engine->Plan(Decode("c", {{7, 1}}));
  ASSERT_TRUE(next.ok());
  EXPECT_EQ(next->entries[0].start_position, 6);
}

TEST_F(EngineTest, AbortRestoresLengthsAndFreesFreshPages) {
  auto plan = engine->Plan(Decode("c", {{1, 3}}));
  ASSERT_TRUE(plan.ok());
  RunAllLayers(*engine, geometry(), *plan);
  ASSERT_EQ(Length(1), 3);
  ASSERT_EQ(UsedPages(), 1);

  auto grow = engine->Plan(Decode("c", {{1, 3}, {2, 5}}));
  ASSERT_TRUE(grow.ok());
  EXPECT_EQ(UsedPages(), 1 + 1 + 2);
  const LayerTensors t = RandomLayer(geometry(), 8, 3);
  ASSERT_TRUE(ForwardSync(*engine, t.Args(grow->step_id, 0, geometry(), 8))->status.ok());
  auto ended = EndStepSync(*engine, grow->step_id, /*abort=*/true);
  ASSERT_TRUE(ended.ok());
  EXPECT_EQ(ended->outcome, StepOutcome::kAborted);
  EXPECT_EQ(ended->layers_run, 1);
  EXPECT_EQ(Length(1), 3);
  EXPECT_EQ(Length(2), 0);
  EXPECT_EQ(UsedPages(), 1);
  EXPECT_EQ(engine->GetCache("c")->num_sequences, 1);
}

TEST_F(EngineTest, PlanThatDoesNotFitChangesNothing) {
  auto plan = engine->Plan(Decode("c", {{1, 30}}));  // 8 of 16 pages
  ASSERT_TRUE(plan.ok());
  RunAllLayers(*engine, geometry(), *plan);
  auto too_big = engine->Plan(Decode("c", {{1, 2}, {2, 20}, {3, 20}}));
  ASSERT_EQ(too_big.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(too_big.status().message(), HasSubstr("needs 10 new pages"));
  EXPECT_EQ(UsedPages(), 8);
  EXPECT_EQ(Length(1), 30);
  EXPECT_EQ(engine->GetCache("c")->num_sequences, 1);
  EXPECT_EQ(engine->OpenSteps(), 0);
}

TEST_F(EngineTest, SequenceInAnOpenStepIsRefused) {
  auto plan = engine->Plan(Decode("c", {{5, 1}}));
  ASSERT_TRUE(plan.ok());
  auto again = engine->Plan(Decode("c", {{6, 1}, {5, 1}}));
  ASSERT_EQ(again.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(again.status().message(), HasSubstr("entries[1].sequence_id"));
  EXPECT_EQ(engine->GetCache("c")->num_sequences, 1);
}

TEST_F(EngineTest, RejectsRepeatedSequenceAndNegativeTokens) {
  auto repeated = engine->Plan(Decode("c", {{5, 1}, {5, 2}}));
  ASSERT_EQ(repeated.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(repeated.status().message(), HasSubstr("entries[1].sequence_id"));
  // A padding slot may not reuse a real entry's id either; padding slots may share one.
  auto padded = engine->Plan(Decode("c", {{5, 1}, {0, 0}, {5, 0}}));
  ASSERT_EQ(padded.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(padded.status().message(),
              HasSubstr("entries[2].sequence_id: padding slot names sequence 5 of entries[0]"));
  auto negative = engine->Plan(Decode("c", {{5, -1}}));
  ASSERT_EQ(negative.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(negative.status().message(), HasSubstr("entries[0].num_new_tokens"));
  EXPECT_EQ(UsedPages(), 0);
}

TEST_F(EngineTest, PaddingEntriesHaveNoRowsAndNoPages) {
  auto plan = engine->Plan(Decode("c", {{0, 0}, {9, 2}, {0, 0}, {10, 1}}));
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->num_tokens, 3);
  EXPECT_EQ(plan->entries[1].row_offset, 0);
  EXPECT_EQ(plan->entries[3].row_offset, 2);
  EXPECT_EQ(UsedPages(), 2);
  RunAllLayers(*engine, geometry(), *plan);
  EXPECT_EQ(engine->GetCache("c")->num_sequences, 2);
}

TEST_F(EngineTest, PaddingOnlyStepRunsAndCommits) {
  auto plan = engine->Plan(Decode("c", {{0, 0}, {0, 0}}));
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->kernel, "none");
  for (int32_t layer = 0; layer < 2; ++layer) {
    ForwardArgs args;
    args.step_id = plan->step_id;
    args.layer = layer;
    auto result = ForwardSync(*engine, args);
    ASSERT_TRUE(result->status.ok()) << result->status;
    EXPECT_TRUE(result->o.empty());
  }
  EXPECT_EQ(engine->OpenSteps(), 0);
}

TEST_F(EngineTest, EachLayerRunsOnce) {
  auto plan = engine->Plan(Decode("c", {{1, 1}}));
  ASSERT_TRUE(plan.ok());
  const LayerTensors t = RandomLayer(geometry(), 1, 4);
  ASSERT_TRUE(ForwardSync(*engine, t.Args(plan->step_id, 0, geometry(), 1))->status.ok());
  auto twice = ForwardSync(*engine, t.Args(plan->step_id, 0, geometry(), 1));
  EXPECT_EQ(twice->status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(twice->status.message(), HasSubstr("layer 0 already ran"));
  auto out_of_range = ForwardSync(*engine, t.Args(plan->step_id, 2, geometry(), 1));
  EXPECT_EQ(out_of_range->status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(out_of_range->status.message(), HasSubstr("layer: expected 0..1, got 2"));
}

TEST_F(EngineTest, ForwardNamesTheBadTensorField) {
  auto plan = engine->Plan(Decode("c", {{1, 2}}));
  ASSERT_TRUE(plan.ok());
  LayerTensors t = RandomLayer(geometry(), 2, 5);
  ForwardArgs args = t.Args(plan->step_id, 0, geometry(), 2);
  args.k.shape = {2, 4, 64};
  auto bad_shape = ForwardSync(*engine, args);
  EXPECT_EQ(bad_shape->status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad_shape->status.message(), HasSubstr("k.shape: expected [2, 2, 64], got [2, 4, 64]"));

  args = t.Args(plan->step_id, 0, geometry(), 2);
  const std::string_view short_v = std::string_view(t.v).substr(0, 10);
  args.v.pieces = {&short_v, 1};
  auto short_data = ForwardSync(*engine, args);
  EXPECT_THAT(short_data->status.message(), HasSubstr("v.data: expected 512 bytes"));

  args = t.Args(plan->step_id, 0, geometry(), 2);
  args.q.dtype = DType::kFloat16;
  auto bad_dtype = ForwardSync(*engine, args);
  EXPECT_THAT(bad_dtype->status.message(), HasSubstr("q.dtype: expected bfloat16"));

  args = t.Args(plan->step_id, 0, geometry(), 2);
  args.ckv = args.k;
  auto stray = ForwardSync(*engine, args);
  EXPECT_THAT(stray->status.message(), HasSubstr("ckv: not used by MHA caches"));

  // None of the rejected calls consumed the layer.
  EXPECT_TRUE(ForwardSync(*engine, t.Args(plan->step_id, 0, geometry(), 2))->status.ok());
}

TEST_F(EngineTest, EndStepReportsTheOutcomeAgain) {
  auto plan = engine->Plan(Decode("c", {{1, 1}}));
  ASSERT_TRUE(plan.ok());
  RunAllLayers(*engine, geometry(), *plan);
  auto again = EndStepSync(*engine, plan->step_id, false);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->outcome, StepOutcome::kCommitted);
  EXPECT_EQ(again->layers_run, 2);
  // An abort that comes after the commit changes nothing and reports the commit.
  auto undo = EndStepSync(*engine, plan->step_id, true);
  ASSERT_TRUE(undo.ok()) << undo.status();
  EXPECT_EQ(undo->outcome, StepOutcome::kCommitted);
  EXPECT_EQ(undo->layers_run, 2);
  EXPECT_EQ(engine->SequenceLength("c", 1).value(), 1);
  auto unknown = EndStepSync(*engine, 999, false);
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kNotFound);
  auto late = ForwardSync(*engine, RandomLayer(geometry(), 1, 1).Args(plan->step_id, 0, geometry(), 1));
  EXPECT_EQ(late->status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(late->status.message(), HasSubstr("already committed"));
}

TEST_F(EngineTest, EndStepCommitsWithLayersMissing) {
  auto plan = engine->Plan(Decode("c", {{3, 4}}));
  ASSERT_TRUE(plan.ok());
  auto ended = EndStepSync(*engine, plan->step_id, false);
  ASSERT_TRUE(ended.ok());
  EXPECT_EQ(ended->outcome, StepOutcome::kCommitted);
  EXPECT_EQ(ended->layers_run, 0);
  EXPECT_EQ(Length(3), 4);
}

TEST(EngineTtlTest, IdleStepsExpireAndRollBack) {
  EngineFixture fixture(absl::Milliseconds(50));
  Engine& engine = *fixture.engine;
  ASSERT_TRUE(engine.CreateCache(SmallCache("c")).ok());
  auto plan = engine.Plan(Decode("c", {{1, 5}}));
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(engine.GetCache("c")->used_pages, 2);
  engine.ExpireSteps(absl::Now() + absl::Seconds(1));
  EXPECT_EQ(engine.OpenSteps(), 0);
  EXPECT_EQ(engine.GetCache("c")->used_pages, 0);
  auto ended = EndStepSync(engine, plan->step_id, false);
  ASSERT_TRUE(ended.ok());
  EXPECT_EQ(ended->outcome, StepOutcome::kAborted);
}

TEST(EngineTtlTest, ReaperExpiresStepsOnItsOwn) {
  EngineFixture fixture(absl::Milliseconds(30));
  Engine& engine = *fixture.engine;
  ASSERT_TRUE(engine.CreateCache(SmallCache("c")).ok());
  ASSERT_TRUE(engine.Plan(Decode("c", {{1, 5}})).ok());
  const absl::Time deadline = absl::Now() + absl::Seconds(5);
  while (engine.OpenSteps() > 0 && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(5));
  EXPECT_EQ(engine.OpenSteps(), 0);
  EXPECT_EQ(engine.GetCache("c")->used_pages, 0);
}

TEST_F(EngineTest, DeletingACacheWithOpenStepsNeedsForce) {
  auto plan = engine->Plan(Decode("c", {{1, 1}}));
  ASSERT_TRUE(plan.ok());
  auto refused = engine->DeleteCache("c", false);
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(refused.message(), HasSubstr("1 open step"));
  ASSERT_TRUE(engine->DeleteCache("c", true).ok());
  EXPECT_EQ(engine->GetCache("c").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(engine->OpenSteps(), 0);
  // The name is free again.
  EXPECT_TRUE(engine->CreateCache(SmallCache("c")).ok());
}

TEST_F(EngineTest, CreateRefusesDuplicatesAndOverBudget) {
  EXPECT_EQ(engine->CreateCache(SmallCache("c")).status().code(),
            absl::StatusCode::kAlreadyExists);
  auto huge = engine->CreateCache(SmallCache("huge", 1 << 20));
  EXPECT_EQ(huge.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(huge.status().message(), HasSubstr("KV budget"));
}

TEST_F(EngineTest, FreeSequencesIsAllOrNothing) {
  auto plan = engine->Plan(Decode("c", {{1, 5}, {2, 5}}));
  ASSERT_TRUE(plan.ok());
  RunAllLayers(*engine, geometry(), *plan);
  ASSERT_EQ(UsedPages(), 4);
  auto missing = engine->FreeSequences("c", {1, 3});
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(missing.status().message(), HasSubstr("sequence_ids[1]"));
  EXPECT_EQ(UsedPages(), 4);
  auto freed = engine->FreeSequences("c", {1});
  ASSERT_TRUE(freed.ok());
  EXPECT_EQ(*freed, 2);
  EXPECT_EQ(UsedPages(), 2);

  auto open = engine->Plan(Decode("c", {{2, 1}}));
  ASSERT_TRUE(open.ok());
  EXPECT_EQ(engine->FreeSequences("c", {2}).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST_F(EngineTest, DrainingRefusesNewStepsButFinishesOpenOnes) {
  auto plan = engine->Plan(Decode("c", {{1, 1}}));
  ASSERT_TRUE(plan.ok());
  engine->SetDraining(true);
  EXPECT_EQ(engine->Plan(Decode("c", {{2, 1}})).status().code(), absl::StatusCode::kUnavailable);
  RunAllLayers(*engine, geometry(), *plan);
  EXPECT_EQ(Length(1), 1);
}

TEST_F(EngineTest, OwnedStepsAbortWhenTheirStreamEnds) {
  auto owned = engine->Plan(Decode("c", {{1, 2}}), /*owner=*/42);
  auto other = engine->Plan(Decode("c", {{2, 2}}), /*owner=*/43);
  ASSERT_TRUE(owned.ok());
  ASSERT_TRUE(other.ok());
  engine->AbortOwnedSteps(42);
  EXPECT_EQ(engine->OpenSteps(), 1);
  EXPECT_EQ(UsedPages(), 1);
}

TEST_F(EngineTest, AbortWhileALayerRunsFreesPagesOnlyAfterIt) {
  auto plan = engine->Plan(Decode("c", {{1, 64}}));
  ASSERT_TRUE(plan.ok());
  const LayerTensors t = RandomLayer(geometry(), 64, 6);
  auto result = std::make_unique<testing::ForwardResult>();
  result->outputs.o = &result->o;
  result->outputs.lse = &result->lse;
  absl::Notification forward_done;
  engine->Forward(t.Args(plan->step_id, 0, geometry(), 64), &result->outputs,
                  [&](absl::Status status) {
                    result->status = status;
                    forward_done.Notify();
                  });
  auto ended = EndStepSync(*engine, plan->step_id, true);  // waits for the layer
  ASSERT_TRUE(ended.ok());
  EXPECT_TRUE(forward_done.HasBeenNotified());
  EXPECT_EQ(UsedPages(), 0);
}

TEST_F(EngineTest, PaddingLeavesCacheBytesIdentical) {
  auto first = engine->Plan(Decode("c", {{1, 3}}));
  ASSERT_TRUE(first.ok());
  RunAllLayers(*engine, geometry(), *first);
  const int64_t page_bytes = geometry().page_size * geometry().num_kv_heads * 64 * 2;
  auto read_pool = [&](int32_t layer, bool v) {
    std::vector<uint8_t> bytes(16 * page_bytes);
    EXPECT_TRUE(engine->ReadPages("c", layer, v, 0, bytes).ok());
    return bytes;
  };
  const auto k_before = read_pool(0, false);
  const auto v_before = read_pool(1, true);
  auto padded = engine->Plan(Decode("c", {{0, 0}, {0, 0}}));
  ASSERT_TRUE(padded.ok());
  for (int32_t layer = 0; layer < 2; ++layer) {
    ForwardArgs args;
    args.step_id = padded->step_id;
    args.layer = layer;
    ASSERT_TRUE(ForwardSync(*engine, args)->status.ok());
  }
  EXPECT_EQ(read_pool(0, false), k_before);
  EXPECT_EQ(read_pool(1, true), v_before);
}

}  // namespace
}  // namespace attnd
