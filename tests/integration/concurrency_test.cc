// Several clients at once: each sees exactly its own results, on separate caches and on one
// shared cache.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <random>
#include <thread>

#include "status_matchers.h"
#include "test_server.h"
#include "test_steps.h"

namespace attnd::integration {
namespace {

using ConcurrencyTest = IntegrationTest;

// Runs `steps` steps for sequences [first_id, first_id + 3) of `cache` through `client`,
// each checked against a private reference mirror (the sequences are this worker's alone, so
// its mirror predicts them exactly).
void Worker(client::Client& client, const attnd::v1::CacheInfo& cache, uint64_t first_id,
            int steps, bool use_stream, uint64_t seed) {
  auto reference = client::ReferenceCache::Create(cache.config());
  ASSERT_OK(reference);
  std::unique_ptr<client::StreamSession> session;
  if (use_stream) {
    ASSERT_OK_AND_ASSIGN(session, client.OpenStream({.window = 4}));
  }
  std::mt19937_64 rng(seed);
  for (int s = 0; s < steps; ++s) {
    const Entries entries = s == 0 ? Entries{{first_id, 7}, {first_id + 1, 2}, {first_id + 2, 1}}
                                   : Entries{{first_id, 1}, {first_id + 1, 1}, {first_id + 2, 1}};
    const attnd::v1::PlanRequest plan = MakePlan(cache.name(), entries);
    ASSERT_OK_AND_ASSIGN(auto step, session ? session->BeginStep(plan) : client.BeginStep(plan));
    ASSERT_OK((*reference)->BeginStep(plan));
    ASSERT_NO_FATAL_FAILURE(RunLayersAndCheck(*step, **reference, cache.config(), rng));
  }
  if (session) ASSERT_OK(session->Close());
}

TEST_F(ConcurrencyTest, TwoClientsOnTheirOwnCaches) {
  std::unique_ptr<client::Client> second = NewClient();
  ASSERT_NE(second, nullptr);
  ASSERT_OK_AND_ASSIGN(auto cache_a, client().CreateCache("a", SmallConfig()));
  ASSERT_OK_AND_ASSIGN(auto cache_b, second->CreateCache("b", SmallConfig()));
  std::atomic<bool> stop{false};
  // A third party polling the server meanwhile must neither fail nor disturb anyone.
  std::thread observer([&] {
    while (!stop.load()) {
      EXPECT_OK(client().ListCaches());
      EXPECT_OK(client().GetStats());
    }
  });
  std::thread first_worker([&] { Worker(client(), cache_a, 1, 8, /*use_stream=*/false, 30); });
  std::thread second_worker([&] { Worker(*second, cache_b, 1, 8, /*use_stream=*/true, 31); });
  first_worker.join();
  second_worker.join();
  stop.store(true);
  observer.join();
}

TEST_F(ConcurrencyTest, TwoClientsShareOneCacheWithOverlappingSteps) {
  std::unique_ptr<client::Client> second = NewClient();
  ASSERT_NE(second, nullptr);
  ASSERT_OK_AND_ASSIGN(auto cache, client().CreateCache("shared", SmallConfig(64)));
  std::thread first_worker([&] { Worker(client(), cache, 100, 8, /*use_stream=*/true, 32); });
  std::thread second_worker([&] { Worker(*second, cache, 200, 8, /*use_stream=*/false, 33); });
  first_worker.join();
  second_worker.join();
  ASSERT_OK_AND_ASSIGN(cache, client().GetCache("shared"));
  EXPECT_EQ(cache.num_sequences(), 6);
  EXPECT_EQ(cache.open_steps(), 0);
}

TEST_F(ConcurrencyTest, StepsOfTwoClientsMayBeOpenTogether) {
  std::unique_ptr<client::Client> second = NewClient();
  ASSERT_NE(second, nullptr);
  ASSERT_OK_AND_ASSIGN(auto cache, client().CreateCache("shared", SmallConfig()));
  ASSERT_OK_AND_ASSIGN(auto reference_1, client::ReferenceCache::Create(cache.config()));
  ASSERT_OK_AND_ASSIGN(auto reference_2, client::ReferenceCache::Create(cache.config()));
  std::mt19937_64 rng(34);
  const auto plan_1 = MakePlan("shared", {{1, 5}});
  const auto plan_2 = MakePlan("shared", {{2, 3}});
  ASSERT_OK_AND_ASSIGN(auto step_1, client().BeginStep(plan_1));
  ASSERT_OK_AND_ASSIGN(auto step_2, second->BeginStep(plan_2));
  ASSERT_OK(reference_1->BeginStep(plan_1));
  ASSERT_OK(reference_2->BeginStep(plan_2));
  ASSERT_OK_AND_ASSIGN(auto info, client().GetCache("shared"));
  EXPECT_EQ(info.open_steps(), 2);
  // Interleave their layers.
  for (int32_t layer = 0; layer < 2; ++layer) {
    const auto request_2 = RandomLayer(rng, cache.config(), 3, layer);
    const auto request_1 = RandomLayer(rng, cache.config(), 5, layer);
    ASSERT_OK_AND_ASSIGN(auto out_2, step_2->Forward(request_2));
    ASSERT_OK_AND_ASSIGN(auto out_1, step_1->Forward(request_1));
    ASSERT_OK_AND_ASSIGN(auto expected_2, reference_2->Forward(request_2));
    ASSERT_OK_AND_ASSIGN(auto expected_1, reference_1->Forward(request_1));
    ExpectMatchesReference(out_1, expected_1, reference_1->q_dtype(), "client 1");
    ExpectMatchesReference(out_2, expected_2, reference_2->q_dtype(), "client 2");
  }
  EXPECT_FALSE(step_1->open());
  EXPECT_FALSE(step_2->open());
}

}  // namespace
}  // namespace attnd::integration
