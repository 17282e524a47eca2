// Every error code the API promises, each with a message that names the offending field, and
// a failed call that changes nothing.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <random>

#include "attnd/client/tensor.h"
#include "status_matchers.h"
#include "test_server.h"
#include "test_steps.h"

namespace attnd::integration {
namespace {

using Code = absl::StatusCode;
using ErrorsTest = IntegrationTest;

TEST_F(ErrorsTest, InvalidCacheConfigsNameTheField) {
  attnd::v1::CacheConfig config = SmallConfig();
  config.set_head_dim(100);
  EXPECT_ERROR(client().CreateCache("c", config), Code::kInvalidArgument, "head_dim");

  config = SmallConfig();
  config.set_page_size(3);
  EXPECT_ERROR(client().CreateCache("c", config), Code::kInvalidArgument, "page_size");

  config = SmallConfig();
  config.set_num_layers(0);
  EXPECT_ERROR(client().CreateCache("c", config), Code::kInvalidArgument, "num_layers");

  config = SmallConfig();
  config.set_num_qo_heads(3);  // not a multiple of 2 KV heads
  EXPECT_ERROR(client().CreateCache("c", config), Code::kInvalidArgument, "heads");

  config = SmallConfig();
  config.clear_capacity();
  EXPECT_ERROR(client().CreateCache("c", config), Code::kInvalidArgument, "capacity");

  EXPECT_ERROR(client().CreateCache("bad name!", SmallConfig()), Code::kInvalidArgument, "name");
  EXPECT_ERROR(client().CreateCache("", SmallConfig()), Code::kInvalidArgument, "name");

  ASSERT_OK_AND_ASSIGN(auto caches, client().ListCaches());
  EXPECT_TRUE(caches.empty()) << "no failed create may leave a cache behind";
}

TEST_F(ErrorsTest, InvalidForwardTensorsNameTheField) {
  ASSERT_OK_AND_ASSIGN(auto cache, client().CreateCache("c", SmallConfig()));
  std::mt19937_64 rng(1);
  ASSERT_OK_AND_ASSIGN(auto step, client().BeginStep(MakePlan("c", {{1, 3}})));

  attnd::v1::ForwardRequest request = RandomLayer(rng, cache.config(), 3, 0);
  request.mutable_q()->set_shape(0, 4);  // 4 rows for a 3-row step
  EXPECT_ERROR(step->Forward(request), Code::kInvalidArgument, "q");

  request = RandomLayer(rng, cache.config(), 3, 0);
  request.mutable_k()->set_dtype(attnd::v1::DTYPE_FLOAT16);
  EXPECT_ERROR(step->Forward(request), Code::kInvalidArgument, "k");

  request = RandomLayer(rng, cache.config(), 3, 0);
  request.mutable_v()->mutable_data()->resize(10);
  EXPECT_ERROR(step->Forward(request), Code::kInvalidArgument, "v");

  request = RandomLayer(rng, cache.config(), 3, 0);
  request.set_layer(2);  // the cache has 2 layers
  EXPECT_ERROR(step->Forward(request), Code::kInvalidArgument, "layer");

  request = RandomLayer(rng, cache.config(), 3, 0);
  request.clear_v();
  EXPECT_ERROR(step->Forward(request), Code::kInvalidArgument, "v");

  // None of that consumed the layer: it still runs.
  EXPECT_OK(step->Forward(RandomLayer(rng, cache.config(), 3, 0)));
}

TEST_F(ErrorsTest, InvalidPlansNameTheField) {
  ASSERT_OK(client().CreateCache("c", SmallConfig()));
  EXPECT_ERROR(client().Plan(MakePlan("c", {{1, -1}})), Code::kInvalidArgument,
               "num_new_tokens");
  EXPECT_ERROR(client().Plan(MakePlan("c", {{1, 2}, {1, 3}})), Code::kInvalidArgument,
               "sequence_id");
  ASSERT_OK_AND_ASSIGN(auto cache, client().GetCache("c"));
  EXPECT_EQ(cache.open_steps(), 0);
  EXPECT_EQ(cache.num_sequences(), 0);
}

TEST_F(ErrorsTest, NotFoundNamesTheField) {
  EXPECT_ERROR(client().GetCache("nope"), Code::kNotFound, "name");
  EXPECT_ERROR(client().DeleteCache("nope"), Code::kNotFound, "name");
  EXPECT_ERROR(client().Plan(MakePlan("nope", {{1, 1}})), Code::kNotFound, "cache");
  attnd::v1::ForwardRequest forward;
  forward.set_step_id(987654321);
  EXPECT_ERROR(client().Forward(forward), Code::kNotFound, "step_id");
  EXPECT_ERROR(client().EndStep(987654321, false), Code::kNotFound, "step_id");

  ASSERT_OK(client().CreateCache("c", SmallConfig()));
  const std::vector<uint64_t> ids = {42};
  EXPECT_ERROR(client().FreeSequences("c", ids), Code::kNotFound, "sequence_ids");
  EXPECT_ERROR(client().FreeSequences("nope", ids), Code::kNotFound, "cache");
}

TEST_F(ErrorsTest, AlreadyExistsNamesTheField) {
  ASSERT_OK(client().CreateCache("c", SmallConfig(8)));
  EXPECT_ERROR(client().CreateCache("c", SmallConfig(16)), Code::kAlreadyExists, "name");
  ASSERT_OK_AND_ASSIGN(auto cache, client().GetCache("c"));
  EXPECT_EQ(cache.num_pages(), 8) << "the existing cache is untouched";
}

TEST_F(ErrorsTest, ResourceExhaustedWhenThePoolCannotHoldTheStep) {
  ASSERT_OK(client().CreateCache("c", SmallConfig(4)));  // 16 token slots
  EXPECT_ERROR(client().Plan(MakePlan("c", {{1, 17}})), Code::kResourceExhausted, "entries");
  EXPECT_ERROR(client().CreateCache("huge", [] {
    attnd::v1::CacheConfig config = SmallConfig();
    config.set_num_pages(1 << 20);  // far beyond the 64 MiB budget
    return config;
  }()),
               Code::kResourceExhausted, "");
}

TEST_F(ErrorsTest, FailedPreconditionNamesTheField) {
  ASSERT_OK_AND_ASSIGN(auto cache, client().CreateCache("c", SmallConfig()));
  std::mt19937_64 rng(2);
  ASSERT_OK_AND_ASSIGN(auto step, client().BeginStep(MakePlan("c", {{1, 2}})));

  // A sequence is in one open step at a time.
  EXPECT_ERROR(client().Plan(MakePlan("c", {{1, 1}})), Code::kFailedPrecondition, "sequence_id");
  const std::vector<uint64_t> ids = {1};
  EXPECT_ERROR(client().FreeSequences("c", ids), Code::kFailedPrecondition, "sequence_ids");
  // Open steps block a plain delete.
  EXPECT_ERROR(client().DeleteCache("c"), Code::kFailedPrecondition, "force");

  // Each layer once.
  ASSERT_OK(step->Forward(RandomLayer(rng, cache.config(), 2, 0)));
  EXPECT_ERROR(step->Forward(RandomLayer(rng, cache.config(), 2, 0)), Code::kFailedPrecondition,
               "layer");
  ASSERT_OK(step->Forward(RandomLayer(rng, cache.config(), 2, 1)));
  // The step committed after its last layer; it takes no more forwards.
  attnd::v1::ForwardRequest late = RandomLayer(rng, cache.config(), 2, 0);
  late.set_step_id(step->id());
  EXPECT_ERROR(client().Forward(late), Code::kFailedPrecondition, "step_id");

  // External-table caches have no server-owned sequences to free.
  attnd::v1::CacheConfig external = SmallConfig();
  external.set_page_table_mode(attnd::v1::PAGE_TABLE_MODE_EXTERNAL);
  ASSERT_OK(client().CreateCache("ext", external));
  EXPECT_ERROR(client().FreeSequences("ext", ids), Code::kFailedPrecondition, "cache");
}

TEST_F(ErrorsTest, DeleteWithForceAbortsOpenSteps) {
  ASSERT_OK(client().CreateCache("c", SmallConfig()));
  ASSERT_OK_AND_ASSIGN(auto plan, client().Plan(MakePlan("c", {{1, 2}})));
  ASSERT_OK(client().DeleteCache("c", /*force=*/true));
  EXPECT_EQ(client().GetCache("c").status().code(), Code::kNotFound);
  auto ended = client().EndStep(plan.step_id(), false);
  if (ended.ok()) {
    EXPECT_EQ(ended->outcome(), attnd::v1::STEP_OUTCOME_ABORTED);
  } else {
    EXPECT_EQ(ended.status().code(), Code::kNotFound) << ended.status();
  }
}

}  // namespace
}  // namespace attnd::integration
