// attnd.v1.AttentionService on the gRPC callback API. Control RPCs run inline (no device
// work); Forward and EndStep finish from the engine's completion callbacks, so no handler
// thread ever waits on the device.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>

#include "attnd/v1/attnd.grpc.pb.h"
#include "backend/backend.h"
#include "engine/engine.h"
#include "metrics/metrics.h"
#include "server.h"

namespace attnd {

struct ServiceContext {
  Engine* engine = nullptr;
  Backend* backend = nullptr;
  Metrics* metrics = nullptr;
  std::string version;
  ServerLimitsOptions limits;
  absl::Duration step_ttl;
  // In-flight messages per ForwardStream before the server stops reading from it.
  int32_t max_stream_in_flight = 64;
};

class AttentionService final : public v1::AttentionService::CallbackService {
 public:
  explicit AttentionService(const ServiceContext& context) : context_(context) {}

  grpc::ServerUnaryReactor* GetServerInfo(grpc::CallbackServerContext* ctx,
                                          const v1::GetServerInfoRequest* request,
                                          v1::GetServerInfoResponse* response) override;
  grpc::ServerUnaryReactor* CreateCache(grpc::CallbackServerContext* ctx,
                                        const v1::CreateCacheRequest* request,
                                        v1::CreateCacheResponse* response) override;
  grpc::ServerUnaryReactor* GetCache(grpc::CallbackServerContext* ctx,
                                     const v1::GetCacheRequest* request,
                                     v1::GetCacheResponse* response) override;
  grpc::ServerUnaryReactor* ListCaches(grpc::CallbackServerContext* ctx,
                                       const v1::ListCachesRequest* request,
                                       v1::ListCachesResponse* response) override;
  grpc::ServerUnaryReactor* DeleteCache(grpc::CallbackServerContext* ctx,
                                        const v1::DeleteCacheRequest* request,
                                        v1::DeleteCacheResponse* response) override;
  grpc::ServerUnaryReactor* FreeSequences(grpc::CallbackServerContext* ctx,
                                          const v1::FreeSequencesRequest* request,
                                          v1::FreeSequencesResponse* response) override;
  grpc::ServerUnaryReactor* Plan(grpc::CallbackServerContext* ctx,
                                 const v1::PlanRequest* request,
                                 v1::PlanResponse* response) override;
  grpc::ServerUnaryReactor* Forward(grpc::CallbackServerContext* ctx,
                                    const v1::ForwardRequest* request,
                                    v1::ForwardResponse* response) override;
  grpc::ServerUnaryReactor* EndStep(grpc::CallbackServerContext* ctx,
                                    const v1::EndStepRequest* request,
                                    v1::EndStepResponse* response) override;
  grpc::ServerBidiReactor<v1::StreamRequest, v1::StreamResponse>* ForwardStream(
      grpc::CallbackServerContext* ctx) override;
  grpc::ServerUnaryReactor* GetStats(grpc::CallbackServerContext* ctx,
                                     const v1::GetStatsRequest* request,
                                     v1::GetStatsResponse* response) override;

 private:
  ServiceContext context_;
  std::atomic<uint64_t> next_stream_id_{1};
};

// Shared by the unary handlers and ForwardStream: one request in, its response out through
// `done` (called exactly once, possibly before the function returns).
absl::Status HandlePlan(const ServiceContext& context, const v1::PlanRequest& request,
                        uint64_t owner, v1::PlanResponse* response);
void HandleForward(const ServiceContext& context, const v1::ForwardRequest& request,
                   v1::ForwardResponse* response, std::function<void(absl::Status)> done);
void HandleEndStep(const ServiceContext& context, const v1::EndStepRequest& request,
                   v1::EndStepResponse* response, std::function<void(absl::Status)> done);

grpc::ServerBidiReactor<v1::StreamRequest, v1::StreamResponse>* NewForwardStreamReactor(
    const ServiceContext& context, uint64_t owner);

}  // namespace attnd
