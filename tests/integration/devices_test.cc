// Several devices (--devices): the CPU backend pretends to have two, each with its own KV
// budget; caches are placed on the one asked for or the least used, GetServerInfo lists both,
// and a sequence moves between devices by export and import. With ATTND_TEST_BACKEND=cuda the
// server serves GPU 0 alone (the placement tests skip), or GPUs 0 and 1 with
// ATTND_TEST_TWO_GPUS=1 on a host that has them.
#include <cstdlib>
#include <optional>
#include <random>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "attnd/client/sequence.h"
#include "http_get.h"
#include "status_matchers.h"
#include "test_server.h"
#include "test_steps.h"

namespace attnd::integration {
namespace {

using ::testing::HasSubstr;

class TwoDevicesTest : public IntegrationTest {
 protected:
  ServerOptions Options() const override {
    ServerOptions options = TestServerOptions();
    options.devices = two() ? std::vector<int32_t>{0, 1} : std::vector<int32_t>{0};
    options.metrics_address = "127.0.0.1:0";
    return options;
  }
  static bool two() {
    return TestBackendName() == "cpu" || std::getenv("ATTND_TEST_TWO_GPUS") != nullptr;
  }
  attnd::v1::CreateCacheRequest Request(const std::string& name, std::optional<int32_t> device,
                                        int64_t pages = 64) {
    attnd::v1::CreateCacheRequest request;
    request.set_name(name);
    *request.mutable_config() = SmallConfig(pages);
    if (device.has_value()) request.set_device(*device);
    return request;
  }
  absl::StatusOr<attnd::v1::CacheInfo> Create(const attnd::v1::CreateCacheRequest& request) {
    auto context = client().NewContext();
    attnd::v1::CreateCacheResponse response;
    const grpc::Status status = client().stub().CreateCache(context.get(), request, &response);
    if (!status.ok()) {
      return absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                          status.error_message());
    }
    return response.cache();
  }
};

TEST_F(TwoDevicesTest, ServerInfoListsEveryDeviceWithItsBudget) {
  ASSERT_OK_AND_ASSIGN(auto info, client().GetServerInfo());
  ASSERT_EQ(info.devices_size(), two() ? 2 : 1);
  int64_t budget = 0;
  for (int i = 0; i < info.devices_size(); ++i) {
    const attnd::v1::DeviceInfo& device = info.devices(i);
    EXPECT_EQ(device.ordinal(), i);
    EXPECT_FALSE(device.name().empty());
    EXPECT_EQ(device.kv_budget_bytes(), kTestKvBudgetBytes);
    EXPECT_EQ(device.kv_free_bytes(), kTestKvBudgetBytes);
    budget += device.kv_budget_bytes();
  }
  EXPECT_EQ(info.kv_budget_bytes(), budget);
  EXPECT_EQ(info.kv_free_bytes(), budget);
}

// attnd_kernel_duration_seconds and attnd_transfer_bytes_total carry the device of the cache
// the work ran for: a step on a cache of device 1 counts there and leaves device 0's series
// (published at start, zero) as they were.
TEST_F(TwoDevicesTest, KernelMetricsNameTheCachesDevice) {
  if (!two()) GTEST_SKIP() << "one GPU served: needs two (ATTND_TEST_TWO_GPUS=1)";
  ASSERT_GT(server().metrics_port(), 0);
  ASSERT_OK_AND_ASSIGN(const std::string before, HttpGet(server().metrics_port(), "/metrics"));
  EXPECT_EQ(MetricSample(before, "attnd_kernel_duration_seconds_count", {"device=\"0\""}), 0);
  EXPECT_EQ(MetricSample(before, "attnd_kernel_duration_seconds_count", {"device=\"1\""}), 0);
  ASSERT_OK(Create(Request("on-one", 1)).status());
  std::mt19937_64 rng(3);
  const attnd::v1::CacheConfig config = SmallConfig(64);
  ASSERT_OK_AND_ASSIGN(auto step, client().BeginStep(MakePlan("on-one", {{1, 5}})));
  for (int32_t layer = 0; layer < config.num_layers(); ++layer) {
    ASSERT_OK(step->Forward(RandomLayer(rng, config, 5, layer)).status());
  }
  ASSERT_OK_AND_ASSIGN(const std::string after, HttpGet(server().metrics_port(), "/metrics"));
  EXPECT_GE(MetricSample(after, "attnd_kernel_duration_seconds_count",
                         {"kernel=\"append\"", "device=\"1\""}),
            config.num_layers());
  EXPECT_EQ(MetricSample(after, "attnd_kernel_duration_seconds_count", {"device=\"0\""}), 0);
  EXPECT_EQ(MetricSample(after, "attnd_transfer_bytes_total", {"device=\"0\""}), 0);
  if (TestBackendName() == "cuda") {  // the cpu backend copies nothing between host and device
    EXPECT_GT(MetricSample(after, "attnd_transfer_bytes_total", {"device=\"1\""}), 0);
  }
}

TEST_F(TwoDevicesTest, CachesGoWhereAskedOrToTheLeastUsedDevice) {
  if (!two()) GTEST_SKIP() << "one GPU served: placement across devices needs two (ATTND_TEST_TWO_GPUS=1)";
  ASSERT_OK_AND_ASSIGN(auto on_one, Create(Request("one", 1)));
  EXPECT_EQ(on_one.device(), 1);
  ASSERT_OK_AND_ASSIGN(auto any, Create(Request("any", std::nullopt)));
  EXPECT_EQ(any.device(), 0);  // device 1 holds a cache, device 0 none
  ASSERT_OK_AND_ASSIGN(auto big, Create(Request("big", std::nullopt, 1024)));
  EXPECT_EQ(big.device(), 0);  // equal free budgets: the first listed
  ASSERT_OK_AND_ASSIGN(auto next, Create(Request("next", std::nullopt)));
  EXPECT_EQ(next.device(), 1);  // now device 1 has more free
  ASSERT_OK_AND_ASSIGN(auto info, client().GetServerInfo());
  EXPECT_EQ(info.devices(0).kv_free_bytes(),
            kTestKvBudgetBytes - any.pool_bytes() - big.pool_bytes());
  EXPECT_EQ(info.devices(1).kv_free_bytes(),
            kTestKvBudgetBytes - on_one.pool_bytes() - next.pool_bytes());
  ASSERT_OK_AND_ASSIGN(auto listed, client().GetCache("one"));
  EXPECT_EQ(listed.device(), 1);

  absl::StatusOr<attnd::v1::CacheInfo> unknown = Create(Request("nowhere", 2));
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(unknown.status().message()), HasSubstr("device"));
  absl::StatusOr<attnd::v1::CacheInfo> negative = Create(Request("negative", -1));
  EXPECT_EQ(negative.status().code(), absl::StatusCode::kInvalidArgument);
  // A device's own budget bounds its caches, whatever the other has free.
  // Device 1 holds two 64-page caches, device 0 one of 64 and one of 1024 pages.
  const int64_t page_bytes = on_one.pool_bytes() / 64;
  const int64_t pages = kTestKvBudgetBytes / page_bytes - 64 * 2 + 1;
  absl::StatusOr<attnd::v1::CacheInfo> too_big = Create(Request("too-big", 1, pages));
  EXPECT_EQ(too_big.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(too_big.status().message()), HasSubstr("device 1"));
  ASSERT_OK(Create(Request("fits-on-0", 0, kTestKvBudgetBytes / page_bytes - 64 - 1024)).status());
}

TEST_F(TwoDevicesTest, SequenceMovesBetweenDevicesByExportAndImport) {
  if (!two()) GTEST_SKIP() << "one GPU served: moving between devices needs two (ATTND_TEST_TWO_GPUS=1)";
  ASSERT_OK(Create(Request("a", 0)).status());
  ASSERT_OK(Create(Request("b", 1)).status());
  ASSERT_OK_AND_ASSIGN(auto a, client().GetCache("a"));
  std::mt19937_64 rng(11);
  ASSERT_OK_AND_ASSIGN(auto reference, client::ReferenceCache::Create(a.config()));
  RunStepAndCheck(client(), *reference, a, {{1, 9}}, rng);
  ASSERT_OK_AND_ASSIGN(auto moved, client::CopySequence(client(), "a", 1, client(), "b"));
  EXPECT_EQ(moved.num_tokens(), 9);
  ASSERT_OK_AND_ASSIGN(auto freed, client().FreeSequences("a", std::vector<uint64_t>{1}));
  EXPECT_EQ(freed, 3);
  // The moved sequence goes on decoding on device 1, checked against the same reference.
  ASSERT_OK_AND_ASSIGN(auto b, client().GetCache("b"));
  RunStepAndCheck(client(), *reference, b, {{1, 1}}, rng);
}

}  // namespace
}  // namespace attnd::integration
