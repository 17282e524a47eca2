#include "attnd/client/step.h"

#include <utility>

namespace attnd::client {

Step::Step(attnd::v1::PlanResponse plan) : plan_(std::move(plan)) {}

ForwardResult Step::Forward(int32_t layer, attnd::v1::Tensor q, attnd::v1::Tensor k,
                            attnd::v1::Tensor v) {
  attnd::v1::ForwardRequest request;
  request.set_layer(layer);
  *request.mutable_q() = std::move(q);
  *request.mutable_k() = std::move(k);
  *request.mutable_v() = std::move(v);
  return Forward(std::move(request));
}

ForwardResult Step::Forward(attnd::v1::ForwardRequest request) {
  return ForwardAsync(std::move(request)).get();
}

std::future<ForwardResult> Step::ForwardAsync(attnd::v1::ForwardRequest request) {
  auto promise = std::make_shared<std::promise<ForwardResult>>();
  std::future<ForwardResult> future = promise->get_future();
  ForwardAsync(std::move(request),
               [promise](ForwardResult result) { promise->set_value(std::move(result)); });
  return future;
}

void Step::ForwardAsync(attnd::v1::ForwardRequest request, ForwardCallback done) {
  request.set_step_id(id());
  StartForward(std::move(request), [state = state_, done = std::move(done)](ForwardResult result) {
    if (result.ok() && result->step_committed()) state->finished.store(true);
    done(std::move(result));
  });
}

void Step::ForwardRaw(int32_t layer, const TensorView& q, const TensorView& k,
                      const TensorView& v, const ForwardOutputBuffers& outputs,
                      RawForwardCallback done) {
  StartForwardRaw(layer, q, k, v, outputs,
                  [state = state_, done = std::move(done)](absl::StatusOr<ForwardOutcome> result) {
                    if (result.ok() && result->step_committed) state->finished.store(true);
                    done(std::move(result));
                  });
}

absl::StatusOr<attnd::v1::EndStepResponse> Step::End() {
  auto result = SendEndStep(/*abort=*/false);
  state_->finished.store(true);
  return result;
}

absl::StatusOr<attnd::v1::EndStepResponse> Step::Abort() {
  // Marked finished whatever the answer: if the server did not hear us, the step's TTL (or the
  // stream's end) rolls it back, and a destructor retry would not do better.
  auto result = SendEndStep(/*abort=*/true);
  state_->finished.store(true);
  return result;
}

void Step::AbortIfOpen() {
  if (open()) (void)Abort();
}

}  // namespace attnd::client
