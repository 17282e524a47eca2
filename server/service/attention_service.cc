#include "service/attention_service.h"

#include <chrono>
#include <memory>
#include <vector>

#include "service/convert.h"
#include "attnd/status_macros.h"

namespace attnd {
namespace {

using Clock = std::chrono::steady_clock;

double SecondsSince(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// Runs a synchronous handler body and finishes the call with its status.
template <typename Body>
grpc::ServerUnaryReactor* FinishNow(const ServiceContext& context,
                                    grpc::CallbackServerContext* ctx, std::string_view method,
                                    Body&& body) {
  const auto start = Clock::now();
  const absl::Status status = body();
  if (context.metrics) context.metrics->ObserveRpc(method, status.code(), SecondsSince(start));
  auto* reactor = ctx->DefaultReactor();
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

// Finishes an asynchronous call from whichever thread completes it.
std::function<void(absl::Status)> FinishLater(const ServiceContext& context,
                                              grpc::ServerUnaryReactor* reactor,
                                              std::string_view method) {
  return [metrics = context.metrics, reactor, method, start = Clock::now()](absl::Status status) {
    if (metrics) metrics->ObserveRpc(method, status.code(), SecondsSince(start));
    reactor->Finish(ToGrpcStatus(status));
  };
}

}  // namespace

absl::Status HandlePlan(const ServiceContext& context, const v1::PlanRequest& request,
                        uint64_t owner, v1::PlanResponse* response) {
  ASSIGN_OR_RETURN(const PlanSpec spec, PlanSpecFromProto(request));
  ASSIGN_OR_RETURN(const PlanResult result, context.engine->Plan(spec, owner));
  PlanResultToProto(result, response);
  return absl::OkStatus();
}

void HandleForward(const ServiceContext& context, const v1::ForwardRequest& request,
                   v1::ForwardResponse* response, std::function<void(absl::Status)> done) {
  // Lives until the engine's callback: converted inputs, output buffers.
  struct Call {
    ForwardArgs args;
    std::vector<std::string> scratch;
    ForwardOutputs outputs;
    std::string lse;
  };
  auto call = std::make_shared<Call>();
  const absl::Status decoded = ForwardArgsFromProto(request, call->args, call->scratch);
  if (!decoded.ok()) {
    done(decoded);
    return;
  }
  call->outputs.o = response->mutable_o()->mutable_data();
  call->outputs.lse = &call->lse;
  Engine* engine = context.engine;
  engine->Forward(call->args, &call->outputs,
                  [call, response, done = std::move(done)](absl::Status status) {
                    if (status.ok()) {
                      ForwardOutputsToProto(call->outputs, std::move(call->lse), response);
                    } else {
                      response->Clear();
                    }
                    done(status);
                  });
}

void HandleEndStep(const ServiceContext& context, const v1::EndStepRequest& request,
                   v1::EndStepResponse* response, std::function<void(absl::Status)> done) {
  context.engine->EndStep(request.step_id(), request.abort(),
                          [response, done = std::move(done)](absl::StatusOr<EndStepResult> result) {
                            if (result.ok()) EndStepResultToProto(*result, response);
                            done(result.status());
                          });
}

grpc::ServerUnaryReactor* AttentionService::GetServerInfo(grpc::CallbackServerContext* ctx,
                                                          const v1::GetServerInfoRequest*,
                                                          v1::GetServerInfoResponse* response) {
  return FinishNow(context_, ctx, "GetServerInfo", [&] {
    const BackendInfo info = context_.backend->Info();
    response->set_version(context_.version);
    response->set_backend(info.name);
    response->set_device(info.device);
    response->set_num_sms(info.num_sms);
    response->set_device_memory_bytes(info.device_memory_bytes);
    response->set_kv_budget_bytes(info.kv_budget_bytes);
    response->set_kv_free_bytes(context_.backend->KvFreeBytes());
    for (const std::string& extension : info.extensions) response->add_extensions(extension);
    v1::ServerLimits* limits = response->mutable_limits();
    limits->set_max_message_bytes(context_.limits.max_message_bytes);
    limits->set_max_plan_entries(context_.limits.max_plan_entries);
    limits->set_max_step_tokens(context_.limits.max_step_tokens);
    limits->set_step_ttl_seconds(absl::ToDoubleSeconds(context_.step_ttl));
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* AttentionService::CreateCache(grpc::CallbackServerContext* ctx,
                                                        const v1::CreateCacheRequest* request,
                                                        v1::CreateCacheResponse* response) {
  return FinishNow(context_, ctx, "CreateCache", [&]() -> absl::Status {
    ASSIGN_OR_RETURN(const CacheSpec spec, CacheSpecFromProto(*request));
    ASSIGN_OR_RETURN(const CacheStatus status, context_.engine->CreateCache(spec));
    CacheStatusToProto(status, response->mutable_cache());
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* AttentionService::GetCache(grpc::CallbackServerContext* ctx,
                                                     const v1::GetCacheRequest* request,
                                                     v1::GetCacheResponse* response) {
  return FinishNow(context_, ctx, "GetCache", [&]() -> absl::Status {
    ASSIGN_OR_RETURN(const CacheStatus status, context_.engine->GetCache(request->name()));
    CacheStatusToProto(status, response->mutable_cache());
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* AttentionService::ListCaches(grpc::CallbackServerContext* ctx,
                                                       const v1::ListCachesRequest*,
                                                       v1::ListCachesResponse* response) {
  return FinishNow(context_, ctx, "ListCaches", [&] {
    for (const CacheStatus& status : context_.engine->ListCaches()) {
      CacheStatusToProto(status, response->add_caches());
    }
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* AttentionService::DeleteCache(grpc::CallbackServerContext* ctx,
                                                        const v1::DeleteCacheRequest* request,
                                                        v1::DeleteCacheResponse*) {
  return FinishNow(context_, ctx, "DeleteCache", [&] {
    return context_.engine->DeleteCache(request->name(), request->force());
  });
}

grpc::ServerUnaryReactor* AttentionService::FreeSequences(
    grpc::CallbackServerContext* ctx, const v1::FreeSequencesRequest* request,
    v1::FreeSequencesResponse* response) {
  return FinishNow(context_, ctx, "FreeSequences", [&]() -> absl::Status {
    const std::vector<uint64_t> ids(request->sequence_ids().begin(), request->sequence_ids().end());
    ASSIGN_OR_RETURN(const int64_t freed, context_.engine->FreeSequences(request->cache(), ids));
    response->set_freed_pages(freed);
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* AttentionService::Plan(grpc::CallbackServerContext* ctx,
                                                 const v1::PlanRequest* request,
                                                 v1::PlanResponse* response) {
  return FinishNow(context_, ctx, "Plan",
                   [&] { return HandlePlan(context_, *request, /*owner=*/0, response); });
}

grpc::ServerUnaryReactor* AttentionService::Forward(grpc::CallbackServerContext* ctx,
                                                    const v1::ForwardRequest* request,
                                                    v1::ForwardResponse* response) {
  auto* reactor = ctx->DefaultReactor();
  HandleForward(context_, *request, response, FinishLater(context_, reactor, "Forward"));
  return reactor;
}

grpc::ServerUnaryReactor* AttentionService::EndStep(grpc::CallbackServerContext* ctx,
                                                    const v1::EndStepRequest* request,
                                                    v1::EndStepResponse* response) {
  auto* reactor = ctx->DefaultReactor();
  HandleEndStep(context_, *request, response, FinishLater(context_, reactor, "EndStep"));
  return reactor;
}

grpc::ServerBidiReactor<v1::StreamRequest, v1::StreamResponse>* AttentionService::ForwardStream(
    grpc::CallbackServerContext*) {
  return NewForwardStreamReactor(context_, next_stream_id_.fetch_add(1));
}

grpc::ServerUnaryReactor* AttentionService::GetStats(grpc::CallbackServerContext* ctx,
                                                     const v1::GetStatsRequest*,
                                                     v1::GetStatsResponse* response) {
  return FinishNow(context_, ctx, "GetStats", [&] {
    if (context_.metrics == nullptr) return absl::OkStatus();
    const StatsSnapshot snapshot = context_.metrics->Snapshot();
    for (const KernelTotals& totals : snapshot.kernels) {
      v1::KernelStats* stats = response->add_kernels();
      stats->set_kernel(totals.kernel);
      stats->set_phase(totals.phase);
      stats->set_count(totals.count);
      stats->set_total_seconds(totals.total_seconds);
    }
    response->set_steps_committed(snapshot.steps_committed);
    response->set_steps_aborted(snapshot.steps_aborted);
    response->set_tokens_prefill(snapshot.tokens_prefill);
    response->set_tokens_decode(snapshot.tokens_decode);
    return absl::OkStatus();
  });
}

}  // namespace attnd
