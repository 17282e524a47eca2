// ForwardStream: Plan/Forward/EndStep as tagged messages on one bidirectional stream.
//
// Reads continue while fewer than max_stream_in_flight messages are being handled, so a
// client can pipeline layers; responses go out in completion order, one write at a time.
// A bad message gets a per-message error and the stream lives on. When the stream ends
// (client done, cancelled, or gone) every step it planned and did not end is aborted.
// The stream was authenticated when it opened; each message re-checks the token, so one
// revoked by a token-file reload gets UNAUTHENTICATED per message from then on.
//
// gRPC may run a reaction inline inside StartRead/StartWrite/Finish, so those are only
// called with no lock held; decisions are made under the lock and acted on after it.
#include <chrono>
#include <deque>
#include <memory>

#include "absl/synchronization/mutex.h"
#include "service/attention_service.h"
#include "service/convert.h"

namespace attnd {
namespace {

using Clock = std::chrono::steady_clock;

class ForwardStreamReactor final
    : public grpc::ServerBidiReactor<v1::StreamRequest, v1::StreamResponse> {
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
    auto request = std::make_shared<v1::StreamRequest>(std::move(incoming_));
    incoming_.Clear();
    {
      absl::MutexLock lock(&mu_);
      ++pending_;
    }
    Handle(std::move(request));
    Act(Decide([&] {
      if (pending_ < context_.limits.max_stream_in_flight) {
        read_due_ = true;
      } else {
        read_paused_ = true;
      }
    }));
  }

  void OnWriteDone(bool ok) override {
    Act(Decide([&] {
      writing_ = false;
      if (!ok) {
        // The client is gone; drop what is queued. OnDone follows.
        queue_.clear();
        broken_ = true;
        return;
      }
      queue_.pop_front();
    }));
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
    bool start_write = false;
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
      actions.start_write = true;
    }
    if ((reads_done_ || broken_) && pending_ == 0 && !writing_ && (queue_.empty() || broken_)) {
      finished_ = true;
      actions.finish = true;
    }
    return actions;
  }

  void Act(const Actions& actions) {
    if (actions.start_read) StartRead(&incoming_);
    // queue_.front() stays put while a write is outstanding: only OnWriteDone pops it.
    if (actions.start_write) StartWrite(&queue_.front());
    if (actions.finish) Finish(broken_ ? grpc::Status::CANCELLED : grpc::Status::OK);
  }

  // Queues a response (unless the stream is over) and releases the request's slot.
  void Respond(v1::StreamResponse response) {
    bool last = false;
    Actions actions;
    {
      absl::MutexLock lock(&mu_);
      --pending_;
      if (done_) {
        last = pending_ == 0;
      } else {
        if (!finished_ && !broken_) queue_.push_back(std::move(response));
        if (read_paused_ && pending_ < context_.limits.max_stream_in_flight) {
          read_paused_ = false;
          read_due_ = true;
        }
        actions = NextActionsLocked();
      }
    }
    if (last) {
      delete this;
      return;
    }
    Act(actions);
  }

  void Handle(std::shared_ptr<v1::StreamRequest> request) {
    const uint64_t tag = request->tag();
    const auto start = Clock::now();
    auto respond = [this, tag, start](std::string_view method, absl::Status status,
                                      v1::StreamResponse response) {
      if (context_.metrics) {
        context_.metrics->ObserveRpc(method, status.code(),
                                     std::chrono::duration<double>(Clock::now() - start).count());
      }
      response.set_tag(tag);
      if (!status.ok()) {
        response.clear_response();
        response.mutable_error()->set_code(static_cast<int>(status.code()));
        response.mutable_error()->set_message(std::string(status.message()));
      }
      Respond(std::move(response));
    };
    if (context_.auth->enabled()) {
      const absl::StatusOr<Tenant> current = context_.auth->AuthenticateToken(token_);
      if (!current.ok() || current->name != tenant_.name) {
        respond("ForwardStream",
                current.ok() ? absl::UnauthenticatedError(
                                   "authorization: the token now names another tenant")
                             : current.status(),
                v1::StreamResponse());
        return;
      }
    }
    switch (request->request_case()) {
      case v1::StreamRequest::kPlan: {
        v1::StreamResponse response;
        const absl::Status status =
            HandlePlan(context_, tenant_, request->plan(), owner_, response.mutable_plan());
        respond("ForwardStream.Plan", status, std::move(response));
        return;
      }
      case v1::StreamRequest::kForward: {
        auto response = std::make_shared<v1::StreamResponse>();
        HandleForward(context_, tenant_, request->forward(), response->mutable_forward(),
                      [request, response, respond](absl::Status status) {
                        respond("ForwardStream.Forward", status, std::move(*response));
                      });
        return;
      }
      case v1::StreamRequest::kEndStep: {
        auto response = std::make_shared<v1::StreamResponse>();
        HandleEndStep(context_, tenant_, request->end_step(), response->mutable_end_step(),
                      [response, respond](absl::Status status) {
                        respond("ForwardStream.EndStep", status, std::move(*response));
                      });
        return;
      }
      default:
        respond("ForwardStream", absl::InvalidArgumentError(
                                     "request: expected one of plan, forward, end_step"),
                v1::StreamResponse());
        return;
    }
  }

  const ServiceContext& context_;
  const uint64_t owner_;
  const Tenant tenant_;
  const std::string token_;  // as presented; re-checked per message
  v1::StreamRequest incoming_;  // only touched by the single outstanding read

  absl::Mutex mu_;
  std::deque<v1::StreamResponse> queue_ ABSL_GUARDED_BY(mu_);
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
    : public grpc::ServerBidiReactor<v1::StreamRequest, v1::StreamResponse> {
 public:
  explicit RejectedStreamReactor(const grpc::Status& status) { Finish(status); }
  void OnDone() override { delete this; }
};

}  // namespace

grpc::ServerBidiReactor<v1::StreamRequest, v1::StreamResponse>* NewForwardStreamReactor(
    const ServiceContext& context, uint64_t owner, Tenant tenant, std::string token) {
  return new ForwardStreamReactor(context, owner, std::move(tenant), std::move(token));
}

grpc::ServerBidiReactor<v1::StreamRequest, v1::StreamResponse>* NewRejectedStreamReactor(
    const grpc::Status& status) {
  return new RejectedStreamReactor(status);
}

}  // namespace attnd
