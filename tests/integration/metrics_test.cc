// /metrics over HTTP: the attnd_ families exist and move when work is done.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <random>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "http_get.h"
#include "status_matchers.h"
#include "test_server.h"
#include "test_steps.h"

namespace attnd::integration {
namespace {

using ::testing::HasSubstr;

class MetricsTest : public IntegrationTest {
 protected:
  ServerOptions Options() const override {
    ServerOptions options = TestServerOptions();
    options.metrics_address = "127.0.0.1:0";
    return options;
  }
};

TEST_F(MetricsTest, AttndFamiliesAreExposedAndMove) {
  ASSERT_GT(server().metrics_port(), 0);
  ASSERT_OK_AND_ASSIGN(const std::string before, HttpGet(server().metrics_port(), "/metrics"));
  EXPECT_EQ(MetricSample(before, "attnd_build_info", {"backend=\"" + TestBackendName() + "\""}), 1.0);

  ASSERT_OK_AND_ASSIGN(auto cache, client().CreateCache("m", SmallConfig()));
  ASSERT_OK_AND_ASSIGN(auto reference, client::ReferenceCache::Create(cache.config()));
  std::mt19937_64 rng(40);
  ASSERT_NO_FATAL_FAILURE(RunStepAndCheck(client(), *reference, cache, {{1, 6}, {2, 1}}, rng));
  ASSERT_NO_FATAL_FAILURE(RunStepAndCheck(client(), *reference, cache, {{1, 1}, {2, 1}}, rng));
  EXPECT_EQ(client().GetCache("missing").status().code(), absl::StatusCode::kNotFound);

  ASSERT_OK_AND_ASSIGN(const std::string after, HttpGet(server().metrics_port(), "/metrics"));
  for (const char* family :
       {"attnd_kernel_duration_seconds", "attnd_rpc_duration_seconds", "attnd_rpc_requests_total",
        "attnd_plan_duration_seconds", "attnd_batch_tokens", "attnd_tokens_total",
        "attnd_kv_pages", "attnd_kv_cache_usage_ratio", "attnd_transfer_bytes_total",
        "attnd_errors_total", "attnd_build_info"}) {
    EXPECT_THAT(after, HasSubstr(std::string("# TYPE ") + family)) << family;
  }
  EXPECT_GE(MetricSample(after, "attnd_tokens_total", {"phase=\"prefill\""}), 6);
  EXPECT_GE(MetricSample(after, "attnd_tokens_total", {"phase=\"decode\""}), 3);
  EXPECT_GE(MetricSample(after, "attnd_rpc_requests_total", {"method=\"Forward\"", "code=\"OK\""}), 4);
  EXPECT_GE(MetricSample(after, "attnd_rpc_requests_total", {"code=\"NOT_FOUND\""}), 1);
  EXPECT_GT(MetricSample(after, "attnd_kernel_duration_seconds_count"),
            std::max(0.0, MetricSample(before, "attnd_kernel_duration_seconds_count")));
  // Kernel and transfer series carry the device of the cache they ran for (device 0 here).
  EXPECT_EQ(MetricSample(after, "attnd_kernel_duration_seconds_count", {"device=\"0\""}),
            MetricSample(after, "attnd_kernel_duration_seconds_count"));
  EXPECT_GE(MetricSample(after, "attnd_transfer_bytes_total", {"direction=\"h2d\"",
                                                              "device=\"0\""}),
            0);
  EXPECT_GT(MetricSample(after, "attnd_plan_duration_seconds_count"),
            std::max(0.0, MetricSample(before, "attnd_plan_duration_seconds_count")));
  // Duration buckets are 1-2-5 steps from 5 us to 10 s, printed as written.
  for (const char* bound : {"le=\"5e-06\"", "le=\"1e-05\"", "le=\"0.002\"", "le=\"10\""}) {
    EXPECT_GE(MetricSample(after, "attnd_kernel_duration_seconds_bucket", {bound}), 0) << bound;
  }
  std::istringstream lines(after);
  for (std::string line; std::getline(lines, line);) {
    const size_t le = line.find("le=\"");
    if (le == std::string::npos) continue;
    const std::string bound = line.substr(le, line.find('"', le + 4) - le);
    EXPECT_EQ(bound.find("9999"), std::string::npos) << "inexact bucket bound: " << line;
    EXPECT_EQ(bound.find("0000"), std::string::npos) << "inexact bucket bound: " << line;
  }
  // Sequence 1 holds 2 pages and sequence 2 one page of 4 tokens.
  EXPECT_EQ(MetricSample(after, "attnd_kv_pages", {"cache=\"m\"", "state=\"used\""}), 3);
  EXPECT_EQ(MetricSample(after, "attnd_kv_pages", {"cache=\"m\"", "state=\"free\""}), 61);
}

}  // namespace
}  // namespace attnd::integration
