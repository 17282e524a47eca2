// Zero-copy forwards (Step::ForwardRaw): q/k/v sent from the caller's memory and o/lse read
// straight into the caller's buffers, over a stream and over unary calls, give exactly what the
// typed Forward gives for the same inputs, and match the reference.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <future>
#include <random>

#include "status_matchers.h"
#include "test_server.h"
#include "test_steps.h"

namespace attnd::integration {
namespace {

using RawForwardTest = IntegrationTest;

client::TensorView View(const attnd::v1::Tensor& tensor, std::vector<int64_t>& shape) {
  shape.assign(tensor.shape().begin(), tensor.shape().end());
  client::TensorView view;
  view.dtype = tensor.dtype();
  view.shape = shape;
  view.bytes = {reinterpret_cast<const uint8_t*>(tensor.data().data()), tensor.data().size()};
  return view;
}

// Runs layer `request` on `step` zero-copy and returns the answer as a ForwardResponse.
absl::StatusOr<attnd::v1::ForwardResponse> ForwardRawSync(client::Step& step,
                                                          const attnd::v1::ForwardRequest& request,
                                                          int64_t lse_count) {
  std::vector<int64_t> q_shape, k_shape, v_shape;
  std::string o(request.q().data().size(), '\xee');  // poisoned: every byte must be written
  std::vector<float> lse(lse_count, -7.0f);
  client::ForwardOutputBuffers outputs;
  outputs.o = {reinterpret_cast<uint8_t*>(o.data()), o.size()};
  outputs.lse = lse;
  std::promise<absl::StatusOr<client::ForwardOutcome>> promise;
  step.ForwardRaw(request.layer(), View(request.q(), q_shape), View(request.k(), k_shape),
                  View(request.v(), v_shape), outputs,
                  [&](absl::StatusOr<client::ForwardOutcome> outcome) {
                    promise.set_value(std::move(outcome));
                  });
  absl::StatusOr<client::ForwardOutcome> outcome = promise.get_future().get();
  if (!outcome.ok()) return outcome.status();
  attnd::v1::ForwardResponse response;
  response.mutable_o()->set_dtype(request.q().dtype());
  *response.mutable_o()->mutable_shape() = request.q().shape();
  response.mutable_o()->set_data(o);
  if (lse_count > 0) {
    response.mutable_lse()->set_dtype(attnd::v1::DTYPE_FLOAT32);
    response.mutable_lse()->add_shape(request.q().shape(0));
    response.mutable_lse()->add_shape(request.q().shape(1));
    response.mutable_lse()->set_data(
        std::string(reinterpret_cast<const char*>(lse.data()), lse.size() * sizeof(float)));
  }
  response.set_step_committed(outcome->step_committed);
  return response;
}

TEST_F(RawForwardTest, MatchesTheTypedForwardAndTheReference) {
  for (bool stream : {false, true}) {
    SCOPED_TRACE(stream ? "stream" : "unary");
    const std::string name = stream ? "raw-stream" : "raw-unary";
    ASSERT_OK_AND_ASSIGN(auto cache, client().CreateCache(name, SmallConfig()));
    ASSERT_OK_AND_ASSIGN(auto reference, client::ReferenceCache::Create(cache.config()));
    std::unique_ptr<client::StreamSession> session;
    if (stream) {
      ASSERT_OK_AND_ASSIGN(session, client().OpenStream({.window = 4}));
    }
    std::mt19937_64 rng(7);
    const int32_t layers = cache.config().num_layers();
    for (const Entries& entries : {Entries{{1, 5}, {2, 3}}, Entries{{1, 1}, {0, 0}, {2, 1}}}) {
      const auto plan = MakePlan(name, entries, /*return_lse=*/true);
      ASSERT_OK_AND_ASSIGN(auto step, stream ? session->BeginStep(plan) : client().BeginStep(plan));
      ASSERT_OK(reference->BeginStep(plan));
      const int64_t rows = step->num_tokens();
      for (int32_t layer = 0; layer < layers; ++layer) {
        const attnd::v1::ForwardRequest request =
            RandomLayer(rng, cache.config(), rows, layer);
        ASSERT_OK_AND_ASSIGN(auto raw,
                             ForwardRawSync(*step, request, rows * cache.config().num_qo_heads()));
        ASSERT_OK_AND_ASSIGN(auto expected, reference->Forward(request));
        ExpectMatchesReference(raw, expected, DType::kBFloat16,
                               absl::StrCat(name, " layer ", layer));
        EXPECT_EQ(raw.step_committed(), layer == layers - 1);
      }
      reference->EndStep(/*abort=*/false);
    }
    // Outputs of the wrong size are an error of that call only.
    const auto plan = MakePlan(name, Entries{{1, 1}});
    ASSERT_OK_AND_ASSIGN(auto step, stream ? session->BeginStep(plan) : client().BeginStep(plan));
    attnd::v1::ForwardRequest request = RandomLayer(rng, cache.config(), 1, 0);
    std::vector<int64_t> q_shape, k_shape, v_shape;
    std::vector<uint8_t> small(8);
    client::ForwardOutputBuffers outputs;
    outputs.o = small;
    std::promise<absl::Status> done;
    step->ForwardRaw(0, View(request.q(), q_shape), View(request.k(), k_shape),
                     View(request.v(), v_shape), outputs,
                     [&](absl::StatusOr<client::ForwardOutcome> outcome) {
                       done.set_value(outcome.status());
                     });
    EXPECT_EQ(done.get_future().get().code(), absl::StatusCode::kInvalidArgument);
    ASSERT_OK(step->Abort());
    if (session) ASSERT_OK(session->Close());
  }
}

}  // namespace
}  // namespace attnd::integration
