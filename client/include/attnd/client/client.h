// The attnd client: one channel to a daemon and a typed call per RPC.
//
// Every call returns absl::Status / StatusOr; a gRPC error arrives as the same code with the
// server's message. Thread-safe: one Client may serve many threads, steps and streams at once.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <grpcpp/channel.h>
#include <grpcpp/client_context.h>

#include "absl/status/statusor.h"
#include "attnd/client/client_options.h"
#include "attnd/client/step.h"
#include "attnd/client/stream_session.h"
#include "attnd/v1/attnd.grpc.pb.h"
#include "grpc/health/v1/health.grpc.pb.h"

namespace attnd::client {

using HealthStatus = grpc::health::v1::HealthCheckResponse::ServingStatus;

// The readiness service name of grpc.health.v1 ("" asks for liveness).
inline constexpr std::string_view kReadinessService = "attnd.v1.AttentionService";

class Client {
 public:
  // Builds the channel (connection is lazy: the first call connects).
  static absl::StatusOr<std::unique_ptr<Client>> Connect(const ClientOptions& options);
  // Over an existing channel, e.g. an in-process one in tests.
  Client(std::shared_ptr<grpc::Channel> channel, ClientOptions options);

  // Waits until the channel is connected; UNAVAILABLE after `timeout`.
  absl::Status WaitForConnected(absl::Duration timeout);

  absl::StatusOr<attnd::v1::GetServerInfoResponse> GetServerInfo();

  // `device`: the ordinal (GetServerInfoResponse.devices) to place the cache's pools on;
  // unset, the device with the most free KV budget.
  absl::StatusOr<attnd::v1::CacheInfo> CreateCache(std::string_view name,
                                                   const attnd::v1::CacheConfig& config,
                                                   std::optional<int32_t> device = std::nullopt);
  absl::StatusOr<attnd::v1::CacheInfo> GetCache(std::string_view name);
  // Sorted by name.
  absl::StatusOr<std::vector<attnd::v1::CacheInfo>> ListCaches();
  absl::Status DeleteCache(std::string_view name, bool force = false);
  // Returns the pages given back to the pool.
  absl::StatusOr<int64_t> FreeSequences(std::string_view cache,
                                        std::span<const uint64_t> sequence_ids);

  // The raw step RPCs; BeginStep below wraps them in a handle that aborts when dropped.
  absl::StatusOr<attnd::v1::PlanResponse> Plan(const attnd::v1::PlanRequest& request);
  absl::StatusOr<attnd::v1::ForwardResponse> Forward(const attnd::v1::ForwardRequest& request);
  absl::StatusOr<attnd::v1::EndStepResponse> EndStep(uint64_t step_id, bool abort);

  // Plans `request` and returns the open step.
  absl::StatusOr<std::unique_ptr<Step>> BeginStep(const attnd::v1::PlanRequest& request);

  // Opens a ForwardStream. The stream has no deadline; the session must outlive its steps'
  // use (steps of a closed session fail with FAILED_PRECONDITION and the server aborts them).
  absl::StatusOr<std::unique_ptr<StreamSession>> OpenStream(StreamOptions options = {});

  absl::StatusOr<attnd::v1::GetStatsResponse> GetStats();

  // grpc.health.v1 Check: "" = liveness, kReadinessService = readiness.
  absl::StatusOr<HealthStatus> CheckHealth(std::string_view service = "");

  const ClientOptions& options() const { return options_; }
  const std::shared_ptr<grpc::Channel>& channel() const { return channel_; }
  attnd::v1::AttentionService::Stub& stub() { return *stub_; }

  // A context with this client's deadline and metadata, for calls made on stub() directly.
  std::unique_ptr<grpc::ClientContext> NewContext(bool with_deadline = true) const;

 private:
  ClientOptions options_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<attnd::v1::AttentionService::Stub> stub_;
  std::unique_ptr<grpc::health::v1::Health::Stub> health_stub_;
};

}  // namespace attnd::client
