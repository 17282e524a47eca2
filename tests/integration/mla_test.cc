// MLA caches end to end through the server: the suite's backend (cpu, or cuda with
// ATTND_TEST_BACKEND=cuda, where every MLA row runs on the GPU) against a second in-process
// server on the CPU backend, the reference, fed the same plans and the same layers. Chunked
// prefill, decode, speculative rows, padding, lse on and off.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "attnd/client/compare.h"
#include "attnd/client/tensor.h"
#include "status_matchers.h"
#include "test_server.h"
#include "test_steps.h"

namespace attnd::integration {
namespace {

using MlaTest = IntegrationTest;

// 2 layers, 16 heads, kv_lora_rank 512 + rope 64, 32-token pages, bf16, NeoX RoPE on kpe/q_pe.
attnd::v1::CacheConfig MlaConfig() {
  attnd::v1::CacheConfig config;
  config.set_kind(attnd::v1::ATTENTION_KIND_MLA);
  config.set_num_layers(2);
  config.set_num_qo_heads(16);
  config.set_kv_lora_rank(512);
  config.set_rope_dim(64);
  config.set_page_size(32);
  config.set_q_dtype(attnd::v1::DTYPE_BFLOAT16);
  config.set_kv_dtype(attnd::v1::DTYPE_BFLOAT16);
  config.set_num_pages(32);
  config.mutable_rope()->set_style(attnd::v1::ROPE_STYLE_NEOX);
  return config;
}

attnd::v1::Tensor RandomTensor(std::mt19937_64& rng, std::vector<int64_t> shape) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> values(static_cast<size_t>(
      std::accumulate(shape.begin(), shape.end(), int64_t{1}, std::multiplies<int64_t>())));
  for (float& value : values) value = normal(rng);
  auto tensor = client::MakeTensor(DType::kBFloat16, shape, std::span<const float>(values));
  EXPECT_TRUE(tensor.ok()) << tensor.status();
  return tensor.ok() ? *std::move(tensor) : attnd::v1::Tensor();
}

attnd::v1::ForwardRequest RandomMlaLayer(std::mt19937_64& rng, const attnd::v1::CacheConfig& config,
                                         int64_t rows, int32_t layer) {
  const int64_t heads = config.num_qo_heads();
  attnd::v1::ForwardRequest request;
  request.set_layer(layer);
  *request.mutable_q() = RandomTensor(rng, {rows, heads, config.kv_lora_rank()});
  *request.mutable_q_pe() = RandomTensor(rng, {rows, heads, config.rope_dim()});
  *request.mutable_ckv() = RandomTensor(rng, {rows, config.kv_lora_rank()});
  *request.mutable_kpe() = RandomTensor(rng, {rows, config.rope_dim()});
  return request;
}

void ExpectSameOutputs(const attnd::v1::ForwardResponse& actual,
                       const attnd::v1::ForwardResponse& expected, const std::string& what) {
  auto o = client::TensorToFloats(actual.o());
  auto o_expected = client::TensorToFloats(expected.o());
  ASSERT_TRUE(o.ok() && o_expected.ok()) << what;
  ASSERT_EQ(o->size(), o_expected->size()) << what;
  const client::ErrorStats o_error = client::CompareOutputs(*o, *o_expected);
  EXPECT_EQ(o_error.mismatched_non_finite, 0) << what;
  EXPECT_LE(o_error.normwise_relative, client::OutputTolerance(DType::kBFloat16))
      << what << ": o differs from the CPU backend's (max abs " << o_error.max_abs << ")";
  EXPECT_EQ(actual.has_lse(), expected.has_lse()) << what;
  if (!expected.has_lse()) return;
  auto lse = client::TensorToFloats(actual.lse());
  auto lse_expected = client::TensorToFloats(expected.lse());
  ASSERT_TRUE(lse.ok() && lse_expected.ok()) << what;
  ASSERT_EQ(lse->size(), lse_expected->size()) << what;
  const client::ErrorStats lse_error = client::CompareOutputs(*lse, *lse_expected);
  EXPECT_EQ(lse_error.mismatched_non_finite, 0) << what;
  EXPECT_LE(lse_error.max_abs, client::LseTolerance(DType::kBFloat16)) << what << ": lse differs";
}

TEST_F(MlaTest, ChunkedPrefillDecodeAndPaddingMatchTheCpuBackend) {
  ServerOptions reference_options = TestServerOptions();
  reference_options.backend = BackendKind::kCpu;
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Server> reference_server,
                       Server::Start(reference_options));
  client::ClientOptions client_options;
  client_options.address = "127.0.0.1:" + std::to_string(reference_server->port());
  client_options.timeout = absl::Seconds(30);
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<client::Client> reference,
                       client::Client::Connect(client_options));
  ASSERT_OK(reference->WaitForConnected(absl::Seconds(10)));

  ASSERT_OK_AND_ASSIGN(auto info, client().GetServerInfo());
  EXPECT_THAT(info.extensions(), ::testing::Contains("mla")) << info.backend();
  const attnd::v1::CacheConfig config = MlaConfig();
  ASSERT_OK_AND_ASSIGN(const auto cache, client().CreateCache("deepseek", config));
  ASSERT_OK(reference->CreateCache("deepseek", config));

  struct MlaStep {
    Entries entries;
    bool return_lse;
    std::string kernel;
  };
  const std::vector<MlaStep> steps = {
      {{{1, 40}, {2, 7}}, true, "mla_prefill"},                      // first prefill chunks
      {{{1, 1}, {3, 0}, {2, 33}, {4, 3}}, true, "mla_prefill"},      // chunk + decode + padding
      {{{1, 1}, {2, 1}, {4, 1}}, true, "mla_decode"},
      {{{5, 0}, {2, 1}, {1, 2}, {4, 12}}, false, "mla_prefill"},     // lse off
      {{{1, 1}, {2, 1}, {4, 1}, {6, 0}}, false, "mla_decode"},
  };
  std::mt19937_64 rng(2024);
  for (size_t s = 0; s < steps.size(); ++s) {
    SCOPED_TRACE("step " + std::to_string(s));
    const attnd::v1::PlanRequest plan = MakePlan(cache.name(), steps[s].entries, steps[s].return_lse);
    ASSERT_OK_AND_ASSIGN(std::unique_ptr<client::Step> step, client().BeginStep(plan));
    ASSERT_OK_AND_ASSIGN(std::unique_ptr<client::Step> expected_step, reference->BeginStep(plan));
    EXPECT_EQ(step->plan().kernel(), steps[s].kernel);
    EXPECT_EQ(step->plan().kernel(), expected_step->plan().kernel());
    ASSERT_EQ(step->num_tokens(), expected_step->num_tokens());
    for (int32_t layer = 0; layer < config.num_layers(); ++layer) {
      const attnd::v1::ForwardRequest request =
          RandomMlaLayer(rng, config, step->num_tokens(), layer);
      ASSERT_OK_AND_ASSIGN(const auto response, step->Forward(request));
      ASSERT_OK_AND_ASSIGN(const auto expected, expected_step->Forward(request));
      ASSERT_NO_FATAL_FAILURE(ExpectSameOutputs(response, expected, "layer " + std::to_string(layer)));
    }
    EXPECT_FALSE(step->open()) << "the step should commit after its last layer";
  }
  reference.reset();
  reference_server->Shutdown();
  reference_server->Wait();
}

}  // namespace
}  // namespace attnd::integration
