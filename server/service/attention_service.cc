#include "service/attention_service.h"

#include <chrono>
#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "attnd/status_macros.h"
#include "service/convert.h"
#include "service/forward_call.h"

namespace attnd {
namespace {

using Clock = std::chrono::steady_clock;

double SecondsSince(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// Authenticates the call, runs a synchronous handler body on behalf of its tenant and
// finishes the call with the body's status, in the tenant's names.
template <typename Body>
grpc::ServerUnaryReactor* FinishNow(const ServiceContext& context,
                                    grpc::CallbackServerContext* ctx, std::string_view method,
                                    Body&& body) {
  const auto start = Clock::now();
  absl::Status status;
  if (absl::StatusOr<Tenant> tenant = context.auth->Authenticate(*ctx); !tenant.ok()) {
    status = tenant.status();
  } else {
    status = tenant->Scrub(body(*tenant));
  }
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

// A cache as its tenant sees it.
CacheStatus ForClient(const Tenant& tenant, CacheStatus status) {
  status.spec.name = tenant.ClientName(status.spec.name);
  if (!status.failure.empty()) {
    status.failure = std::string(tenant.Scrub(absl::InternalError(status.failure)).message());
  }
  return status;
}

// Scrubs the tenant's namespace out of an asynchronous call's error.
std::function<void(absl::Status)> InTenantNames(const Tenant& tenant,
                                                std::function<void(absl::Status)> done) {
  if (tenant.name.empty()) return done;
  return [tenant, done = std::move(done)](absl::Status status) {
    done(tenant.Scrub(status));
  };
}

}  // namespace

absl::Status HandlePlan(const ServiceContext& context, const Tenant& tenant,
                        const v1::PlanRequest& request, uint64_t owner,
                        v1::PlanResponse* response) {
  absl::StatusOr<PlanSpec> spec = PlanSpecFromProto(request);
  if (!spec.ok()) return spec.status();
  spec->cache = tenant.CacheKey(spec->cache);
  spec->tenant = tenant.name;
  absl::StatusOr<PlanResult> result = context.engine->Plan(*spec, owner);
  if (!result.ok()) return tenant.Scrub(result.status());
  PlanResultToProto(*result, response);
  return absl::OkStatus();
}

void HandleForward(const ServiceContext& context, const Tenant& tenant,
                   const v1::ForwardRequest& request, v1::ForwardResponse* response,
                   std::function<void(absl::Status)> done) {
  done = InTenantNames(tenant, std::move(done));
  // Lives until the engine's callback: the inputs in the codec's form (pieces of `request` and
  // of the converted `values` in `scratch`), output buffers.
  struct Call {
    wire::ForwardRequest wire;
    std::vector<std::string> scratch;
    ForwardArgs args;
    ForwardOutputs outputs;
    std::string lse;
    LayerTrace trace;
  };
  auto call = std::make_shared<Call>();
  LayerTraceSink* const sink = context.trace_sink;
  if (sink != nullptr) {
    call->trace.Mark(LayerTrace::kReceived);
    call->args.trace = &call->trace;
  }
  absl::Status decoded = WireForwardFromProto(request, call->wire, call->scratch);
  if (decoded.ok()) decoded = ForwardArgsFromWire(call->wire, call->args);
  call->args.use_channel = request.use_channel();
  if (!decoded.ok()) {
    done(decoded);
    return;
  }
  MarkStage(call->args.trace, LayerTrace::kDecoded);
  call->args.tenant = tenant.name;
  call->outputs.o = response->mutable_o()->mutable_data();
  call->outputs.lse = &call->lse;
  Engine* engine = context.engine;
  engine->Forward(call->args, &call->outputs,
                  [call, response, sink, done = std::move(done)](absl::Status status) {
                    if (status.ok()) {
                      ForwardOutputsToProto(call->outputs, std::move(call->lse), response);
                    } else {
                      response->Clear();
                    }
                    MarkStage(call->args.trace, LayerTrace::kEncoded);
                    done(status);
                    if (sink != nullptr) {
                      // Streams mark kWriteStarted inside `done`; unary calls finish there.
                      LayerTrace& trace = call->trace;
                      if (trace.ns[LayerTrace::kWriteStarted] == 0) {
                        trace.Mark(LayerTrace::kWriteStarted);
                      }
                      trace.step_id = call->args.step_id;
                      trace.layer = call->args.layer;
                      sink->Record(trace);
                    }
                  });
}

void HandleEndStep(const ServiceContext& context, const Tenant& tenant,
                   const v1::EndStepRequest& request, v1::EndStepResponse* response,
                   std::function<void(absl::Status)> done) {
  context.engine->EndStep(
      request.step_id(), request.abort(),
      [response, done = InTenantNames(tenant, std::move(done))](
          absl::StatusOr<EndStepResult> result) {
        if (result.ok()) EndStepResultToProto(*result, response);
        done(result.status());
      },
      tenant.name);
}

grpc::ServerUnaryReactor* AttentionService::GetServerInfo(grpc::CallbackServerContext* ctx,
                                                          const v1::GetServerInfoRequest*,
                                                          v1::GetServerInfoResponse* response) {
  return FinishNow(context_, ctx, "GetServerInfo", [&](const Tenant&) {
    const BackendInfo info = context_.backend->Info();
    response->set_version(context_.version);
    response->set_backend(info.name);
    response->set_device(info.device);
    response->set_num_sms(info.num_sms);
    response->set_device_memory_bytes(info.device_memory_bytes);
    response->set_kv_budget_bytes(info.kv_budget_bytes);
    response->set_kv_free_bytes(context_.backend->KvFreeBytes());
    for (const std::string& extension : info.extensions) response->add_extensions(extension);
    for (const DeviceInfo& device : info.devices) {
      v1::DeviceInfo* out = response->add_devices();
      out->set_ordinal(device.ordinal);
      out->set_name(device.name);
      out->set_num_sms(device.num_sms);
      out->set_memory_bytes(device.memory_bytes);
      out->set_kv_budget_bytes(device.kv_budget_bytes);
      out->set_kv_free_bytes(context_.backend->KvFreeBytesOn(device.ordinal));
    }
    v1::ServerLimits* limits = response->mutable_limits();
    limits->set_max_message_bytes(context_.limits.max_message_bytes);
    limits->set_max_plan_entries(context_.limits.max_plan_entries);
    limits->set_max_step_tokens(context_.limits.max_step_tokens);
    limits->set_step_ttl_seconds(absl::ToDoubleSeconds(context_.step_ttl));
    limits->set_max_channel_bytes(context_.limits.max_channel_bytes);
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* AttentionService::CreateCache(grpc::CallbackServerContext* ctx,
                                                        const v1::CreateCacheRequest* request,
                                                        v1::CreateCacheResponse* response) {
  return FinishNow(context_, ctx, "CreateCache", [&](const Tenant& tenant) -> absl::Status {
    ASSIGN_OR_RETURN(CacheSpec spec, CacheSpecFromProto(*request));
    spec.name = tenant.CacheKey(spec.name);
    // The quota is checked by the engine under its lock, against the caches there are and
    // those being created, so concurrent creates of one tenant cannot both fit in its last
    // pages; no lock of ours is held while the pools are allocated.
    Engine::CacheAdmission admit;
    if (tenant.page_quota != kUnlimitedPages) {
      admit = [&tenant, &spec](const std::vector<std::pair<std::string, int64_t>>& caches) {
        int64_t held_pages = 0;
        for (const auto& [name, num_pages] : caches) {
          if (tenant.Owns(name)) held_pages += num_pages;
        }
        if (held_pages + spec.geometry.num_pages > tenant.page_quota) {
          return absl::ResourceExhaustedError(absl::StrCat(
              "config.num_pages: the tenant's page quota is ", tenant.page_quota,
              " pages (token file or --tenant_page_quota); its caches hold ", held_pages,
              " and this cache needs ", spec.geometry.num_pages));
        }
        return absl::OkStatus();
      };
    }
    absl::StatusOr<CacheStatus> created = context_.engine->CreateCache(spec, admit);
    if (!created.ok()) return created.status();
    CacheStatusToProto(ForClient(tenant, *created), response->mutable_cache());
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* AttentionService::GetCache(grpc::CallbackServerContext* ctx,
                                                     const v1::GetCacheRequest* request,
                                                     v1::GetCacheResponse* response) {
  return FinishNow(context_, ctx, "GetCache", [&](const Tenant& tenant) -> absl::Status {
    ASSIGN_OR_RETURN(const CacheStatus status,
                     context_.engine->GetCache(tenant.CacheKey(request->name())));
    CacheStatusToProto(ForClient(tenant, status), response->mutable_cache());
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* AttentionService::ListCaches(grpc::CallbackServerContext* ctx,
                                                       const v1::ListCachesRequest*,
                                                       v1::ListCachesResponse* response) {
  return FinishNow(context_, ctx, "ListCaches", [&](const Tenant& tenant) {
    for (const CacheStatus& status : context_.engine->ListCaches()) {
      if (tenant.Owns(status.spec.name)) {
        CacheStatusToProto(ForClient(tenant, status), response->add_caches());
      }
    }
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* AttentionService::DeleteCache(grpc::CallbackServerContext* ctx,
                                                        const v1::DeleteCacheRequest* request,
                                                        v1::DeleteCacheResponse*) {
  return FinishNow(context_, ctx, "DeleteCache", [&](const Tenant& tenant) {
    return context_.engine->DeleteCache(tenant.CacheKey(request->name()), request->force());
  });
}

grpc::ServerUnaryReactor* AttentionService::FreeSequences(
    grpc::CallbackServerContext* ctx, const v1::FreeSequencesRequest* request,
    v1::FreeSequencesResponse* response) {
  return FinishNow(context_, ctx, "FreeSequences", [&](const Tenant& tenant) -> absl::Status {
    const std::vector<uint64_t> ids(request->sequence_ids().begin(), request->sequence_ids().end());
    ASSIGN_OR_RETURN(const int64_t freed,
                     context_.engine->FreeSequences(tenant.CacheKey(request->cache()), ids));
    response->set_freed_pages(freed);
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* AttentionService::Plan(grpc::CallbackServerContext* ctx,
                                                 const v1::PlanRequest* request,
                                                 v1::PlanResponse* response) {
  return FinishNow(context_, ctx, "Plan", [&](const Tenant& tenant) {
    return HandlePlan(context_, tenant, *request, /*owner=*/0, response);
  });
}

namespace {

// The end of a unary Forward that took the fast path; `owner` is the call pool.
void UnaryForwardDone(void* owner, ForwardCall* call, absl::Status status) {
  grpc::ServerUnaryReactor* reactor = call->unary_reactor;
  if (status.ok()) call->unary_reply->Swap(&call->response);
  if (Metrics* metrics = call->metrics) {
    metrics->ObserveRpc("Forward", status.code(), SecondsSince(call->start));
  }
  call->Mark(LayerTrace::kWriteStarted);
  call->RecordTrace();
  static_cast<ForwardCallPool*>(owner)->Return(call);
  reactor->Finish(ToGrpcStatus(status));
}

}  // namespace

AttentionService::AttentionService(const ServiceContext& context)
    : context_(context), unary_calls_(std::make_unique<ForwardCallPool>()) {}

AttentionService::~AttentionService() = default;

grpc::ServerUnaryReactor* AttentionService::Forward(grpc::CallbackServerContext* ctx,
                                                    const grpc::ByteBuffer* request,
                                                    grpc::ByteBuffer* response) {
  auto* reactor = ctx->DefaultReactor();
  ForwardCall* call = unary_calls_->Take();
  call->start = Clock::now();
  call->trace_sink = context_.trace_sink;
  call->Mark(LayerTrace::kReceived);
  absl::StatusOr<Tenant> tenant = context_.auth->Authenticate(*ctx);
  if (!tenant.ok()) {
    unary_calls_->Return(call);
    FinishLater(context_, reactor, "Forward")(tenant.status());
    return reactor;
  }
  if (!request->Dump(&call->slices).ok() ||
      wire::DecodeForwardRequest(call->slices, call->wire) != wire::Decoded::kForward) {
    // What the codec leaves to protobuf (use_channel, `values` tensors, unknown fields, unusual
    // encodings) takes protobuf's parser, then the same path from the same form.
    unary_calls_->Return(call);
    auto parsed = std::make_shared<v1::ForwardRequest>();
    auto typed_response = std::make_shared<v1::ForwardResponse>();
    grpc::ByteBuffer copy(*request);  // shares the slices
    if (!grpc::SerializationTraits<v1::ForwardRequest>::Deserialize(&copy, parsed.get()).ok()) {
      FinishLater(context_, reactor, "Forward")(
          absl::InvalidArgumentError("request: not a valid attnd.v1.ForwardRequest"));
      return reactor;
    }
    HandleForward(context_, *tenant, *parsed, typed_response.get(),
                  [parsed, typed_response, response,
                   done = FinishLater(context_, reactor, "Forward")](absl::Status status) {
                    if (status.ok()) {
                      bool own_buffer = false;
                      const grpc::Status serialized =
                          grpc::SerializationTraits<v1::ForwardResponse>::Serialize(
                              *typed_response, response, &own_buffer);
                      if (!serialized.ok()) {
                        status = absl::InternalError(absl::StrCat(
                            "serialize ForwardResponse: ", serialized.error_message()));
                      }
                    }
                    done(status);
                  });
    return reactor;
  }
  call->tenant = *std::move(tenant);
  call->stream = false;
  call->metrics = context_.metrics;
  call->unary_reactor = reactor;
  call->unary_reply = response;
  call->owner = unary_calls_.get();
  call->on_done = &UnaryForwardDone;
  RunForward(context_, call);
  return reactor;
}

grpc::ServerUnaryReactor* AttentionService::EndStep(grpc::CallbackServerContext* ctx,
                                                    const v1::EndStepRequest* request,
                                                    v1::EndStepResponse* response) {
  auto* reactor = ctx->DefaultReactor();
  auto done = FinishLater(context_, reactor, "EndStep");
  absl::StatusOr<Tenant> tenant = context_.auth->Authenticate(*ctx);
  if (!tenant.ok()) {
    done(tenant.status());
    return reactor;
  }
  HandleEndStep(context_, *tenant, *request, response, std::move(done));
  return reactor;
}

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* AttentionService::ForwardStream(
    grpc::CallbackServerContext* ctx) {
  absl::StatusOr<Tenant> tenant = context_.auth->Authenticate(*ctx);
  if (!tenant.ok()) {
    if (context_.metrics) context_.metrics->ObserveRpc("ForwardStream", tenant.status().code(), 0);
    return NewRejectedStreamReactor(ToGrpcStatus(tenant.status()));
  }
  return NewForwardStreamReactor(context_, next_stream_id_.fetch_add(1), *std::move(tenant),
                                 Authenticator::PresentedToken(*ctx));
}

grpc::ServerUnaryReactor* AttentionService::GetStats(grpc::CallbackServerContext* ctx,
                                                     const v1::GetStatsRequest*,
                                                     v1::GetStatsResponse* response) {
  return FinishNow(context_, ctx, "GetStats", [&](const Tenant&) {
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
