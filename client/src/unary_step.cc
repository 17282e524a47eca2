#include "unary_step.h"

#include <memory>
#include <utility>

#include "attnd/client/status.h"

namespace attnd::client {

UnaryStep::UnaryStep(attnd::v1::PlanResponse plan, Client* client)
    : Step(std::move(plan)), client_(client) {}

UnaryStep::~UnaryStep() { AbortIfOpen(); }

void UnaryStep::StartForward(attnd::v1::ForwardRequest request, ForwardCallback done) {
  // The callback API keeps a handler thread free while the server computes; the call's
  // context and messages live until its completion runs.
  struct Call {
    std::unique_ptr<grpc::ClientContext> context;
    attnd::v1::ForwardRequest request;
    attnd::v1::ForwardResponse response;
    ForwardCallback done;
  };
  auto* call = new Call{client_->NewContext(), std::move(request), {}, std::move(done)};
  client_->stub().async()->Forward(call->context.get(), &call->request, &call->response,
                                   [call](grpc::Status status) {
                                     std::unique_ptr<Call> owned(call);
                                     if (status.ok()) {
                                       owned->done(std::move(owned->response));
                                     } else {
                                       owned->done(FromGrpcStatus(status));
                                     }
                                   });
}

absl::StatusOr<attnd::v1::EndStepResponse> UnaryStep::SendEndStep(bool abort) {
  return client_->EndStep(id(), abort);
}

}  // namespace attnd::client
