#include "stream_step.h"

#include <future>
#include <utility>

namespace attnd::client {

StreamStep::StreamStep(attnd::v1::PlanResponse plan, std::shared_ptr<StreamSession::Impl> session)
    : Step(std::move(plan)), session_(std::move(session)) {}

StreamStep::~StreamStep() { AbortIfOpen(); }

void StreamStep::StartForward(attnd::v1::ForwardRequest request, ForwardCallback done) {
  attnd::v1::StreamRequest message;
  *message.mutable_forward() = std::move(request);
  session_->SendAsync(std::move(message), [done = std::move(done)](StreamResult result) {
    done(TakeForward(std::move(result)));
  });
}

void StreamStep::StartForwardRaw(int32_t layer, const TensorView& q, const TensorView& k,
                                 const TensorView& v, const ForwardOutputBuffers& outputs,
                                 RawForwardCallback done) {
  session_->SendForwardRaw(id(), layer, q, k, v, outputs, std::move(done));
}

absl::StatusOr<attnd::v1::EndStepResponse> StreamStep::SendEndStep(bool abort) {
  attnd::v1::StreamRequest message;
  message.mutable_end_step()->set_step_id(id());
  message.mutable_end_step()->set_abort(abort);
  std::promise<StreamResult> promise;
  std::future<StreamResult> future = promise.get_future();
  session_->SendAsync(std::move(message), [&promise](StreamResult result) {
    promise.set_value(std::move(result));
  });
  return TakeEndStep(future.get());
}

}  // namespace attnd::client
