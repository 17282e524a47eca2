// OpenChannel and CloseChannel (DESIGN 3b). OpenChannel is a server-streaming call that lives
// as long as its channel: the first message carries the channel; the call's end (the client
// cancelling it, or its connection dropping) closes the channel, and a channel closed by the
// server (CloseChannel, DeleteCache, shutdown) ends the call with a last message naming why.
#include <atomic>
#include <memory>
#include <mutex>

#include "absl/strings/str_cat.h"
#include "service/attention_service.h"
#include "service/convert.h"

namespace attnd {
namespace {

// Finishes exactly once, from the engine's on_closed callback (which the engine runs exactly
// once whatever closes the channel), so OnDone, and the deletion, always come after it.
class OpenChannelReactor final : public grpc::ServerWriteReactor<v1::OpenChannelResponse> {
 public:
  OpenChannelReactor(const ServiceContext& context, Tenant tenant,
                     const v1::OpenChannelRequest& request)
      : context_(context), tenant_(std::move(tenant)) {
    absl::StatusOr<ChannelOpenSpec> spec = ChannelOpenSpecFromProto(request);
    absl::Status status = spec.status();
    if (spec.ok()) {
      spec->cache = tenant_.CacheKey(request.cache());
      spec->tenant = tenant_.name;
    }
    if (status.ok()) {
      // Held across the open: a close from another thread waits until the first write is out.
      std::lock_guard lock(mu_);
      absl::StatusOr<ChannelStatus> opened =
          context_.engine->OpenChannel(*spec, [this](std::string reason) { OnClosed(reason); });
      if (opened.ok()) {
        channel_id_ = opened->id;
        ChannelStatusToProto(*opened, first_.mutable_channel());
        first_.mutable_channel()->set_cache(request.cache());
        writing_ = true;
        StartWrite(&first_);
        return;
      }
      status = opened.status();
    }
    if (context_.metrics) context_.metrics->ObserveRpc("OpenChannel", status.code(), 0.0);
    Finish(ToGrpcStatus(tenant_.Scrub(status)));
  }

  void OnWriteDone(bool ok) override {
    bool finish = false;
    bool broken = false;
    {
      std::lock_guard lock(mu_);
      writing_ = false;
      broken = !ok && !closed_;
      finish = closed_ && !finishing_;
      if (finish) finishing_ = true;
    }
    if (broken) {
      CloseFromClient("the OpenChannel call's stream broke");
      return;
    }
    if (finish) FinishNow();  // the last use of `this`: OnDone may delete it at once
  }

  void OnCancel() override { CloseFromClient("the OpenChannel call was cancelled"); }

  void OnDone() override { delete this; }

 private:
  void CloseFromClient(const std::string& reason) {
    {
      std::lock_guard lock(mu_);
      client_gone_ = true;
    }
    // NOT_FOUND: already closing from elsewhere; OnClosed comes (or came) all the same. Either
    // way nothing of `this` is touched after this call: OnClosed may have finished the call.
    context_.engine->CloseChannel(channel_id_, tenant_.name, reason).IgnoreError();
  }

  void OnClosed(const std::string& reason) {
    bool finish = false;
    {
      std::lock_guard lock(mu_);
      closed_ = true;
      reason_ = reason;
      finish = !writing_ && !finishing_;
      if (finish) finishing_ = true;
    }
    if (finish) FinishNow();
  }

  // Called once, outside the lock; the call may be deleted as soon as it finishes.
  void FinishNow() {
    if (client_gone_) {
      Finish(grpc::Status(grpc::StatusCode::CANCELLED, reason_));
      return;
    }
    last_.set_closed(reason_);
    if (context_.metrics) context_.metrics->ObserveRpc("OpenChannel", absl::StatusCode::kOk, 0.0);
    StartWriteAndFinish(&last_, grpc::WriteOptions(), grpc::Status::OK);
  }

  const ServiceContext& context_;
  const Tenant tenant_;
  uint64_t channel_id_ = 0;
  v1::OpenChannelResponse first_;
  v1::OpenChannelResponse last_;
  std::mutex mu_;
  bool writing_ = false;
  bool closed_ = false;
  std::atomic<bool> client_gone_{false};
  bool finishing_ = false;
  std::string reason_;
};

class RejectedWriteReactor final : public grpc::ServerWriteReactor<v1::OpenChannelResponse> {
 public:
  explicit RejectedWriteReactor(const grpc::Status& status) { Finish(status); }
  void OnDone() override { delete this; }
};

}  // namespace

grpc::ServerWriteReactor<v1::OpenChannelResponse>* AttentionService::OpenChannel(
    grpc::CallbackServerContext* ctx, const v1::OpenChannelRequest* request) {
  absl::StatusOr<Tenant> tenant = context_.auth->Authenticate(*ctx);
  if (!tenant.ok()) {
    if (context_.metrics) {
      context_.metrics->ObserveRpc("OpenChannel", tenant.status().code(), 0.0);
    }
    return new RejectedWriteReactor(ToGrpcStatus(tenant.status()));
  }
  return new OpenChannelReactor(context_, *std::move(tenant), *request);
}

grpc::ServerUnaryReactor* AttentionService::CloseChannel(grpc::CallbackServerContext* ctx,
                                                         const v1::CloseChannelRequest* request,
                                                         v1::CloseChannelResponse* /*response*/) {
  absl::Status status;
  if (absl::StatusOr<Tenant> tenant = context_.auth->Authenticate(*ctx); !tenant.ok()) {
    status = tenant.status();
  } else {
    status = context_.engine->CloseChannel(request->channel_id(), tenant->name,
                                           "closed by CloseChannel");
  }
  if (context_.metrics) context_.metrics->ObserveRpc("CloseChannel", status.code(), 0.0);
  auto* reactor = ctx->DefaultReactor();
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

}  // namespace attnd
