// A Step over the unary Forward and EndStep RPCs.
#pragma once

#include "attnd/client/client.h"
#include "attnd/client/step.h"

namespace attnd::client {

class UnaryStep final : public Step {
 public:
  // `client` must outlive the step.
  UnaryStep(attnd::v1::PlanResponse plan, Client* client);
  ~UnaryStep() override;

 protected:
  void StartForward(attnd::v1::ForwardRequest request, ForwardCallback done) override;
  absl::StatusOr<attnd::v1::EndStepResponse> SendEndStep(bool abort) override;
  void StartForwardRaw(int32_t layer, const TensorView& q, const TensorView& k,
                       const TensorView& v, const ForwardOutputBuffers& outputs,
                       RawForwardCallback done) override;

 private:
  Client* client_;
};

}  // namespace attnd::client
