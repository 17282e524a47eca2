// grpc.health.v1.Health: "" reports liveness (SERVING while the process serves at all) and
// "attnd.v1.AttentionService" readiness (NOT_SERVING once draining). Watch streams every change.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/synchronization/mutex.h"
#include "grpc/health/v1/health.grpc.pb.h"

namespace attnd {

class HealthService final : public grpc::health::v1::Health::CallbackService {
 public:
  using ServingStatus = grpc::health::v1::HealthCheckResponse::ServingStatus;
  static constexpr char kAttentionService[] = "attnd.v1.AttentionService";

  HealthService();
  ~HealthService() override;

  void SetStatus(const std::string& service, ServingStatus status);
  // Ends every Watch stream (before the server shuts down, so shutdown need not wait for them).
  void Shutdown();

  grpc::ServerUnaryReactor* Check(grpc::CallbackServerContext* context,
                                  const grpc::health::v1::HealthCheckRequest* request,
                                  grpc::health::v1::HealthCheckResponse* response) override;
  grpc::ServerWriteReactor<grpc::health::v1::HealthCheckResponse>* Watch(
      grpc::CallbackServerContext* context,
      const grpc::health::v1::HealthCheckRequest* request) override;

  class Watcher;

 private:
  friend class Watcher;
  ServingStatus StatusOfLocked(const std::string& service) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Remove(Watcher* watcher);
  // Takes a reference on every watcher, so they can be used after the lock is released.
  std::vector<Watcher*> RefWatchersLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  absl::Mutex mu_;
  absl::flat_hash_map<std::string, ServingStatus> statuses_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_set<Watcher*> watchers_ ABSL_GUARDED_BY(mu_);
  bool shut_down_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace attnd
