#include "attnd/client/stream_session.h"

#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "attnd/client/status.h"
#include "stream_session_impl.h"
#include "stream_step.h"

namespace attnd::client {

// ---- Impl -------------------------------------------------------------------------------------

StreamSession::Impl::Impl(attnd::v1::AttentionService::Stub& stub,
                          std::unique_ptr<grpc::ClientContext> context, StreamOptions options)
    : options_(options), context_(std::move(context)) {
  stream_ = stub.ForwardStream(context_.get());
  reader_ = std::thread([this] { ReadLoop(); });
}

StreamSession::Impl::~Impl() {
  bool done;
  {
    std::lock_guard lock(mu_);
    done = reader_done_;
  }
  if (!done) context_->TryCancel();
  JoinReader();
}

void StreamSession::Impl::JoinReader() {
  std::lock_guard lock(join_mu_);
  if (!reader_.joinable()) return;
  // The last owner may let go inside a callback, on the reader itself.
  if (reader_.get_id() == std::this_thread::get_id()) {
    reader_.detach();
  } else {
    reader_.join();
  }
}

void StreamSession::Impl::SendAsync(attnd::v1::StreamRequest request, Done done) {
  absl::Status refused;
  {
    std::unique_lock lock(mu_);
    const size_t window = options_.window < 1 ? 1 : static_cast<size_t>(options_.window);
    cv_.wait(lock, [&] { return pending_.size() < window || reader_done_ || closing_; });
    if (reader_done_) {
      refused = final_status_.ok() ? absl::UnavailableError("ForwardStream has ended")
                                   : final_status_;
    } else if (closing_) {
      refused = absl::FailedPreconditionError("ForwardStream is closed");
    } else {
      const uint64_t tag = next_tag_++;
      request.set_tag(tag);
      pending_.emplace(tag, std::move(done));
    }
  }
  if (!refused.ok()) {
    done(refused);
    return;
  }
  std::lock_guard write_lock(write_mu_);
  // A failed write means the call is over; the reader then fails this message with the call's
  // status, so nothing is lost here.
  if (!writes_done_) (void)stream_->Write(request);
}

void StreamSession::Impl::ReadLoop() {
  attnd::v1::StreamResponse response;
  while (stream_->Read(&response)) {
    Done done;
    {
      std::lock_guard lock(mu_);
      auto it = pending_.find(response.tag());
      if (it != pending_.end()) {
        done = std::move(it->second);
        pending_.erase(it);
      }
    }
    cv_.notify_all();
    // A tag we are not waiting for (a server bug) is dropped rather than misdelivered.
    if (done) {
      if (response.has_error()) {
        done(FromStreamError(response.error()));
      } else {
        done(std::move(response));
      }
    }
    response.Clear();
  }
  grpc::Status status;
  {
    std::lock_guard write_lock(write_mu_);
    status = stream_->Finish();
  }
  std::map<uint64_t, Done> orphans;
  absl::Status orphan_status;
  {
    std::lock_guard lock(mu_);
    reader_done_ = true;
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
    orphan_status = final_status_.ok()
                        ? absl::UnavailableError("ForwardStream ended before answering")
                        : final_status_;
  }
  cv_.notify_all();
  for (auto& [tag, done] : orphans) done(orphan_status);
}

absl::Status StreamSession::Impl::Close(absl::Duration grace) {
  {
    std::lock_guard lock(mu_);
    closing_ = true;
  }
  cv_.notify_all();
  {
    std::lock_guard write_lock(write_mu_);
    if (!writes_done_) {
      writes_done_ = true;
      (void)stream_->WritesDone();
    }
  }
  bool finished;
  {
    std::unique_lock lock(mu_);
    auto ended = [&] { return reader_done_; };
    if (grace == absl::InfiniteDuration()) {
      cv_.wait(lock, ended);
      finished = true;
    } else {
      finished = cv_.wait_for(lock, absl::ToChronoMilliseconds(grace), ended);
    }
  }
  if (!finished) context_->TryCancel();
  JoinReader();
  std::lock_guard lock(mu_);
  if (!finished) {
    return absl::DeadlineExceededError(absl::StrCat(
        "ForwardStream: the server did not finish within ", absl::FormatDuration(grace),
        " of the client closing; cancelled"));
  }
  return final_status_;
}

void StreamSession::Impl::Cancel() {
  {
    std::lock_guard lock(mu_);
    cancelled_ = true;
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
