#include "service/health_service.h"

#include <atomic>
#include <vector>

namespace attnd {

using grpc::health::v1::HealthCheckRequest;
using grpc::health::v1::HealthCheckResponse;

// One Watch stream: sends the current status, then each change. At most one write is
// outstanding; a change that arrives meanwhile is sent when it completes (only the latest), also
// when End() came meanwhile: the stream finishes once the latest status is out.
// gRPC may run a reaction inline inside StartWrite/Finish, so those are always called with no
// lock held. The reactor is reference-counted: gRPC holds one reference until OnDone, and the
// service takes one while it notifies, so a watcher is never deleted under a notification.
class HealthService::Watcher final : public grpc::ServerWriteReactor<HealthCheckResponse> {
 public:
  Watcher(HealthService* service, std::string name) : service_(service), name_(std::move(name)) {}

  const std::string& name() const { return name_; }
  void Ref() { refs_.fetch_add(1); }
  void Unref() {
    if (refs_.fetch_sub(1) == 1) delete this;
  }

  void Update(ServingStatus status) {
    bool write = false;
    {
      absl::MutexLock lock(&mu_);
      latest_ = status;
      write = PrepareWriteLocked();
    }
    if (write) StartWrite(&response_);
  }

  void End() {
    bool finish = false;
    {
      absl::MutexLock lock(&mu_);
      if (finishing_) return;
      finishing_ = true;
      finish = !writing_;
      finished_ = finish;
    }
    if (finish) Finish(grpc::Status::OK);
  }

  void OnWriteDone(bool ok) override {
    bool write = false;
    bool finish = false;
    {
      absl::MutexLock lock(&mu_);
      writing_ = false;
      if (!ok) finishing_ = true;
      // A change that came while the write was out is sent before the stream ends (the drain's
      // NOT_SERVING must reach the watcher even when End() came right after it).
      write = ok && PrepareWriteLocked();
      if (!write && finishing_) {
        finish = !finished_;
        finished_ = true;
      }
    }
    if (write) StartWrite(&response_);
    if (finish) Finish(ok ? grpc::Status::OK : grpc::Status::CANCELLED);
  }

  void OnCancel() override { End(); }

  void OnDone() override {
    service_->Remove(this);
    Unref();
  }

 private:
  // Fills response_ and marks a write outstanding when one is due.
  bool PrepareWriteLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (writing_ || finished_ || (sent_any_ && latest_ == last_sent_)) return false;
    response_.set_status(latest_);
    last_sent_ = latest_;
    sent_any_ = true;
    writing_ = true;
    return true;
  }

  HealthService* service_;
  const std::string name_;
  std::atomic<int> refs_{1};
  absl::Mutex mu_;
  HealthCheckResponse response_;  // written only while no write is outstanding
  ServingStatus latest_ ABSL_GUARDED_BY(mu_) = HealthCheckResponse::UNKNOWN;
  ServingStatus last_sent_ ABSL_GUARDED_BY(mu_) = HealthCheckResponse::UNKNOWN;
  bool sent_any_ ABSL_GUARDED_BY(mu_) = false;
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool finishing_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
};

HealthService::HealthService() {
  absl::MutexLock lock(&mu_);
  statuses_[""] = HealthCheckResponse::SERVING;
  statuses_[kAttentionService] = HealthCheckResponse::SERVING;
}

HealthService::~HealthService() { Shutdown(); }

HealthService::ServingStatus HealthService::StatusOfLocked(const std::string& service) const {
  auto it = statuses_.find(service);
  return it == statuses_.end() ? HealthCheckResponse::SERVICE_UNKNOWN : it->second;
}

std::vector<HealthService::Watcher*> HealthService::RefWatchersLocked() {
  std::vector<Watcher*> watchers(watchers_.begin(), watchers_.end());
  for (Watcher* watcher : watchers) watcher->Ref();
  return watchers;
}

void HealthService::SetStatus(const std::string& service, ServingStatus status) {
  std::vector<Watcher*> watchers;
  {
    absl::MutexLock lock(&mu_);
    statuses_[service] = status;
    watchers = RefWatchersLocked();
  }
  for (Watcher* watcher : watchers) {
    if (watcher->name() == service) watcher->Update(status);
    watcher->Unref();
  }
}

void HealthService::Shutdown() {
  std::vector<Watcher*> watchers;
  {
    absl::MutexLock lock(&mu_);
    shut_down_ = true;
    watchers = RefWatchersLocked();
  }
  for (Watcher* watcher : watchers) {
    watcher->End();
    watcher->Unref();
  }
}

void HealthService::Remove(Watcher* watcher) {
  absl::MutexLock lock(&mu_);
  watchers_.erase(watcher);
}

grpc::ServerUnaryReactor* HealthService::Check(grpc::CallbackServerContext* context,
                                               const HealthCheckRequest* request,
                                               HealthCheckResponse* response) {
  auto* reactor = context->DefaultReactor();
  ServingStatus status;
  {
    absl::MutexLock lock(&mu_);
    status = StatusOfLocked(request->service());
  }
  if (status == HealthCheckResponse::SERVICE_UNKNOWN) {
    reactor->Finish(grpc::Status(grpc::StatusCode::NOT_FOUND,
                                 "service: unknown service name '" + request->service() +
                                     "'; known: \"\" and \"" + kAttentionService + "\""));
    return reactor;
  }
  response->set_status(status);
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

grpc::ServerWriteReactor<HealthCheckResponse>* HealthService::Watch(
    grpc::CallbackServerContext* /*context*/, const HealthCheckRequest* request) {
  auto* watcher = new Watcher(this, request->service());
  ServingStatus status;
  bool shut_down;
  {
    absl::MutexLock lock(&mu_);
    status = StatusOfLocked(request->service());
    shut_down = shut_down_;
    watchers_.insert(watcher);
  }
  watcher->Update(status);
  if (shut_down) watcher->End();
  return watcher;
}

}  // namespace attnd
