// A Step whose messages travel on a ForwardStream.
#pragma once

#include <memory>

#include "attnd/client/step.h"
#include "stream_session_impl.h"

namespace attnd::client {

class StreamStep final : public Step {
 public:
  StreamStep(attnd::v1::PlanResponse plan, std::shared_ptr<StreamSession::Impl> session);
  ~StreamStep() override;

 protected:
  void StartForward(attnd::v1::ForwardRequest request, ForwardCallback done) override;
  absl::StatusOr<attnd::v1::EndStepResponse> SendEndStep(bool abort) override;
  void StartForwardRaw(int32_t layer, const TensorView& q, const TensorView& k,
                       const TensorView& v, const ForwardOutputBuffers& outputs,
                       RawForwardCallback done) override;

 private:
  std::shared_ptr<StreamSession::Impl> session_;
};

}  // namespace attnd::client
