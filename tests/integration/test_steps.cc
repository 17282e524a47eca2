#include "test_steps.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <numeric>

#include "attnd/client/compare.h"
#include "attnd/client/tensor.h"
#include "status_matchers.h"

namespace attnd::integration {
namespace {

attnd::v1::Tensor RandomTensor(std::mt19937_64& rng, attnd::v1::DType dtype,
                               std::vector<int64_t> shape) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> values(
      static_cast<size_t>(std::accumulate(shape.begin(), shape.end(), int64_t{1},
                                          std::multiplies<int64_t>())));
  for (float& value : values) value = normal(rng);
  auto tensor = client::MakeTensor(static_cast<DType>(dtype), shape,
                                   std::span<const float>(values));
  EXPECT_TRUE(tensor.ok()) << tensor.status();
  return tensor.ok() ? *std::move(tensor) : attnd::v1::Tensor();
}

}  // namespace

attnd::v1::CacheConfig SmallConfig(int64_t num_pages) {
  attnd::v1::CacheConfig config;
  config.set_kind(attnd::v1::ATTENTION_KIND_MHA);
  config.set_num_layers(2);
  config.set_num_qo_heads(4);
  config.set_num_kv_heads(2);
  config.set_head_dim(64);
  config.set_page_size(4);
  config.set_q_dtype(attnd::v1::DTYPE_BFLOAT16);
  config.set_kv_dtype(attnd::v1::DTYPE_BFLOAT16);
  config.set_num_pages(num_pages);
  config.mutable_rope()->set_style(attnd::v1::ROPE_STYLE_NEOX);
  return config;
}

attnd::v1::PlanRequest MakePlan(const std::string& cache, const Entries& entries,
                                bool return_lse) {
  attnd::v1::PlanRequest plan;
  plan.set_cache(cache);
  for (const auto& [id, tokens] : entries) {
    attnd::v1::PlanEntry* entry = plan.add_entries();
    entry->set_sequence_id(id);
    entry->set_num_new_tokens(tokens);
  }
  plan.mutable_options()->set_return_lse(return_lse);
  return plan;
}

attnd::v1::ForwardRequest RandomLayer(std::mt19937_64& rng, const attnd::v1::CacheConfig& config,
                                      int64_t rows, int32_t layer) {
  attnd::v1::ForwardRequest request;
  request.set_layer(layer);
  *request.mutable_q() =
      RandomTensor(rng, config.q_dtype(), {rows, config.num_qo_heads(), config.head_dim()});
  *request.mutable_k() =
      RandomTensor(rng, config.q_dtype(), {rows, config.num_kv_heads(), config.head_dim()});
  *request.mutable_v() =
      RandomTensor(rng, config.q_dtype(), {rows, config.num_kv_heads(), config.head_dim()});
  return request;
}

void ExpectMatchesReference(const attnd::v1::ForwardResponse& actual,
                            const client::ReferenceOutput& expected, DType q_dtype,
                            const std::string& what) {
  EXPECT_EQ(actual.o().dtype(), client::ToProto(q_dtype)) << what;
  auto o = client::TensorToFloats(actual.o());
  ASSERT_TRUE(o.ok()) << what << ": " << o.status();
  ASSERT_EQ(o->size(), expected.o.size()) << what;
  const client::ErrorStats o_error = client::CompareOutputs(*o, expected.o);
  EXPECT_EQ(o_error.mismatched_non_finite, 0) << what;
  EXPECT_LE(o_error.normwise_relative, client::OutputTolerance(q_dtype))
      << what << ": o differs from the reference (max abs " << o_error.max_abs << ")";
  if (!expected.lse.empty()) {
    EXPECT_EQ(actual.lse().dtype(), attnd::v1::DTYPE_FLOAT32) << what;
    auto lse = client::TensorToFloats(actual.lse());
    ASSERT_TRUE(lse.ok()) << what << ": " << lse.status();
    ASSERT_EQ(lse->size(), expected.lse.size()) << what;
    const client::ErrorStats lse_error = client::CompareOutputs(*lse, expected.lse);
    EXPECT_EQ(lse_error.mismatched_non_finite, 0) << what;
    EXPECT_LE(lse_error.max_abs, client::LseTolerance(q_dtype)) << what << ": lse differs";
  }
}

void RunLayersAndCheck(client::Step& step, client::ReferenceCache& reference,
                       const attnd::v1::CacheConfig& config, std::mt19937_64& rng,
                       std::vector<int32_t> layer_order) {
  if (layer_order.empty()) {
    for (int32_t layer = 0; layer < config.num_layers(); ++layer) layer_order.push_back(layer);
  }
  bool committed = false;
  for (size_t i = 0; i < layer_order.size(); ++i) {
    const int32_t layer = layer_order[i];
    const attnd::v1::ForwardRequest request = RandomLayer(rng, config, step.num_tokens(), layer);
    ASSERT_OK_AND_ASSIGN(const attnd::v1::ForwardResponse response, step.Forward(request));
    ASSERT_OK_AND_ASSIGN(const client::ReferenceOutput expected, reference.Forward(request));
    ASSERT_NO_FATAL_FAILURE(ExpectMatchesReference(response, expected, reference.q_dtype(),
                                                   "layer " + std::to_string(layer)));
    committed = response.step_committed();
    if (static_cast<int32_t>(i) + 1 < config.num_layers()) {
      EXPECT_FALSE(committed) << "committed before its last layer";
    }
  }
  if (committed) reference.EndStep(/*abort=*/false);
}

void RunStepAndCheck(client::Client& client, client::ReferenceCache& reference,
                     const attnd::v1::CacheInfo& cache, const Entries& entries,
                     std::mt19937_64& rng) {
  const attnd::v1::PlanRequest plan = MakePlan(cache.name(), entries);
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<client::Step> step, client.BeginStep(plan));
  ASSERT_OK(reference.BeginStep(plan));
  ASSERT_NO_FATAL_FAILURE(RunLayersAndCheck(*step, reference, cache.config(), rng));
  EXPECT_FALSE(step->open()) << "the step should commit after its last layer";
  EXPECT_FALSE(reference.step_open());
}

int64_t ProbeLength(client::Client& client, const std::string& cache, uint64_t sequence_id) {
  auto plan = client.Plan(MakePlan(cache, {{sequence_id, 1}}, false));
  EXPECT_TRUE(plan.ok()) << "probe of sequence " << sequence_id << ": " << plan.status();
  if (!plan.ok()) return -1;
  auto ended = client.EndStep(plan->step_id(), /*abort=*/true);
  EXPECT_TRUE(ended.ok()) << ended.status();
  return plan->entries(0).start_position();
}

}  // namespace attnd::integration
