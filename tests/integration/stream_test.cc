// ForwardStream: several messages in flight matched by tag, per-message errors that leave the
// stream alive, and rollback when the stream ends with a step open.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <future>
#include <random>

#include "absl/time/clock.h"
#include "status_matchers.h"
#include "test_server.h"
#include "test_steps.h"

namespace attnd::integration {
namespace {

using StreamTest = IntegrationTest;

// Waits until the cache has no open step (the server ends them asynchronously when a stream
// goes away).
attnd::v1::CacheInfo AwaitNoOpenSteps(client::Client& client, const std::string& name) {
  attnd::v1::CacheInfo cache;
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  do {
    auto got = client.GetCache(name);
    EXPECT_TRUE(got.ok()) << got.status();
    if (!got.ok()) return cache;
    cache = *std::move(got);
    if (cache.open_steps() == 0) break;
    absl::SleepFor(absl::Milliseconds(20));
  } while (absl::Now() < deadline);
  return cache;
}

TEST_F(StreamTest, ManyMessagesInFlightAreMatchedByTag) {
  // Two caches with different shapes, one step each, every layer of both sent before any
  // answer is awaited: a response delivered to the wrong message fails its reference check.
  attnd::v1::CacheConfig config_a = SmallConfig();
  config_a.set_num_layers(6);
  attnd::v1::CacheConfig config_b = SmallConfig();
  config_b.set_num_layers(6);
  config_b.set_num_qo_heads(8);
  ASSERT_OK_AND_ASSIGN(auto cache_a, client().CreateCache("a", config_a));
  ASSERT_OK_AND_ASSIGN(auto cache_b, client().CreateCache("b", config_b));
  ASSERT_OK_AND_ASSIGN(auto reference_a, client::ReferenceCache::Create(cache_a.config()));
  ASSERT_OK_AND_ASSIGN(auto reference_b, client::ReferenceCache::Create(cache_b.config()));
  ASSERT_OK_AND_ASSIGN(auto session, client().OpenStream({.window = 8}));
  std::mt19937_64 rng(20);

  for (int round = 0; round < 3; ++round) {
    const auto plan_a = MakePlan("a", round == 0 ? Entries{{1, 9}, {2, 1}} : Entries{{1, 1}, {2, 1}});
    const auto plan_b = MakePlan("b", round == 0 ? Entries{{5, 3}} : Entries{{5, 2}, {0, 0}});
    ASSERT_OK_AND_ASSIGN(auto step_a, session->BeginStep(plan_a));
    ASSERT_OK_AND_ASSIGN(auto step_b, session->BeginStep(plan_b));
    ASSERT_OK(reference_a->BeginStep(plan_a));
    ASSERT_OK(reference_b->BeginStep(plan_b));

    std::vector<std::future<client::ForwardResult>> answers_a, answers_b;
    std::vector<attnd::v1::ForwardRequest> requests_a, requests_b;
    for (int32_t layer = 0; layer < 6; ++layer) {
      requests_a.push_back(RandomLayer(rng, config_a, step_a->num_tokens(), layer));
      requests_b.push_back(RandomLayer(rng, config_b, step_b->num_tokens(), 5 - layer));
      answers_a.push_back(step_a->ForwardAsync(requests_a.back()));
      answers_b.push_back(step_b->ForwardAsync(requests_b.back()));
    }
    for (int32_t i = 0; i < 6; ++i) {
      ASSERT_OK_AND_ASSIGN(auto out_a, answers_a[i].get());
      ASSERT_OK_AND_ASSIGN(auto out_b, answers_b[i].get());
      ASSERT_OK_AND_ASSIGN(auto expected_a, reference_a->Forward(requests_a[i]));
      ASSERT_OK_AND_ASSIGN(auto expected_b, reference_b->Forward(requests_b[i]));
      ExpectMatchesReference(out_a, expected_a, reference_a->q_dtype(), "a layer");
      ExpectMatchesReference(out_b, expected_b, reference_b->q_dtype(), "b layer");
    }
    reference_a->EndStep(false);
    reference_b->EndStep(false);
    EXPECT_FALSE(step_a->open());
    EXPECT_FALSE(step_b->open());
  }
  EXPECT_EQ(session->in_flight(), 0);
  EXPECT_OK(session->Close());
}

TEST_F(StreamTest, PerMessageErrorsLeaveTheStreamAlive) {
  ASSERT_OK_AND_ASSIGN(auto cache, client().CreateCache("c", SmallConfig()));
  ASSERT_OK_AND_ASSIGN(auto reference, client::ReferenceCache::Create(cache.config()));
  ASSERT_OK_AND_ASSIGN(auto session, client().OpenStream());
  std::mt19937_64 rng(21);

  EXPECT_ERROR(session->Plan(MakePlan("nope", {{1, 1}})), absl::StatusCode::kNotFound, "cache");
  EXPECT_ERROR(session->EndStep(123456789, false), absl::StatusCode::kNotFound, "step_id");

  const auto plan = MakePlan("c", {{1, 4}});
  ASSERT_OK_AND_ASSIGN(auto step, session->BeginStep(plan));
  ASSERT_OK(reference->BeginStep(plan));
  attnd::v1::ForwardRequest bad = RandomLayer(rng, cache.config(), 4, 7);
  EXPECT_ERROR(step->Forward(bad), absl::StatusCode::kInvalidArgument, "layer");
  bad = RandomLayer(rng, cache.config(), 3, 0);
  EXPECT_ERROR(step->Forward(bad), absl::StatusCode::kInvalidArgument, "q");
  EXPECT_TRUE(step->open());
  ASSERT_NO_FATAL_FAILURE(RunLayersAndCheck(*step, *reference, cache.config(), rng));
  EXPECT_OK(session->Close());
}

// Commits one step on `cache` over unary calls so sequence 1 has history, then returns the
// cache as it stands.
attnd::v1::CacheInfo Prefill(client::Client& client, const attnd::v1::CacheInfo& cache) {
  std::mt19937_64 rng(22);
  auto reference = client::ReferenceCache::Create(cache.config());
  EXPECT_TRUE(reference.ok());
  RunStepAndCheck(client, **reference, cache, {{1, 6}}, rng);
  auto info = client.GetCache(cache.name());
  EXPECT_TRUE(info.ok());
  return info.ok() ? *info : attnd::v1::CacheInfo();
}

TEST_F(StreamTest, CancelledStreamRollsBackItsOpenStep) {
  ASSERT_OK_AND_ASSIGN(auto cache, client().CreateCache("c", SmallConfig(16)));
  const attnd::v1::CacheInfo before = Prefill(client(), cache);
  ASSERT_EQ(before.used_pages(), 2);
  std::mt19937_64 rng(23);
  {
    ASSERT_OK_AND_ASSIGN(auto session, client().OpenStream());
    ASSERT_OK_AND_ASSIGN(auto step, session->BeginStep(MakePlan("c", {{1, 3}, {2, 9}})));
    ASSERT_OK(step->Forward(RandomLayer(rng, cache.config(), 12, 0)));
    ASSERT_OK_AND_ASSIGN(auto during, client().GetCache("c"));
    EXPECT_EQ(during.open_steps(), 1);
    EXPECT_EQ(during.used_pages(), before.used_pages() + 1 + 3);
    session->Cancel();  // as a client that vanishes: no EndStep is sent
    EXPECT_EQ(step->Abort().status().code(), absl::StatusCode::kCancelled)
        << "nothing can travel on a cancelled stream";
  }
  const attnd::v1::CacheInfo after = AwaitNoOpenSteps(client(), "c");
  EXPECT_EQ(after.open_steps(), 0);
  EXPECT_EQ(after.used_pages(), before.used_pages());
  EXPECT_EQ(after.num_sequences(), before.num_sequences());
  EXPECT_EQ(ProbeLength(client(), "c", 1), 6);
  EXPECT_EQ(ProbeLength(client(), "c", 2), 0);
}

TEST_F(StreamTest, ClosingAStreamAbortsStepsLeftOpenOnIt) {
  ASSERT_OK_AND_ASSIGN(auto cache, client().CreateCache("c", SmallConfig(16)));
  const attnd::v1::CacheInfo before = Prefill(client(), cache);
  ASSERT_OK_AND_ASSIGN(auto session, client().OpenStream());
  ASSERT_OK_AND_ASSIGN(auto plan, session->Plan(MakePlan("c", {{1, 2}})));
  EXPECT_OK(session->Close());
  const attnd::v1::CacheInfo after = AwaitNoOpenSteps(client(), "c");
  EXPECT_EQ(after.open_steps(), 0);
  EXPECT_EQ(after.used_pages(), before.used_pages());
  EXPECT_EQ(ProbeLength(client(), "c", 1), 6);
  ASSERT_OK_AND_ASSIGN(auto ended, client().EndStep(plan.step_id(), false));
  EXPECT_EQ(ended.outcome(), attnd::v1::STEP_OUTCOME_ABORTED);
}

TEST_F(StreamTest, DroppingAnOpenStreamStepAbortsIt) {
  ASSERT_OK_AND_ASSIGN(auto cache, client().CreateCache("c", SmallConfig(16)));
  const attnd::v1::CacheInfo before = Prefill(client(), cache);
  ASSERT_OK_AND_ASSIGN(auto session, client().OpenStream());
  std::mt19937_64 rng(24);
  {
    ASSERT_OK_AND_ASSIGN(auto step, session->BeginStep(MakePlan("c", {{1, 2}})));
    ASSERT_OK(step->Forward(RandomLayer(rng, cache.config(), 2, 1)));
  }
  ASSERT_OK_AND_ASSIGN(auto after, client().GetCache("c"));
  EXPECT_EQ(after.open_steps(), 0) << "the handle's abort travelled before it returned";
  EXPECT_EQ(after.used_pages(), before.used_pages());
  EXPECT_EQ(ProbeLength(client(), "c", 1), 6);
  EXPECT_OK(session->Close());
}

}  // namespace
}  // namespace attnd::integration
