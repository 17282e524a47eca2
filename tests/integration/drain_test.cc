// Draining (what SIGTERM does): readiness drops, new steps are refused, open steps may finish.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <random>
#include <thread>

#include "absl/time/clock.h"
#include "status_matchers.h"
#include "test_server.h"
#include "test_steps.h"

namespace attnd::integration {
namespace {

class DrainTest : public IntegrationTest {
 protected:
  ServerOptions Options() const override {
    ServerOptions options = TestServerOptions();
    options.drain_grace = absl::Seconds(20);
    return options;
  }
};

TEST_F(DrainTest, OpenStepsFinishWhileReadinessIsDown) {
  ASSERT_OK_AND_ASSIGN(auto cache, client().CreateCache("c", SmallConfig()));
  ASSERT_OK_AND_ASSIGN(auto reference, client::ReferenceCache::Create(cache.config()));
  const attnd::v1::PlanRequest plan = MakePlan("c", {{1, 4}});
  ASSERT_OK_AND_ASSIGN(auto step, client().BeginStep(plan));
  ASSERT_OK(reference->BeginStep(plan));

  const absl::Time shutdown_start = absl::Now();
  std::thread shutdown([this] { server().Shutdown(); });
  client::HealthStatus readiness = grpc::health::v1::HealthCheckResponse::SERVING;
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (readiness == grpc::health::v1::HealthCheckResponse::SERVING && absl::Now() < deadline) {
    auto checked = client().CheckHealth(client::kReadinessService);
    ASSERT_OK(checked);
    readiness = *checked;
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_EQ(readiness, grpc::health::v1::HealthCheckResponse::NOT_SERVING);
  EXPECT_EQ(client().Plan(MakePlan("c", {{2, 1}})).status().code(),
            absl::StatusCode::kUnavailable)
      << "a draining server takes no new steps";

  std::mt19937_64 rng(50);
  ASSERT_NO_FATAL_FAILURE(RunLayersAndCheck(*step, *reference, cache.config(), rng));
  EXPECT_FALSE(step->open());
  shutdown.join();
  EXPECT_LT(absl::Now() - shutdown_start, absl::Seconds(10))
      << "shutdown should not wait out the grace once the last step committed";
}

}  // namespace
}  // namespace attnd::integration
