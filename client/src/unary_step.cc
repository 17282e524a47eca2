#include "unary_step.h"

#include <memory>
#include <utility>

#include "attnd/client/status.h"
#include "forward_wire.h"

#include <grpcpp/generic/generic_stub.h>

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

void UnaryStep::StartForwardRaw(int32_t layer, const TensorView& q, const TensorView& k,
                                const TensorView& v, const ForwardOutputBuffers& outputs,
                                RawForwardCallback done) {
  // The request's tensors are the caller's memory (kept until `done`); the reply is read
  // straight into `outputs`.
  struct Call {
    std::unique_ptr<grpc::ClientContext> context;
    grpc::ByteBuffer request;
    grpc::ByteBuffer response;
    ForwardOutputBuffers outputs;
    RawForwardCallback done;
  };
  auto* call = new Call{client_->NewContext(),
                        EncodeForwardRequest(/*stream=*/false, 0, id(), layer, q, k, v),
                        {},
                        outputs,
                        std::move(done)};
  grpc::GenericStub stub(client_->channel());
  stub.UnaryCall(call->context.get(), "/attnd.v1.AttentionService/Forward", grpc::StubOptions(),
                 &call->request, &call->response, [call](grpc::Status status) {
                   std::unique_ptr<Call> owned(call);
                   if (!status.ok()) {
                     owned->done(FromGrpcStatus(status));
                     return;
                   }
                   owned->done(DecodeForwardResponse(owned->response, owned->outputs));
                 });
}

absl::StatusOr<attnd::v1::EndStepResponse> UnaryStep::SendEndStep(bool abort) {
  return client_->EndStep(id(), abort);
}

}  // namespace attnd::client
