// Draining (what SIGTERM does): readiness drops, new steps are refused, open steps may finish.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <optional>
#include <random>
#include <thread>

#include "absl/time/clock.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/grpcpp.h"
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

using grpc::health::v1::Health;
using grpc::health::v1::HealthCheckRequest;
using grpc::health::v1::HealthCheckResponse;

// A Watch stream on its own channel.
struct HealthWatch {
  HealthWatch(const std::string& address, const std::string& service)
      : stub(Health::NewStub(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()))) {
    HealthCheckRequest request;
    request.set_service(service);
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    reader = stub->Watch(&context, request);
  }
  // The next status sent, or nullopt once the stream has ended.
  std::optional<HealthCheckResponse::ServingStatus> Next() {
    HealthCheckResponse response;
    if (!reader->Read(&response)) return std::nullopt;
    return response.status();
  }
  std::unique_ptr<Health::Stub> stub;
  grpc::ClientContext context;
  std::unique_ptr<grpc::ClientReader<HealthCheckResponse>> reader;
};

TEST_F(DrainTest, WatchSeesReadinessDropThenTheStreamEndsAtShutdown) {
  HealthWatch readiness(address(), "attnd.v1.AttentionService");
  HealthWatch liveness(address(), "");
  EXPECT_EQ(readiness.Next(), HealthCheckResponse::SERVING);
  EXPECT_EQ(liveness.Next(), HealthCheckResponse::SERVING);

  std::thread shutdown([this] { server().Shutdown(); });
  EXPECT_EQ(readiness.Next(), HealthCheckResponse::NOT_SERVING);
  // Liveness only drops as the server stops; then both streams end cleanly.
  EXPECT_EQ(liveness.Next(), HealthCheckResponse::NOT_SERVING);
  EXPECT_EQ(readiness.Next(), std::nullopt);
  EXPECT_EQ(liveness.Next(), std::nullopt);
  EXPECT_TRUE(readiness.reader->Finish().ok());
  EXPECT_TRUE(liveness.reader->Finish().ok());
  shutdown.join();
}

TEST_F(DrainTest, WatchOfAnUnknownServiceSaysSoAndStaysOpen) {
  HealthWatch unknown(address(), "no.such.Service");
  EXPECT_EQ(unknown.Next(), HealthCheckResponse::SERVICE_UNKNOWN);
  unknown.context.TryCancel();
  EXPECT_EQ(unknown.Next(), std::nullopt);
  EXPECT_EQ(unknown.reader->Finish().error_code(), grpc::StatusCode::CANCELLED);
  // Check, unlike Watch, answers NOT_FOUND for an unknown name.
  EXPECT_EQ(client().CheckHealth("no.such.Service").status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace attnd::integration
