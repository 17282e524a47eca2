#include "attnd/client/stream_session.h"

#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "attnd/client/status.h"
#include "stream_session_impl.h"
#include "stream_step.h"
#include "forward_wire.h"

#include <grpcpp/generic/generic_stub.h>

namespace attnd::client {

// ---- Impl -------------------------------------------------------------------------------------

namespace {
constexpr char kForwardStreamMethod[] = "/attnd.v1.AttentionService/ForwardStream";
}  // namespace

StreamSession::Impl::Impl(std::unique_ptr<grpc::ClientContext> context, StreamOptions options)
    : options_(options), context_(std::move(context)) {}

std::shared_ptr<StreamSession::Impl> StreamSession::Impl::Start(
    const std::shared_ptr<grpc::Channel>& channel, std::unique_ptr<grpc::ClientContext> context,
    StreamOptions options) {
  auto impl = std::make_shared<Impl>(std::move(context), options);
  impl->self_ = impl;
  grpc::GenericStub stub(channel);
  stub.PrepareBidiStreamingCall(impl->context_.get(), kForwardStreamMethod, grpc::StubOptions(),
                                impl.get());
  // Held until the last write (WritesDone): OnDone cannot come while a write may still start.
  impl->AddHold();
  impl->StartRead(&impl->incoming_);
  impl->StartCall();
  return impl;
}

template <typename Encode>
bool StreamSession::Impl::Enqueue(Pending pending, Encode&& encode, absl::Status& refused) {
  Actions actions;
  {
    std::unique_lock lock(mu_);
    const size_t window = options_.window < 1 ? 1 : static_cast<size_t>(options_.window);
    cv_.wait(lock, [&] { return pending_.size() < window || done_ || closing_ || cancelled_; });
    if (cancelled_) {
      refused = absl::CancelledError("ForwardStream cancelled by the client");
    } else if (done_) {
      refused = final_status_.ok() ? absl::UnavailableError("ForwardStream has ended")
                                   : final_status_;
    } else if (closing_) {
      refused = absl::FailedPreconditionError("ForwardStream is closed");
    }
    if (!refused.ok()) return false;
    const uint64_t tag = next_tag_++;
    const bool raw = pending.raw != nullptr;
    pending_.emplace(tag, std::move(pending));
    writes_.push_back(Write{encode(tag), raw ? tag : 0});
    actions = NextActionsLocked();
  }
  Act(actions);
  return true;
}

StreamSession::Impl::Actions StreamSession::Impl::NextActionsLocked() {
  Actions actions;
  if (writing_ || hold_released_) return actions;
  // Once the call is over (a write failed, the server finished it) or abandoned, nothing more
  // goes out; what waits fails in OnDone.
  const bool over = broken_ || read_done_ || abandon_writes_;
  if (over) writes_.clear();
  if (!writes_.empty()) {
    writing_ = true;
    actions.write = &writes_.front().message;
  } else if (closing_ || over) {
    // No write can start any more: let the call end.
    hold_released_ = true;
    actions.writes_done = !over;
    actions.release_hold = true;
  }
  return actions;
}

void StreamSession::Impl::Act(const Actions& actions) {
  if (actions.write != nullptr) StartWrite(actions.write);
  if (actions.writes_done) StartWritesDone();
  if (actions.release_hold) RemoveHold();  // may end the call (OnDone) here; touch nothing after
}

std::function<void()> StreamSession::Impl::TakeDeliveryLocked(uint64_t tag) {
  auto it = pending_.find(tag);
  if (it == pending_.end() || !it->second.written || !it->second.answered) return nullptr;
  auto delivery = [done = std::move(it->second.raw), result = std::move(it->second.result)]() {
    done(result);
  };
  pending_.erase(it);
  cv_.notify_all();  // a window slot is free
  return delivery;
}

void StreamSession::Impl::SendAsync(attnd::v1::StreamRequest request, Done done) {
  Pending pending;
  pending.typed = done;
  absl::Status refused;
  const bool queued = Enqueue(std::move(pending), [&](uint64_t tag) {
    request.set_tag(tag);
    grpc::ByteBuffer message;
    bool own_buffer = false;
    (void)grpc::SerializationTraits<attnd::v1::StreamRequest>::Serialize(request, &message,
                                                                        &own_buffer);
    return message;
  }, refused);
  if (!queued) done(refused);
}

void StreamSession::Impl::SendForwardRaw(uint64_t step_id, int32_t layer, const TensorView& q,
                                         const TensorView& k, const TensorView& v,
                                         const ForwardOutputBuffers& outputs,
                                         RawForwardCallback done) {
  Pending pending;
  pending.raw = done;
  pending.outputs = outputs;
  absl::Status refused;
  const bool queued = Enqueue(std::move(pending), [&](uint64_t tag) {
    return EncodeForwardRequest(/*stream=*/true, tag, step_id, layer, q, k, v);
  }, refused);
  if (!queued) done(refused);
}

void StreamSession::Impl::OnWriteDone(bool ok) {
  std::function<void()> delivery;
  Actions actions;
  {
    std::lock_guard lock(mu_);
    writing_ = false;
    const uint64_t raw_tag = writes_.front().raw_tag;
    writes_.pop_front();
    if (!ok) broken_ = true;  // the call is over; OnDone fails what waits
    if (raw_tag != 0) {
      auto it = pending_.find(raw_tag);
      if (it != pending_.end()) it->second.written = true;
      delivery = TakeDeliveryLocked(raw_tag);
    }
    actions = NextActionsLocked();
  }
  if (delivery) delivery();
  Act(actions);
}

void StreamSession::Impl::OnReadDone(bool ok) {
  if (!ok) {
    // The server finished the call (or it broke): no reply will come.
    Actions actions;
    {
      std::lock_guard lock(mu_);
      read_done_ = true;
      actions = NextActionsLocked();
    }
    Act(actions);
    return;
  }
  StreamReply reply(incoming_);  // read once: the tag, then the payload
  const uint64_t tag = reply.tag();
  Done typed;
  bool raw = false;
  ForwardOutputBuffers outputs;
  {
    std::lock_guard lock(mu_);
    auto it = pending_.find(tag);
    if (it != pending_.end()) {
      if (it->second.raw != nullptr) {
        raw = true;
        outputs = it->second.outputs;
      } else {
        typed = std::move(it->second.typed);
        pending_.erase(it);
        cv_.notify_all();
      }
    }
  }
  // A tag we are not waiting for (a server bug) is dropped rather than misdelivered.
  if (raw) {
    // Straight from the received slices into the caller's buffers, outside the lock.
    absl::StatusOr<ForwardOutcome> result = reply.ForwardOutputs(outputs);
    std::function<void()> delivery;
    {
      std::lock_guard lock(mu_);
      auto it = pending_.find(tag);
      if (it != pending_.end()) {
        it->second.result = std::move(result);
        it->second.answered = true;
        delivery = TakeDeliveryLocked(tag);
      }
    }
    if (delivery) delivery();
  } else if (typed) {
    absl::StatusOr<attnd::v1::StreamResponse> response = reply.Parsed();
    if (!response.ok()) {
      typed(response.status());
    } else if (response->has_error()) {
      typed(FromStreamError(response->error()));
    } else {
      typed(*std::move(response));
    }
  }
  incoming_.Clear();
  StartRead(&incoming_);
}

void StreamSession::Impl::OnDone(const grpc::Status& status) {
  std::map<uint64_t, Pending> orphans;
  absl::Status orphan_status;
  {
    std::lock_guard lock(mu_);
    done_ = true;
    if (cancelled_) {
      final_status_ = absl::CancelledError("ForwardStream cancelled by the client");
    } else if (!status.ok()) {
      const absl::Status grpc_status = FromGrpcStatus(status);
      final_status_ = absl::Status(grpc_status.code(),
                                   absl::StrCat("ForwardStream ended: ", grpc_status.message()));
    } else {
      final_status_ = absl::OkStatus();
    }
    orphans.swap(pending_);
    writes_.clear();
    orphan_status = final_status_.ok()
                        ? absl::UnavailableError("ForwardStream ended before answering")
                        : final_status_;
    cv_.notify_all();  // under the lock: a waiter may destroy the session once it is released
  }
  for (auto& [tag, pending] : orphans) {
    if (pending.raw) {
      pending.raw(orphan_status);
    } else if (pending.typed) {
      pending.typed(orphan_status);
    }
  }
  // Last: may destroy the session.
  std::shared_ptr<Impl> self;
  {
    std::lock_guard lock(mu_);
    self = std::move(self_);
  }
}

absl::Status StreamSession::Impl::Close(absl::Duration grace) {
  Actions actions;
  {
    std::lock_guard lock(mu_);
    closing_ = true;
    cv_.notify_all();
    actions = NextActionsLocked();
  }
  Act(actions);
  bool finished;
  {
    std::unique_lock lock(mu_);
    auto ended = [&] { return done_; };
    if (grace == absl::InfiniteDuration()) {
      cv_.wait(lock, ended);
      finished = true;
    } else {
      finished = cv_.wait_for(lock, absl::ToChronoMilliseconds(grace), ended);
    }
  }
  if (finished) {
    std::lock_guard lock(mu_);
    return final_status_;
  }
  context_->TryCancel();
  {
    std::lock_guard lock(mu_);
    abandon_writes_ = true;
    actions = NextActionsLocked();
  }
  Act(actions);
  {
    std::unique_lock lock(mu_);
    cv_.wait(lock, [&] { return done_; });
  }
  return absl::DeadlineExceededError(absl::StrCat(
      "ForwardStream: the server did not finish within ", absl::FormatDuration(grace),
      " of the client closing; cancelled"));
}

void StreamSession::Impl::Cancel() {
  {
    std::lock_guard lock(mu_);
    cancelled_ = true;
    cv_.notify_all();
  }
  context_->TryCancel();
}

int StreamSession::Impl::in_flight() const {
  std::lock_guard lock(mu_);
  return static_cast<int>(pending_.size());
}

// ---- typed payloads ---------------------------------------------------------------------------

absl::StatusOr<attnd::v1::PlanResponse> TakePlan(StreamResult result) {
  if (!result.ok()) return result.status();
  if (!result->has_plan()) return absl::InternalError("stream response to a plan carries no plan");
  return std::move(*result->mutable_plan());
}

absl::StatusOr<attnd::v1::ForwardResponse> TakeForward(StreamResult result) {
  if (!result.ok()) return result.status();
  if (!result->has_forward()) {
    return absl::InternalError("stream response to a forward carries no forward");
  }
  return std::move(*result->mutable_forward());
}

absl::StatusOr<attnd::v1::EndStepResponse> TakeEndStep(StreamResult result) {
  if (!result.ok()) return result.status();
  if (!result->has_end_step()) {
    return absl::InternalError("stream response to an end_step carries no end_step");
  }
  return std::move(*result->mutable_end_step());
}

// ---- StreamSession ----------------------------------------------------------------------------

StreamSession::StreamSession(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}

StreamSession::~StreamSession() { (void)impl_->Close(absl::Seconds(10)); }

void StreamSession::SendAsync(attnd::v1::StreamRequest request,
                              std::function<void(StreamResult)> done) {
  impl_->SendAsync(std::move(request), std::move(done));
}

std::future<StreamResult> StreamSession::Send(attnd::v1::StreamRequest request) {
  auto promise = std::make_shared<std::promise<StreamResult>>();
  std::future<StreamResult> future = promise->get_future();
  impl_->SendAsync(std::move(request),
                   [promise](StreamResult result) { promise->set_value(std::move(result)); });
  return future;
}

absl::StatusOr<attnd::v1::PlanResponse> StreamSession::Plan(
    const attnd::v1::PlanRequest& request) {
  attnd::v1::StreamRequest message;
  *message.mutable_plan() = request;
  return TakePlan(Send(std::move(message)).get());
}

absl::StatusOr<attnd::v1::ForwardResponse> StreamSession::Forward(
    const attnd::v1::ForwardRequest& request) {
  attnd::v1::StreamRequest message;
  *message.mutable_forward() = request;
  return TakeForward(Send(std::move(message)).get());
}

absl::StatusOr<attnd::v1::EndStepResponse> StreamSession::EndStep(uint64_t step_id, bool abort) {
  attnd::v1::StreamRequest message;
  message.mutable_end_step()->set_step_id(step_id);
  message.mutable_end_step()->set_abort(abort);
  return TakeEndStep(Send(std::move(message)).get());
}

absl::StatusOr<std::unique_ptr<Step>> StreamSession::BeginStep(
    const attnd::v1::PlanRequest& request) {
  absl::StatusOr<attnd::v1::PlanResponse> plan = Plan(request);
  if (!plan.ok()) return plan.status();
  return std::unique_ptr<Step>(new StreamStep(*std::move(plan), impl_));
}

absl::Status StreamSession::Close(absl::Duration grace) { return impl_->Close(grace); }

void StreamSession::Cancel() { impl_->Cancel(); }

int StreamSession::in_flight() const { return impl_->in_flight(); }

}  // namespace attnd::client
