// A step handle: Plan once, Forward every layer, then the step commits (after its last layer
// or on End) or rolls back (Abort).
//
// The same interface runs over unary RPCs (Client::BeginStep) and over a ForwardStream
// (StreamSession::BeginStep). A Step destroyed while still open aborts it, so an early return
// or an exception on the client cannot leave half a step on the server.
//
// Thread-safety: ForwardAsync may be called from several threads and several forwards may be in
// flight; End/Abort should not race with Forward calls of the same step (the server would then
// decide which came first). The Client or StreamSession that made the step must outlive it.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <future>
#include <memory>
#include <span>

#include "absl/status/statusor.h"
#include "attnd/v1/attnd.pb.h"

namespace attnd::client {

using ForwardResult = absl::StatusOr<attnd::v1::ForwardResponse>;
using ForwardCallback = std::function<void(ForwardResult)>;

// A tensor sent from the caller's memory: raw little-endian elements, row-major (as
// attnd.v1.Tensor.data). The shape is read while the call is sent; the bytes are referenced,
// not copied, until the call's callback runs.
struct TensorView {
  attnd::v1::DType dtype = attnd::v1::DTYPE_BFLOAT16;
  std::span<const int64_t> shape;
  std::span<const uint8_t> bytes;
};

// Where a zero-copy Forward's outputs land: o ([num_tokens, num_qo_heads, head_dim], q_dtype)
// exactly, and lse ([num_tokens, num_qo_heads] float) when the plan returns it.
struct ForwardOutputBuffers {
  std::span<uint8_t> o;
  std::span<float> lse;
};

struct ForwardOutcome {
  bool step_committed = false;  // this layer was the step's last and the step committed
};
using RawForwardCallback = std::function<void(absl::StatusOr<ForwardOutcome>)>;

class Step {
 public:
  Step(const Step&) = delete;
  Step& operator=(const Step&) = delete;
  virtual ~Step() = default;

  uint64_t id() const { return plan_.step_id(); }
  // The server's answer to the plan: per-entry start positions and row offsets, the row count
  // of every layer's q/k/v/o, and the kernel chosen.
  const attnd::v1::PlanResponse& plan() const { return plan_; }
  int64_t num_tokens() const { return plan_.num_tokens(); }
  // True until the step committed (a Forward said so, or End) or was aborted.
  bool open() const { return !state_->finished.load(); }

  // MHA/GQA: q [num_tokens, num_qo_heads, head_dim], k and v [num_tokens, num_kv_heads,
  // head_dim], all in the cache's q_dtype. Returns o (and lse when the plan asked for it).
  ForwardResult Forward(int32_t layer, attnd::v1::Tensor q, attnd::v1::Tensor k,
                        attnd::v1::Tensor v);
  // Any Forward (MLA included); step_id is filled in.
  ForwardResult Forward(attnd::v1::ForwardRequest request);
  // Sends without waiting; the future resolves when the response (or error) arrives.
  std::future<ForwardResult> ForwardAsync(attnd::v1::ForwardRequest request);
  // Sends without waiting; `done` runs on a client thread when the answer arrives. It must not
  // block on other calls of the same stream or client.
  void ForwardAsync(attnd::v1::ForwardRequest request, ForwardCallback done);

  // Zero-copy Forward: q/k/v go out from the caller's memory and o/lse come back straight into
  // `outputs` (one copy, out of the received message); the memory of both must stay valid and
  // untouched until `done` runs (on a client thread). Blocks while a stream's window is full.
  void ForwardRaw(int32_t layer, const TensorView& q, const TensorView& k, const TensorView& v,
                  const ForwardOutputBuffers& outputs, RawForwardCallback done);

  // Commits the step now (layers not run keep unwritten slots).
  absl::StatusOr<attnd::v1::EndStepResponse> End();
  // Rolls the step back: lengths restored, fresh pages freed.
  absl::StatusOr<attnd::v1::EndStepResponse> Abort();

 protected:
  explicit Step(attnd::v1::PlanResponse plan);

  // Transport hooks. `done` may run on any thread, after the Step is gone.
  virtual void StartForward(attnd::v1::ForwardRequest request, ForwardCallback done) = 0;
  virtual absl::StatusOr<attnd::v1::EndStepResponse> SendEndStep(bool abort) = 0;
  virtual void StartForwardRaw(int32_t layer, const TensorView& q, const TensorView& k,
                               const TensorView& v, const ForwardOutputBuffers& outputs,
                               RawForwardCallback done) = 0;

  // For derived destructors (the base one cannot reach the transport): aborts if still open,
  // ignoring the result.
  void AbortIfOpen();

 private:
  // Shared with in-flight forwards' callbacks, which may outlive the Step.
  struct State {
    std::atomic<bool> finished{false};
  };

  attnd::v1::PlanResponse plan_;
  std::shared_ptr<State> state_ = std::make_shared<State>();
};

}  // namespace attnd::client
