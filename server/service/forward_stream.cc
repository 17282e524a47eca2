// ForwardStream: Plan/Forward/EndStep as tagged messages on one bidirectional stream.
//
// Reads continue while fewer than max_stream_in_flight messages are being handled, so a
// client can pipeline layers; responses go out in completion order, one write at a time.
// A bad message gets a per-message error and the stream lives on. When the stream ends
// (client done, cancelled, or gone) every step it planned and did not end is aborted.
// The stream was authenticated when it opened; each message re-checks the token, so one
// revoked by a token-file reload gets UNAUTHENTICATED per message from then on.
//
// Messages are raw bytes. A forward in the usual encoding takes the hot path (forward_call.h):
// its tensors stay in the received slices until the backend copies them into pinned staging,
// and its reply's o is sent from the backend's pinned buffer. Everything else (plan, end_step,
// unusual encodings) is parsed and answered with protobuf.
//
// gRPC may run a reaction inline inside StartRead/StartWrite/Finish, so those are only
// called with no lock held; decisions are made under the lock and acted on after it.
#include <chrono>
#include <memory>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "service/attention_service.h"
#include "service/convert.h"
#include "service/forward_call.h"

namespace attnd {
namespace {

using Clock = std::chrono::steady_clock;

double SecondsSince(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// A FIFO of calls whose storage is reused (std::deque would allocate as it cycles).
class CallQueue {
 public:
  bool empty() const { return size_ == 0; }
  ForwardCall* front() const { return ring_[head_]; }
  void push_back(ForwardCall* call) {
    if (size_ == ring_.size()) Grow();
    ring_[(head_ + size_) % ring_.size()] = call;
    ++size_;
  }
  ForwardCall* pop_front() {
    ForwardCall* call = ring_[head_];
    head_ = (head_ + 1) % ring_.size();
    --size_;
    return call;
  }

 private:
  void Grow() {
    std::vector<ForwardCall*> grown(std::max<size_t>(16, ring_.size() * 2));
    for (size_t i = 0; i < size_; ++i) grown[i] = ring_[(head_ + i) % ring_.size()];
    ring_.swap(grown);
    head_ = 0;
  }
  std::vector<ForwardCall*> ring_;
  size_t head_ = 0;
  size_t size_ = 0;
};

class ForwardStreamReactor final
    : public grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  ForwardStreamReactor(const ServiceContext& context, uint64_t owner, Tenant tenant,
                       std::string token)
      : context_(context), owner_(owner), tenant_(std::move(tenant)), token_(std::move(token)) {
    StartRead(&incoming_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {
      // The client half-closed (or went away): finish once what is in flight is answered.
      Act(Decide([&] { reads_done_ = true; }));
      return;
    }
    ForwardCall* call = calls_.Take();
    call->start = Clock::now();
    if (context_.trace_sink != nullptr) call->trace.Mark(LayerTrace::kReceived);
    call->request.Swap(&incoming_);
    {
      absl::MutexLock lock(&mu_);
      ++pending_;
    }
    Handle(call);
    Act(Decide([&] {
      if (pending_ < context_.limits.max_stream_in_flight) {
        read_due_ = true;
      } else {
        read_paused_ = true;
      }
    }));
  }

  void OnWriteDone(bool ok) override {
    ForwardCall* written = nullptr;
    Actions actions = Decide([&] {
      writing_ = false;
      if (!ok) {
        // The client is gone; drop what is queued. OnDone follows.
        while (!queue_.empty()) calls_.Return(queue_.pop_front());
        broken_ = true;
        return;
      }
      written = queue_.pop_front();
    });
    if (written != nullptr) {
      written->Mark(LayerTrace::kWritten);
      written->RecordTrace();
      calls_.Return(written);  // releases the reply's slices, and with them the lent output
    }
    Act(actions);
  }

  void OnCancel() override { context_.engine->AbortOwnedSteps(owner_); }

  void OnDone() override {
    context_.engine->AbortOwnedSteps(owner_);
    bool last;
    {
      absl::MutexLock lock(&mu_);
      done_ = true;
      last = pending_ == 0;
    }
    if (last) delete this;
  }

 private:
  // What to do after a state change, computed under the lock.
  struct Actions {
    bool start_read = false;
    ForwardCall* start_write = nullptr;
    bool finish = false;
  };

  template <typename Change>
  Actions Decide(Change&& change) {
    absl::MutexLock lock(&mu_);
    change();
    return NextActionsLocked();
  }

  Actions NextActionsLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    Actions actions;
    if (finished_ || done_) return actions;
    if (read_due_ && !reads_done_ && !broken_) {
      actions.start_read = true;
    }
    read_due_ = false;
    if (!writing_ && !queue_.empty() && !broken_) {
      writing_ = true;
      actions.start_write = queue_.front();
    }
    if ((reads_done_ || broken_) && pending_ == 0 && !writing_ && (queue_.empty() || broken_)) {
      finished_ = true;
      actions.finish = true;
    }
    return actions;
  }

  void Act(const Actions& actions) {
    if (actions.start_read) StartRead(&incoming_);
    // The call stays at the queue's front while its write is outstanding: only OnWriteDone
    // pops it.
    if (actions.start_write != nullptr) {
      actions.start_write->Mark(LayerTrace::kWriteStarted);
      StartWrite(&actions.start_write->response);
    }
    if (actions.finish) Finish(broken_ ? grpc::Status::CANCELLED : grpc::Status::OK);
  }

  // Queues a call's reply (unless the stream is over) and releases its request slot.
  void Respond(ForwardCall* call) {
    bool last = false;
    bool drop = false;
    Actions actions;
    {
      absl::MutexLock lock(&mu_);
      --pending_;
      if (done_) {
        last = pending_ == 0;
        drop = true;
      } else {
        if (!finished_ && !broken_) {
          queue_.push_back(call);
        } else {
          drop = true;
        }
        if (read_paused_ && pending_ < context_.limits.max_stream_in_flight) {
          read_paused_ = false;
          read_due_ = true;
        }
        actions = NextActionsLocked();
      }
    }
    if (drop) calls_.Return(call);
    if (last) {
      delete this;
      return;
    }
    Act(actions);
  }

  void Observe(std::string_view method, const absl::Status& status, ForwardCall* call) {
    if (context_.metrics) {
      context_.metrics->ObserveRpc(method, status.code(), SecondsSince(call->start));
    }
  }

  // A typed reply (plan, end_step, a slow-path forward, or any error) into call->response.
  void RespondWith(ForwardCall* call, std::string_view method, absl::Status status,
                   v1::StreamResponse& response) {
    Observe(method, status, call);
    response.set_tag(call->tag);
    if (!status.ok()) {
      response.clear_response();
      response.mutable_error()->set_code(static_cast<int>(status.code()));
      response.mutable_error()->set_message(std::string(status.message()));
    }
    bool own_buffer = false;
    call->response.Clear();
    (void)grpc::SerializationTraits<v1::StreamResponse>::Serialize(response, &call->response,
                                                                  &own_buffer);
    Respond(call);
  }

  void RespondError(ForwardCall* call, std::string_view method, absl::Status status) {
    v1::StreamResponse response;
    RespondWith(call, method, std::move(status), response);
  }

  // The hot path's completion (ForwardCall::on_done).
  static void ForwardDone(void* owner, ForwardCall* call, absl::Status status) {
    auto* self = static_cast<ForwardStreamReactor*>(owner);
    if (!status.ok()) {
      self->RespondError(call, "ForwardStream.Forward", std::move(status));
      return;
    }
    self->Observe("ForwardStream.Forward", status, call);
    self->Respond(call);
  }

  void Handle(ForwardCall* call) {
    call->TakeSlices();
    const bool fast =
        wire::DecodeStreamRequest(call->slices, call->tag, call->wire) == wire::Decoded::kForward;
    // Plan, EndStep and the forwards the codec declined go through protobuf; parsed
    // first, so that even a refusal carries the message's tag.
    std::shared_ptr<v1::StreamRequest> typed;
    if (!fast) {
      typed = std::make_shared<v1::StreamRequest>();
      grpc::ByteBuffer bytes(call->request);  // shares the slices
      if (!grpc::SerializationTraits<v1::StreamRequest>::Deserialize(&bytes, typed.get()).ok()) {
        call->tag = 0;
        RespondError(call, "ForwardStream",
                     absl::InvalidArgumentError("request: not a valid attnd.v1.StreamRequest"));
        return;
      }
      call->tag = typed->tag();
    }
    if (context_.auth->enabled()) {
      const absl::StatusOr<Tenant> current = context_.auth->AuthenticateToken(token_);
      if (!current.ok() || current->name != tenant_.name) {
        RespondError(call, "ForwardStream",
                     current.ok() ? absl::UnauthenticatedError(
                                        "authorization: the token now names another tenant")
                                  : current.status());
        return;
      }
    }
    if (fast) {
      call->tenant = tenant_;
      call->trace_sink = context_.trace_sink;  // only forwards on the hot path are traced
      call->stream = true;
      call->metrics = context_.metrics;
      call->owner = this;
      call->on_done = &ForwardDone;
      RunForward(context_, call);
      return;
    }
    HandleTyped(call, std::move(typed));
  }

  void HandleTyped(ForwardCall* call, std::shared_ptr<v1::StreamRequest> request) {
    switch (request->request_case()) {
      case v1::StreamRequest::kPlan: {
        v1::StreamResponse response;
        const absl::Status status =
            HandlePlan(context_, tenant_, request->plan(), owner_, response.mutable_plan());
        RespondWith(call, "ForwardStream.Plan", status, response);
        return;
      }
      case v1::StreamRequest::kForward: {
        auto response = std::make_shared<v1::StreamResponse>();
        HandleForward(context_, tenant_, request->forward(), response->mutable_forward(),
                      [this, call, request, response](absl::Status status) {
                        RespondWith(call, "ForwardStream.Forward", status, *response);
                      });
        return;
      }
      case v1::StreamRequest::kEndStep: {
        auto response = std::make_shared<v1::StreamResponse>();
        HandleEndStep(context_, tenant_, request->end_step(), response->mutable_end_step(),
                      [this, call, response](absl::Status status) {
                        RespondWith(call, "ForwardStream.EndStep", status, *response);
                      });
        return;
      }
      default:
        RespondError(call, "ForwardStream",
                     absl::InvalidArgumentError("request: expected one of plan, forward, end_step"));
        return;
    }
  }

  const ServiceContext& context_;
  const uint64_t owner_;
  const Tenant tenant_;
  const std::string token_;  // as presented; re-checked per message
  grpc::ByteBuffer incoming_;  // only touched by the single outstanding read
  ForwardCallPool calls_;

  absl::Mutex mu_;
  CallQueue queue_ ABSL_GUARDED_BY(mu_);  // replies to write, in completion order
  int32_t pending_ ABSL_GUARDED_BY(mu_) = 0;  // messages read and not yet answered
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool read_due_ ABSL_GUARDED_BY(mu_) = false;
  bool read_paused_ ABSL_GUARDED_BY(mu_) = false;
  bool reads_done_ ABSL_GUARDED_BY(mu_) = false;
  bool broken_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  bool done_ ABSL_GUARDED_BY(mu_) = false;
};

// Finishes at once; no read or write ever starts.
class RejectedStreamReactor final
    : public grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  explicit RejectedStreamReactor(const grpc::Status& status) { Finish(status); }
  void OnDone() override { delete this; }
};

}  // namespace

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* NewForwardStreamReactor(
    const ServiceContext& context, uint64_t owner, Tenant tenant, std::string token) {
  return new ForwardStreamReactor(context, owner, std::move(tenant), std::move(token));
}

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* NewRejectedStreamReactor(
    const grpc::Status& status) {
  return new RejectedStreamReactor(status);
}

}  // namespace attnd
