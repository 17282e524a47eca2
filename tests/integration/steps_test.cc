// Steps end to end: outputs against the reference, padding, layer order, commit and rollback,
// all-or-nothing plans, external page tables, dtypes and layouts, step TTL.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <ostream>
#include <random>
#include <thread>

#include "absl/time/clock.h"
#include "attnd/client/tensor.h"
#include "status_matchers.h"
#include "test_server.h"
#include "test_steps.h"

namespace attnd::integration {
namespace {

using ::testing::ElementsAre;

using StepsTest = IntegrationTest;

absl::StatusOr<std::unique_ptr<client::ReferenceCache>> Mirror(const attnd::v1::CacheInfo& cache) {
  return client::ReferenceCache::Create(cache.config());
}

TEST_F(StepsTest, MixedPrefillDecodeAndPaddingMatchTheReference) {
  ASSERT_OK_AND_ASSIGN(auto cache, client().CreateCache("c", SmallConfig()));
  ASSERT_OK_AND_ASSIGN(auto reference, Mirror(cache));
  std::mt19937_64 rng(10);
  // Prefills across page boundaries (4-token pages), a single-token start, padding slots.
  ASSERT_NO_FATAL_FAILURE(
      RunStepAndCheck(client(), *reference, cache, {{1, 9}, {0, 0}, {2, 4}, {3, 1}}, rng));
  ASSERT_NO_FATAL_FAILURE(
      RunStepAndCheck(client(), *reference, cache, {{1, 1}, {2, 1}, {0, 0}, {3, 1}}, rng));
  ASSERT_NO_FATAL_FAILURE(
      RunStepAndCheck(client(), *reference, cache, {{3, 6}, {1, 1}, {4, 3}, {2, 1}}, rng));
  for (int i = 0; i < 5; ++i) {
    ASSERT_NO_FATAL_FAILURE(RunStepAndCheck(client(), *reference, cache,
                                            {{1, 1}, {2, 1}, {3, 1}, {4, 1}}, rng));
  }
  for (uint64_t id : {1, 2, 3, 4}) {
    EXPECT_EQ(ProbeLength(client(), "c", id), reference->SequenceLength(id)) << "sequence " << id;
  }
}

TEST_F(StepsTest, LayersMayRunInAnyOrder) {
  attnd::v1::CacheConfig config = SmallConfig();
  config.set_num_layers(4);
  ASSERT_OK_AND_ASSIGN(auto cache, client().CreateCache("c", config));
  ASSERT_OK_AND_ASSIGN(auto reference, Mirror(cache));
  std::mt19937_64 rng(11);
  const attnd::v1::PlanRequest plan = MakePlan("c", {{1, 6}, {2, 1}});
  ASSERT_OK_AND_ASSIGN(auto step, client().BeginStep(plan));
  ASSERT_OK(reference->BeginStep(plan));
  ASSERT_NO_FATAL_FAILURE(RunLayersAndCheck(*step, *reference, config, rng, {2, 0, 3, 1}));
  EXPECT_FALSE(step->open());
}

TEST_F(StepsTest, PaddingOnlyPlanRunsNothingAndChangesNothing) {
  ASSERT_OK_AND_ASSIGN(auto cache, client().CreateCache("c", SmallConfig()));
  ASSERT_OK_AND_ASSIGN(auto step, client().BeginStep(MakePlan("c", {{7, 0}, {8, 0}})));
  EXPECT_EQ(step->num_tokens(), 0);
  EXPECT_EQ(step->plan().kernel(), "none");
  std::mt19937_64 rng(12);
  for (int32_t layer = 0; layer < 2; ++layer) {
    ASSERT_OK_AND_ASSIGN(auto out, step->Forward(RandomLayer(rng, cache.config(), 0, layer)));
    EXPECT_THAT(out.o().shape(), ElementsAre(0, 4, 64));
    EXPECT_TRUE(out.o().data().empty());
  }
  EXPECT_FALSE(step->open());
  ASSERT_OK_AND_ASSIGN(cache, client().GetCache("c"));
  EXPECT_EQ(cache.used_pages(), 0);
  EXPECT_EQ(cache.num_sequences(), 0) << "padding slots create no sequence";
  const std::vector<uint64_t> ids = {7};
  EXPECT_EQ(client().FreeSequences("c", ids).status().code(), absl::StatusCode::kNotFound);
}

TEST_F(StepsTest, AbortRollsBackLengthsAndPages) {
  ASSERT_OK_AND_ASSIGN(auto cache, client().CreateCache("c", SmallConfig(16)));
  ASSERT_OK_AND_ASSIGN(auto reference, Mirror(cache));
  std::mt19937_64 rng(13);
  ASSERT_NO_FATAL_FAILURE(RunStepAndCheck(client(), *reference, cache, {{1, 6}}, rng));
  ASSERT_OK_AND_ASSIGN(const auto before, client().GetCache("c"));

  // Sequence 1 grows into a third page and sequence 2 is new; one layer runs, then abort.
  const attnd::v1::PlanRequest plan = MakePlan("c", {{1, 3}, {2, 5}});
  ASSERT_OK_AND_ASSIGN(auto step, client().BeginStep(plan));
  ASSERT_OK(step->Forward(RandomLayer(rng, cache.config(), 8, 0)));
  ASSERT_OK_AND_ASSIGN(auto during, client().GetCache("c"));
  EXPECT_EQ(during.used_pages(), before.used_pages() + 1 + 2);
  EXPECT_EQ(during.open_steps(), 1);
  ASSERT_OK_AND_ASSIGN(auto ended, step->Abort());
  EXPECT_EQ(ended.outcome(), attnd::v1::STEP_OUTCOME_ABORTED);
  EXPECT_EQ(ended.layers_run(), 1);

  ASSERT_OK_AND_ASSIGN(auto after, client().GetCache("c"));
  EXPECT_EQ(after.used_pages(), before.used_pages());
  EXPECT_EQ(after.num_sequences(), before.num_sequences());
  EXPECT_EQ(after.open_steps(), 0);
  EXPECT_EQ(ProbeLength(client(), "c", 1), 6);
  EXPECT_EQ(ProbeLength(client(), "c", 2), 0);
  // The sequence carries on from its committed state as if the aborted step never happened.
  ASSERT_NO_FATAL_FAILURE(RunStepAndCheck(client(), *reference, cache, {{1, 2}, {2, 1}}, rng));
}

TEST_F(StepsTest, DroppingAnOpenStepHandleAbortsIt) {
  ASSERT_OK_AND_ASSIGN(auto cache, client().CreateCache("c", SmallConfig()));
  std::mt19937_64 rng(14);
  {
    ASSERT_OK_AND_ASSIGN(auto step, client().BeginStep(MakePlan("c", {{1, 5}})));
    ASSERT_OK(step->Forward(RandomLayer(rng, cache.config(), 5, 1)));
  }
  ASSERT_OK_AND_ASSIGN(cache, client().GetCache("c"));
  EXPECT_EQ(cache.open_steps(), 0);
  EXPECT_EQ(cache.used_pages(), 0);
  EXPECT_EQ(cache.num_sequences(), 0);
}

TEST_F(StepsTest, PlanThatDoesNotFitLeavesPoolAndSequencesUnchanged) {
  ASSERT_OK_AND_ASSIGN(auto cache, client().CreateCache("c", SmallConfig(8)));  // 32 slots
  ASSERT_OK_AND_ASSIGN(auto reference, Mirror(cache));
  std::mt19937_64 rng(15);
  ASSERT_NO_FATAL_FAILURE(RunStepAndCheck(client(), *reference, cache, {{1, 10}, {2, 7}}, rng));
  ASSERT_OK_AND_ASSIGN(const auto before, client().GetCache("c"));
  EXPECT_EQ(before.used_pages(), 5);

  // Sequence 1's entry alone would fit (its third page has room); the new sequence 3 needs
  // 4 more pages with only 3 free: nothing at all may change.
  EXPECT_EQ(client().Plan(MakePlan("c", {{1, 2}, {3, 13}})).status().code(),
            absl::StatusCode::kResourceExhausted);
  ASSERT_OK_AND_ASSIGN(const auto after, client().GetCache("c"));
  EXPECT_EQ(after.used_pages(), before.used_pages());
  EXPECT_EQ(after.num_sequences(), before.num_sequences());
  EXPECT_EQ(after.open_steps(), 0);
  EXPECT_EQ(ProbeLength(client(), "c", 1), 10);
  EXPECT_EQ(ProbeLength(client(), "c", 2), 7);
  EXPECT_EQ(ProbeLength(client(), "c", 3), 0);
  // A step that fits still runs, and outputs show no trace of the refused plan.
  ASSERT_NO_FATAL_FAILURE(RunStepAndCheck(client(), *reference, cache, {{1, 2}, {3, 12}}, rng));
  ASSERT_OK_AND_ASSIGN(const auto full, client().GetCache("c"));
  EXPECT_EQ(full.used_pages(), 8);
}

// Dtypes and layouts: every combination stores and attends like the reference.
struct Variant {
  const char* name;
  attnd::v1::DType q_dtype;
  attnd::v1::DType kv_dtype;
  attnd::v1::KvLayout layout;
  float k_scale;
  float v_scale;
  attnd::v1::RopeStyle rope;
};

// gtest prints a parameter in test listings and failures; without this, as raw bytes
// (padding included), which change from build to build.
void PrintTo(const Variant& c, std::ostream* os) { *os << c.name; }

class StepsVariantTest : public IntegrationTest, public ::testing::WithParamInterface<Variant> {};

TEST_P(StepsVariantTest, OutputsMatchTheReference) {
  const Variant& variant = GetParam();
  attnd::v1::CacheConfig config = SmallConfig();
  config.set_q_dtype(variant.q_dtype);
  config.set_kv_dtype(variant.kv_dtype);
  config.set_layout(variant.layout);
  config.set_k_scale(variant.k_scale);
  config.set_v_scale(variant.v_scale);
  config.mutable_rope()->set_style(variant.rope);
  ASSERT_OK_AND_ASSIGN(auto cache, client().CreateCache("c", config));
  ASSERT_OK_AND_ASSIGN(auto reference, Mirror(cache));
  std::mt19937_64 rng(16);
  ASSERT_NO_FATAL_FAILURE(
      RunStepAndCheck(client(), *reference, cache, {{1, 11}, {2, 1}, {0, 0}}, rng));
  ASSERT_NO_FATAL_FAILURE(RunStepAndCheck(client(), *reference, cache, {{1, 1}, {2, 5}}, rng));
}

INSTANTIATE_TEST_SUITE_P(
    DtypesAndLayouts, StepsVariantTest,
    ::testing::Values(
        Variant{"Bf16Nhd", attnd::v1::DTYPE_BFLOAT16, attnd::v1::DTYPE_BFLOAT16,
                attnd::v1::KV_LAYOUT_NHD, 0, 0, attnd::v1::ROPE_STYLE_NEOX},
        Variant{"Fp16Hnd", attnd::v1::DTYPE_FLOAT16, attnd::v1::DTYPE_FLOAT16,
                attnd::v1::KV_LAYOUT_HND, 0, 0, attnd::v1::ROPE_STYLE_INTERLEAVED},
        Variant{"Fp8KvScaled", attnd::v1::DTYPE_BFLOAT16, attnd::v1::DTYPE_FLOAT8_E4M3,
                attnd::v1::KV_LAYOUT_NHD, 0.25f, 2.0f, attnd::v1::ROPE_STYLE_NEOX},
        Variant{"Fp8HndNoRope", attnd::v1::DTYPE_FLOAT16, attnd::v1::DTYPE_FLOAT8_E4M3,
                attnd::v1::KV_LAYOUT_HND, 1.0f, 1.0f, attnd::v1::ROPE_STYLE_NONE}),
    [](const ::testing::TestParamInfo<Variant>& info) { return info.param.name; });

// EXTERNAL page tables: the client picks the pages; the server must read them where told.
class ExternalPagesTest : public IntegrationTest,
                          public ::testing::WithParamInterface<attnd::v1::PageTableForm> {};

TEST_P(ExternalPagesTest, OutputsMatchTheReferenceAtClientChosenPages) {
  const bool separate = GetParam() == attnd::v1::PAGE_TABLE_FORM_SEPARATE_KV;
  attnd::v1::CacheConfig config = SmallConfig(16);
  config.set_page_table_mode(attnd::v1::PAGE_TABLE_MODE_EXTERNAL);
  config.set_page_table_form(GetParam());
  ASSERT_OK_AND_ASSIGN(auto cache, client().CreateCache("ext", config));
  ASSERT_OK_AND_ASSIGN(auto reference, Mirror(cache));
  std::mt19937_64 rng(17);

  // Sequence A on pages 15, 3, 9 (V: 0, 14, 5); sequence B on 7, 2 (V: 11, 1).
  const std::vector<int32_t> a_k = {15, 3, 9}, a_v = {0, 14, 5};
  const std::vector<int32_t> b_k = {7, 2}, b_v = {11, 1};
  auto entry = [&](attnd::v1::PlanRequest& plan, uint64_t id, int32_t new_tokens, int64_t kv_len,
                   const std::vector<int32_t>& k_pages, const std::vector<int32_t>& v_pages) {
    attnd::v1::PlanEntry* planned = plan.add_entries();
    planned->set_sequence_id(id);
    planned->set_num_new_tokens(new_tokens);
    const int64_t pages = (kv_len + 3) / 4;
    for (int64_t i = 0; i < pages; ++i) {
      planned->mutable_pages()->add_page_ids(k_pages[i]);
      if (separate) planned->mutable_pages()->add_v_page_ids(v_pages[i]);
    }
    planned->mutable_pages()->set_kv_len(kv_len);
  };
  const std::vector<std::vector<std::tuple<uint64_t, int32_t, int64_t>>> steps = {
      {{1, 7, 7}, {2, 5, 5}},   // prefills
      {{1, 1, 8}, {2, 1, 6}},   // decodes; A fills its second page
      {{1, 3, 11}, {2, 0, 6}},  // A chunked prefill into a third page, B padding
  };
  for (const auto& step_entries : steps) {
    attnd::v1::PlanRequest plan;
    plan.set_cache("ext");
    plan.mutable_options()->set_return_lse(true);
    for (const auto& [id, new_tokens, kv_len] : step_entries) {
      if (new_tokens == 0) {
        plan.add_entries()->set_sequence_id(id);
        continue;
      }
      entry(plan, id, new_tokens, kv_len, id == 1 ? a_k : b_k, id == 1 ? a_v : b_v);
    }
    ASSERT_OK_AND_ASSIGN(auto step, client().BeginStep(plan));
    ASSERT_OK(reference->BeginStep(plan));
    ASSERT_NO_FATAL_FAILURE(RunLayersAndCheck(*step, *reference, config, rng));
  }

  attnd::v1::PlanRequest bad;
  bad.set_cache("ext");
  entry(bad, 1, 1, 12, {15, 3, 16}, {0, 14, 5});  // page 16 of a 16-page pool
  EXPECT_ERROR(client().Plan(bad), absl::StatusCode::kInvalidArgument, "page_ids");
}

INSTANTIATE_TEST_SUITE_P(Forms, ExternalPagesTest,
                         ::testing::Values(attnd::v1::PAGE_TABLE_FORM_SHARED,
                                           attnd::v1::PAGE_TABLE_FORM_SEPARATE_KV),
                         [](const auto& info) {
                           return info.param == attnd::v1::PAGE_TABLE_FORM_SHARED ? "Shared"
                                                                                  : "SeparateKv";
                         });

class StepTtlTest : public IntegrationTest {
 protected:
  ServerOptions Options() const override {
    ServerOptions options = TestServerOptions();
    options.step_ttl = absl::Milliseconds(300);
    return options;
  }
};

TEST_F(StepTtlTest, IdleStepsExpireAndRollBack) {
  ASSERT_OK_AND_ASSIGN(auto cache, client().CreateCache("c", SmallConfig()));
  ASSERT_OK_AND_ASSIGN(auto plan, client().Plan(MakePlan("c", {{1, 5}})));
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  do {
    absl::SleepFor(absl::Milliseconds(50));
    ASSERT_OK_AND_ASSIGN(cache, client().GetCache("c"));
  } while (cache.open_steps() > 0 && absl::Now() < deadline);
  EXPECT_EQ(cache.open_steps(), 0) << "the step outlived its TTL";
  EXPECT_EQ(cache.used_pages(), 0);
  EXPECT_EQ(cache.num_sequences(), 0);
  std::mt19937_64 rng(18);
  attnd::v1::ForwardRequest late = RandomLayer(rng, cache.config(), 5, 0);
  late.set_step_id(plan.step_id());
  EXPECT_FALSE(client().Forward(late).ok());
}

}  // namespace
}  // namespace attnd::integration
