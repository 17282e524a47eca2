// Every RPC of attnd.v1.AttentionService and grpc.health.v1, on the happy path.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <random>

#include "attnd/client/tensor.h"
#include "status_matchers.h"
#include "test_server.h"
#include "test_steps.h"

namespace attnd::integration {
namespace {

using ::testing::ElementsAre;
using ::testing::IsEmpty;
using ::testing::Not;

using RpcTest = IntegrationTest;

// Bytes of one page of both pools over all layers.
int64_t BytesPerPage(const attnd::v1::CacheConfig& config) {
  return int64_t{2} * config.num_layers() * config.page_size() * config.num_kv_heads() *
         config.head_dim() * 2 /* bf16 */;
}

TEST_F(RpcTest, GetServerInfoReportsCpuBackendBudgetAndLimits) {
  ASSERT_OK_AND_ASSIGN(auto info, client().GetServerInfo());
  EXPECT_EQ(info.backend(), TestBackendName());
  EXPECT_THAT(info.version(), Not(IsEmpty()));
  EXPECT_THAT(info.device(), Not(IsEmpty()));
  EXPECT_EQ(info.kv_budget_bytes(), kTestKvBudgetBytes);
  EXPECT_EQ(info.kv_free_bytes(), kTestKvBudgetBytes);
  const ServerOptions options = TestServerOptions();
  EXPECT_EQ(info.limits().max_message_bytes(), options.limits.max_message_bytes);
  EXPECT_EQ(info.limits().max_plan_entries(), options.limits.max_plan_entries);
  EXPECT_EQ(info.limits().max_step_tokens(), options.limits.max_step_tokens);
  EXPECT_DOUBLE_EQ(info.limits().step_ttl_seconds(), absl::ToDoubleSeconds(options.step_ttl));
}

TEST_F(RpcTest, CreateCacheResolvesDefaultsAndReservesBudget) {
  attnd::v1::CacheConfig config = SmallConfig(10);
  config.set_page_size(0);  // default 16
  config.clear_q_dtype();   // default bf16
  config.clear_kv_dtype();  // default: q_dtype
  ASSERT_OK_AND_ASSIGN(auto cache, client().CreateCache("llama", config));
  EXPECT_EQ(cache.name(), "llama");
  EXPECT_EQ(cache.state(), attnd::v1::CACHE_STATE_READY);
  EXPECT_EQ(cache.config().page_size(), 16);
  EXPECT_EQ(cache.config().q_dtype(), attnd::v1::DTYPE_BFLOAT16);
  EXPECT_EQ(cache.config().kv_dtype(), attnd::v1::DTYPE_BFLOAT16);
  EXPECT_EQ(cache.config().num_pages(), 10);
  EXPECT_EQ(cache.num_pages(), 10);
  EXPECT_EQ(cache.used_pages(), 0);
  EXPECT_EQ(cache.num_sequences(), 0);
  EXPECT_EQ(cache.open_steps(), 0);
  EXPECT_EQ(cache.pool_bytes(), 10 * BytesPerPage(cache.config()));

  ASSERT_OK_AND_ASSIGN(auto info, client().GetServerInfo());
  EXPECT_EQ(info.kv_free_bytes(), kTestKvBudgetBytes - cache.pool_bytes());
  ASSERT_OK(client().DeleteCache("llama"));
  ASSERT_OK_AND_ASSIGN(info, client().GetServerInfo());
  EXPECT_EQ(info.kv_free_bytes(), kTestKvBudgetBytes);
}

TEST_F(RpcTest, CreateCacheFromByteBudgetDerivesPageCount) {
  attnd::v1::CacheConfig config = SmallConfig();
  const int64_t per_page = BytesPerPage(config);
  config.set_memory_bytes(per_page * 7 + per_page / 2);
  ASSERT_OK_AND_ASSIGN(auto cache, client().CreateCache("budget", config));
  EXPECT_EQ(cache.num_pages(), 7);
  EXPECT_EQ(cache.config().num_pages(), 7);
}

TEST_F(RpcTest, GetListAndDeleteCaches) {
  for (const char* name : {"b", "a", "c"}) ASSERT_OK(client().CreateCache(name, SmallConfig(4)));
  ASSERT_OK_AND_ASSIGN(auto caches, client().ListCaches());
  std::vector<std::string> names;
  for (const auto& cache : caches) names.push_back(cache.name());
  EXPECT_THAT(names, ElementsAre("a", "b", "c")) << "ListCaches is sorted by name";

  ASSERT_OK_AND_ASSIGN(auto b, client().GetCache("b"));
  EXPECT_EQ(b.name(), "b");
  EXPECT_EQ(b.config().num_layers(), 2);
  ASSERT_OK(client().DeleteCache("b"));
  EXPECT_EQ(client().GetCache("b").status().code(), absl::StatusCode::kNotFound);
  ASSERT_OK_AND_ASSIGN(caches, client().ListCaches());
  EXPECT_EQ(caches.size(), 2u);
}

TEST_F(RpcTest, PlanForwardEndStepOverRawRpcs) {
  ASSERT_OK_AND_ASSIGN(auto cache, client().CreateCache("c", SmallConfig()));
  std::mt19937_64 rng(1);
  ASSERT_OK_AND_ASSIGN(auto plan, client().Plan(MakePlan("c", {{1, 5}, {2, 0}, {3, 1}})));
  EXPECT_GT(plan.step_id(), 0u);
  EXPECT_EQ(plan.num_tokens(), 6);
  ASSERT_EQ(plan.entries_size(), 3);
  EXPECT_EQ(plan.entries(0).start_position(), 0);
  EXPECT_EQ(plan.entries(0).row_offset(), 0);
  EXPECT_EQ(plan.entries(2).row_offset(), 5);
  EXPECT_THAT(plan.kernel(), Not(IsEmpty()));

  attnd::v1::ForwardRequest layer0 = RandomLayer(rng, cache.config(), 6, 0);
  layer0.set_step_id(plan.step_id());
  ASSERT_OK_AND_ASSIGN(auto out0, client().Forward(layer0));
  EXPECT_FALSE(out0.step_committed());
  EXPECT_THAT(out0.o().shape(), ElementsAre(6, 4, 64));
  EXPECT_THAT(out0.lse().shape(), ElementsAre(6, 4));

  attnd::v1::ForwardRequest layer1 = RandomLayer(rng, cache.config(), 6, 1);
  layer1.set_step_id(plan.step_id());
  ASSERT_OK_AND_ASSIGN(auto out1, client().Forward(layer1));
  EXPECT_TRUE(out1.step_committed());

  // EndStep on a recently finished step reports its outcome again.
  ASSERT_OK_AND_ASSIGN(auto ended, client().EndStep(plan.step_id(), /*abort=*/false));
  EXPECT_EQ(ended.outcome(), attnd::v1::STEP_OUTCOME_COMMITTED);
  EXPECT_EQ(ended.layers_run(), 2);
  EXPECT_EQ(ProbeLength(client(), "c", 1), 5);
  EXPECT_EQ(ProbeLength(client(), "c", 3), 1);
}

TEST_F(RpcTest, EndStepCommitsBeforeEveryLayerRan) {
  ASSERT_OK_AND_ASSIGN(auto cache, client().CreateCache("c", SmallConfig()));
  std::mt19937_64 rng(2);
  ASSERT_OK_AND_ASSIGN(auto step, client().BeginStep(MakePlan("c", {{1, 3}})));
  ASSERT_OK(step->Forward(RandomLayer(rng, cache.config(), 3, 1)));
  ASSERT_OK_AND_ASSIGN(auto ended, step->End());
  EXPECT_EQ(ended.outcome(), attnd::v1::STEP_OUTCOME_COMMITTED);
  EXPECT_EQ(ended.layers_run(), 1);
  EXPECT_FALSE(step->open());
  EXPECT_EQ(ProbeLength(client(), "c", 1), 3);
}

TEST_F(RpcTest, FreeSequencesReturnsTheirPages) {
  ASSERT_OK_AND_ASSIGN(auto cache, client().CreateCache("c", SmallConfig(16)));
  auto reference = client::ReferenceCache::Create(cache.config());
  ASSERT_OK(reference);
  std::mt19937_64 rng(3);
  // 4-token pages: 5 tokens take 2 pages, 1 token 1 page.
  ASSERT_NO_FATAL_FAILURE(RunStepAndCheck(client(), **reference, cache, {{1, 5}, {2, 1}}, rng));
  ASSERT_OK_AND_ASSIGN(cache, client().GetCache("c"));
  EXPECT_EQ(cache.used_pages(), 3);
  EXPECT_EQ(cache.num_sequences(), 2);

  const std::vector<uint64_t> ids = {1};
  ASSERT_OK_AND_ASSIGN(const int64_t freed, client().FreeSequences("c", ids));
  EXPECT_EQ(freed, 2);
  ASSERT_OK_AND_ASSIGN(cache, client().GetCache("c"));
  EXPECT_EQ(cache.used_pages(), 1);
  EXPECT_EQ(cache.num_sequences(), 1);
  EXPECT_EQ(ProbeLength(client(), "c", 1), 0) << "a freed sequence starts again at 0";
}

TEST_F(RpcTest, GetStatsCountsStepsTokensAndKernels) {
  ASSERT_OK_AND_ASSIGN(auto before, client().GetStats());
  ASSERT_OK_AND_ASSIGN(auto cache, client().CreateCache("c", SmallConfig()));
  auto reference = client::ReferenceCache::Create(cache.config());
  ASSERT_OK(reference);
  std::mt19937_64 rng(4);
  ASSERT_NO_FATAL_FAILURE(RunStepAndCheck(client(), **reference, cache, {{1, 7}}, rng));
  ASSERT_NO_FATAL_FAILURE(RunStepAndCheck(client(), **reference, cache, {{1, 1}}, rng));
  ASSERT_OK_AND_ASSIGN(auto after, client().GetStats());
  EXPECT_EQ(after.steps_committed(), before.steps_committed() + 2);
  EXPECT_EQ(after.tokens_prefill(), before.tokens_prefill() + 7);
  EXPECT_EQ(after.tokens_decode(), before.tokens_decode() + 1);
  int64_t kernel_calls = 0;
  for (const auto& kernel : after.kernels()) {
    EXPECT_THAT(kernel.kernel(), Not(IsEmpty()));
    EXPECT_GE(kernel.total_seconds(), 0.0);
    kernel_calls += kernel.count();
  }
  EXPECT_GT(kernel_calls, 0);
}

TEST_F(RpcTest, ForwardAcceptsFloatValuesInsteadOfRawData) {
  // grpcurl users send `values`; the server converts them to the dtype as MakeTensor would.
  ASSERT_OK_AND_ASSIGN(auto cache, client().CreateCache("c", SmallConfig()));
  ASSERT_OK_AND_ASSIGN(auto reference, client::ReferenceCache::Create(cache.config()));
  std::mt19937_64 rng(5);
  const attnd::v1::PlanRequest plan = MakePlan("c", {{1, 3}});
  ASSERT_OK_AND_ASSIGN(auto step, client().BeginStep(plan));
  ASSERT_OK(reference->BeginStep(plan));
  for (int32_t layer = 0; layer < 2; ++layer) {
    const attnd::v1::ForwardRequest raw = RandomLayer(rng, cache.config(), 3, layer);
    attnd::v1::ForwardRequest as_values = raw;
    for (attnd::v1::Tensor* tensor :
         {as_values.mutable_q(), as_values.mutable_k(), as_values.mutable_v()}) {
      ASSERT_OK_AND_ASSIGN(const std::vector<float> values, client::TensorToFloats(*tensor));
      tensor->clear_data();
      for (float value : values) tensor->add_values(value);
    }
    ASSERT_OK_AND_ASSIGN(auto out, step->Forward(as_values));
    ASSERT_OK_AND_ASSIGN(auto expected, reference->Forward(raw));
    ExpectMatchesReference(out, expected, reference->q_dtype(), "values");
    EXPECT_FALSE(out.o().data().empty()) << "responses always use data";
  }
}

TEST_F(RpcTest, MessagesAboveGrpcDefaultLimitTravelBothWays) {
  // 128 query heads of 256 dims: 64 KiB of q per token, so 80 tokens make a 5 MiB request and
  // a 5 MiB response, past gRPC's 4 MiB default.
  attnd::v1::CacheConfig config = SmallConfig(32);
  config.set_num_qo_heads(128);
  config.set_num_kv_heads(16);
  config.set_head_dim(256);
  config.set_num_layers(1);
  ASSERT_OK_AND_ASSIGN(auto cache, client().CreateCache("wide", config));
  ASSERT_OK_AND_ASSIGN(auto reference, client::ReferenceCache::Create(cache.config()));
  std::mt19937_64 rng(6);
  const attnd::v1::PlanRequest plan = MakePlan("wide", {{1, 80}});
  ASSERT_OK_AND_ASSIGN(auto step, client().BeginStep(plan));
  ASSERT_OK(reference->BeginStep(plan));
  const attnd::v1::ForwardRequest request = RandomLayer(rng, config, 80, 0);
  ASSERT_GT(request.ByteSizeLong(), size_t{4} << 20);
  ASSERT_OK_AND_ASSIGN(auto out, step->Forward(request));
  EXPECT_GT(out.ByteSizeLong(), size_t{4} << 20);
  ASSERT_OK_AND_ASSIGN(auto expected, reference->Forward(request));
  ExpectMatchesReference(out, expected, reference->q_dtype(), "wide layer");
}

TEST_F(RpcTest, HealthReportsLivenessAndReadiness) {
  ASSERT_OK_AND_ASSIGN(auto live, client().CheckHealth(""));
  EXPECT_EQ(live, grpc::health::v1::HealthCheckResponse::SERVING);
  ASSERT_OK_AND_ASSIGN(auto ready, client().CheckHealth(client::kReadinessService));
  EXPECT_EQ(ready, grpc::health::v1::HealthCheckResponse::SERVING);
  EXPECT_EQ(client().CheckHealth("no.such.Service").status().code(),
            absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace attnd::integration
