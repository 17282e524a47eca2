// attnd.v1.AttentionService on the gRPC callback API. Control RPCs run inline (no device
// work); Forward and EndStep finish from the engine's completion callbacks, so no handler
// thread ever waits on the device. Every call first authenticates (service/auth.h) and then
// speaks in its tenant's cache names only.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

#include "attnd/v1/attnd.grpc.pb.h"
#include "backend/backend.h"
#include "engine/engine.h"
#include "metrics/metrics.h"
#include "options.h"
#include "service/auth.h"

namespace attnd {

struct ServiceContext {
  Engine* engine = nullptr;
  Backend* backend = nullptr;
  Metrics* metrics = nullptr;
  // Never null; accepts every call as tenant "" when no token file is set.
  const Authenticator* auth = nullptr;
  std::string version;
  ServerLimitsOptions limits;  // limits.max_stream_in_flight bounds each ForwardStream
  absl::Duration step_ttl;
  // Benchmarks only: receives a LayerTrace of every Forward (backend/layer_trace.h).
  LayerTraceSink* trace_sink = nullptr;
};

// The callback service with Forward and ForwardStream taking raw messages (grpc::ByteBuffer):
// the hot path reads and writes them with the wire codec (attnd/wire/forward_wire.h) so that
// tensor bytes are copied once each way between gRPC's slices and pinned memory. The other
// RPCs stay typed.
using AttentionServiceBase = v1::AttentionService::WithCallbackMethod_GetServerInfo<
    v1::AttentionService::WithCallbackMethod_CreateCache<
        v1::AttentionService::WithCallbackMethod_GetCache<
            v1::AttentionService::WithCallbackMethod_ListCaches<
                v1::AttentionService::WithCallbackMethod_DeleteCache<
                    v1::AttentionService::WithCallbackMethod_FreeSequences<
                    v1::AttentionService::WithCallbackMethod_ForkSequence<
                    v1::AttentionService::WithCallbackMethod_ExportSequence<
                    v1::AttentionService::WithCallbackMethod_ImportSequence<
                        v1::AttentionService::WithCallbackMethod_Plan<
                            v1::AttentionService::WithRawCallbackMethod_Forward<
                                v1::AttentionService::WithCallbackMethod_EndStep<
                                    v1::AttentionService::WithRawCallbackMethod_ForwardStream<
                                        v1::AttentionService::WithCallbackMethod_OpenChannel<
                                            v1::AttentionService::WithCallbackMethod_CloseChannel<
                                                v1::AttentionService::WithCallbackMethod_GetStats<
                                                    v1::AttentionService::Service>>>>>>>>>>>>>>>>;

class ForwardCallPool;

class AttentionService final : public AttentionServiceBase {
 public:
  explicit AttentionService(const ServiceContext& context);
  ~AttentionService() override;

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
  grpc::ServerUnaryReactor* ForkSequence(grpc::CallbackServerContext* ctx,
                                         const v1::ForkSequenceRequest* request,
                                         v1::ForkSequenceResponse* response) override;
  grpc::ServerWriteReactor<v1::ExportSequenceResponse>* ExportSequence(
      grpc::CallbackServerContext* ctx, const v1::ExportSequenceRequest* request) override;
  grpc::ServerReadReactor<v1::ImportSequenceRequest>* ImportSequence(
      grpc::CallbackServerContext* ctx, v1::ImportSequenceResponse* response) override;
  grpc::ServerUnaryReactor* Plan(grpc::CallbackServerContext* ctx,
                                 const v1::PlanRequest* request,
                                 v1::PlanResponse* response) override;
  grpc::ServerUnaryReactor* Forward(grpc::CallbackServerContext* ctx,
                                    const grpc::ByteBuffer* request,
                                    grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* EndStep(grpc::CallbackServerContext* ctx,
                                    const v1::EndStepRequest* request,
                                    v1::EndStepResponse* response) override;
  grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* ForwardStream(
      grpc::CallbackServerContext* ctx) override;
  grpc::ServerWriteReactor<v1::OpenChannelResponse>* OpenChannel(
      grpc::CallbackServerContext* ctx, const v1::OpenChannelRequest* request) override;
  grpc::ServerUnaryReactor* CloseChannel(grpc::CallbackServerContext* ctx,
                                         const v1::CloseChannelRequest* request,
                                         v1::CloseChannelResponse* response) override;
  grpc::ServerUnaryReactor* GetStats(grpc::CallbackServerContext* ctx,
                                     const v1::GetStatsRequest* request,
                                     v1::GetStatsResponse* response) override;

 private:
  ServiceContext context_;
  std::unique_ptr<ForwardCallPool> unary_calls_;
  std::atomic<uint64_t> next_stream_id_{1};
};

// Shared by the unary handlers and ForwardStream, on behalf of an authenticated tenant: one
// request in, its response out through `done` (called exactly once, possibly before the
// function returns). Errors speak the tenant's cache names.
absl::Status HandlePlan(const ServiceContext& context, const Tenant& tenant,
                        const v1::PlanRequest& request, uint64_t owner,
                        v1::PlanResponse* response);
void HandleForward(const ServiceContext& context, const Tenant& tenant,
                   const v1::ForwardRequest& request, v1::ForwardResponse* response,
                   std::function<void(absl::Status)> done);
void HandleEndStep(const ServiceContext& context, const Tenant& tenant,
                   const v1::EndStepRequest& request, v1::EndStepResponse* response,
                   std::function<void(absl::Status)> done);

// A stream of `tenant`, which presented `token`: each message re-checks the token, so a
// token revoked by a reload stops working on open streams too. Messages are raw StreamRequest
// bytes (attnd/wire/forward_wire.h).
grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* NewForwardStreamReactor(
    const ServiceContext& context, uint64_t owner, Tenant tenant, std::string token);
// A stream refused before it starts (authentication failed): finishes with `status`.
grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* NewRejectedStreamReactor(
    const grpc::Status& status);

}  // namespace attnd
