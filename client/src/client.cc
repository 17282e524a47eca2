#include "attnd/client/client.h"

#include <utility>

#include <grpcpp/create_channel.h>
#include <grpcpp/security/credentials.h>
#include <grpcpp/support/channel_arguments.h>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "attnd/client/status.h"
#include "attnd/status_macros.h"
#include "callback_queue_pin.h"
#include "stream_session_impl.h"
#include "unary_step.h"

namespace attnd::client {
namespace {

int ClampToInt(int64_t value) {
  return value > INT32_MAX ? INT32_MAX : value < 0 ? 0 : static_cast<int>(value);
}

grpc::ChannelArguments ChannelArgs(const ClientOptions& options) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(ClampToInt(options.max_message_bytes));
  args.SetMaxSendMessageSize(ClampToInt(options.max_message_bytes));
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS,
              ClampToInt(absl::ToInt64Milliseconds(options.keepalive.time)));
  args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS,
              ClampToInt(absl::ToInt64Milliseconds(options.keepalive.timeout)));
  args.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS,
              options.keepalive.permit_without_calls ? 1 : 0);
  // Keep pinging an idle connection (gRPC otherwise stops after two pings without data);
  // attnd permits it at this rate.
  args.SetInt(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
  if (options.tls.enabled && !options.tls.server_name_override.empty()) {
    args.SetSslTargetNameOverride(options.tls.server_name_override);
  }
  return args;
}

std::shared_ptr<grpc::ChannelCredentials> Credentials(const TlsOptions& tls) {
  if (!tls.enabled) return grpc::InsecureChannelCredentials();
  grpc::SslCredentialsOptions ssl;
  ssl.pem_root_certs = tls.root_certs_pem;
  ssl.pem_cert_chain = tls.cert_chain_pem;
  ssl.pem_private_key = tls.private_key_pem;
  return grpc::SslCredentials(ssl);
}

}  // namespace

absl::StatusOr<std::unique_ptr<Client>> Client::Connect(const ClientOptions& options) {
  if (options.address.empty()) return absl::InvalidArgumentError("address: empty");
  if (options.max_message_bytes <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_message_bytes: expected > 0, got ", options.max_message_bytes));
  }
  if (options.tls.cert_chain_pem.empty() != options.tls.private_key_pem.empty()) {
    return absl::InvalidArgumentError(
        "tls: a client certificate and its private key come together");
  }
  PinCallbackQueue();
  auto channel = grpc::CreateCustomChannel(options.address, Credentials(options.tls),
                                           ChannelArgs(options));
  if (channel == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("address: cannot use '", options.address, "'"));
  }
  return std::make_unique<Client>(std::move(channel), options);
}

Client::Client(std::shared_ptr<grpc::Channel> channel, ClientOptions options)
    : options_(std::move(options)),
      channel_(std::move(channel)),
      stub_(attnd::v1::AttentionService::NewStub(channel_)),
      health_stub_(grpc::health::v1::Health::NewStub(channel_)) {}

std::unique_ptr<grpc::ClientContext> Client::NewContext(bool with_deadline) const {
  auto context = std::make_unique<grpc::ClientContext>();
  if (with_deadline && options_.timeout != absl::InfiniteDuration()) {
    context->set_deadline(absl::ToChronoTime(absl::Now() + options_.timeout));
  }
  if (!options_.bearer_token.empty()) {
    context->AddMetadata("authorization", "Bearer " + options_.bearer_token);
  }
  return context;
}

absl::Status Client::WaitForConnected(absl::Duration timeout) {
  if (channel_->WaitForConnected(absl::ToChronoTime(absl::Now() + timeout))) {
    return absl::OkStatus();
  }
  return absl::UnavailableError(absl::StrCat("could not connect to ", options_.address,
                                             " within ", absl::FormatDuration(timeout)));
}

absl::StatusOr<attnd::v1::GetServerInfoResponse> Client::GetServerInfo() {
  auto context = NewContext();
  attnd::v1::GetServerInfoResponse response;
  RETURN_IF_ERROR(FromGrpcStatus(stub_->GetServerInfo(context.get(), {}, &response)));
  return response;
}

absl::StatusOr<attnd::v1::CacheInfo> Client::CreateCache(std::string_view name,
                                                         const attnd::v1::CacheConfig& config,
                                                         std::optional<int32_t> device) {
  auto context = NewContext();
  attnd::v1::CreateCacheRequest request;
  request.set_name(std::string(name));
  *request.mutable_config() = config;
  if (device.has_value()) request.set_device(*device);
  attnd::v1::CreateCacheResponse response;
  RETURN_IF_ERROR(FromGrpcStatus(stub_->CreateCache(context.get(), request, &response)));
  return std::move(*response.mutable_cache());
}

absl::StatusOr<attnd::v1::CacheInfo> Client::GetCache(std::string_view name) {
  auto context = NewContext();
  attnd::v1::GetCacheRequest request;
  request.set_name(std::string(name));
  attnd::v1::GetCacheResponse response;
  RETURN_IF_ERROR(FromGrpcStatus(stub_->GetCache(context.get(), request, &response)));
  return std::move(*response.mutable_cache());
}

absl::StatusOr<std::vector<attnd::v1::CacheInfo>> Client::ListCaches() {
  auto context = NewContext();
  attnd::v1::ListCachesResponse response;
  RETURN_IF_ERROR(FromGrpcStatus(stub_->ListCaches(context.get(), {}, &response)));
  return std::vector<attnd::v1::CacheInfo>(std::make_move_iterator(response.caches().begin()),
                                           std::make_move_iterator(response.caches().end()));
}

absl::Status Client::DeleteCache(std::string_view name, bool force) {
  auto context = NewContext();
  attnd::v1::DeleteCacheRequest request;
  request.set_name(std::string(name));
  request.set_force(force);
  attnd::v1::DeleteCacheResponse response;
  return FromGrpcStatus(stub_->DeleteCache(context.get(), request, &response));
}

absl::StatusOr<int64_t> Client::FreeSequences(std::string_view cache,
                                              std::span<const uint64_t> sequence_ids) {
  auto context = NewContext();
  attnd::v1::FreeSequencesRequest request;
  request.set_cache(std::string(cache));
  request.mutable_sequence_ids()->Add(sequence_ids.begin(), sequence_ids.end());
  attnd::v1::FreeSequencesResponse response;
  RETURN_IF_ERROR(FromGrpcStatus(stub_->FreeSequences(context.get(), request, &response)));
  return response.freed_pages();
}

absl::StatusOr<attnd::v1::PlanResponse> Client::Plan(const attnd::v1::PlanRequest& request) {
  auto context = NewContext();
  attnd::v1::PlanResponse response;
  RETURN_IF_ERROR(FromGrpcStatus(stub_->Plan(context.get(), request, &response)));
  return response;
}

absl::StatusOr<attnd::v1::ForwardResponse> Client::Forward(
    const attnd::v1::ForwardRequest& request) {
  auto context = NewContext();
  attnd::v1::ForwardResponse response;
  RETURN_IF_ERROR(FromGrpcStatus(stub_->Forward(context.get(), request, &response)));
  return response;
}

absl::StatusOr<attnd::v1::EndStepResponse> Client::EndStep(uint64_t step_id, bool abort) {
  auto context = NewContext();
  attnd::v1::EndStepRequest request;
  request.set_step_id(step_id);
  request.set_abort(abort);
  attnd::v1::EndStepResponse response;
  RETURN_IF_ERROR(FromGrpcStatus(stub_->EndStep(context.get(), request, &response)));
  return response;
}

absl::StatusOr<std::unique_ptr<Step>> Client::BeginStep(const attnd::v1::PlanRequest& request) {
  absl::StatusOr<attnd::v1::PlanResponse> plan = Plan(request);
  if (!plan.ok()) return plan.status();
  return std::unique_ptr<Step>(new UnaryStep(*std::move(plan), this));
}

absl::StatusOr<std::unique_ptr<StreamSession>> Client::OpenStream(StreamOptions options) {
  if (options.window < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("window: expected >= 1, got ", options.window));
  }
  auto impl = StreamSession::Impl::Start(channel_, NewContext(/*with_deadline=*/false), options);
  return std::make_unique<StreamSession>(std::move(impl));
}

absl::StatusOr<attnd::v1::GetStatsResponse> Client::GetStats() {
  auto context = NewContext();
  attnd::v1::GetStatsResponse response;
  RETURN_IF_ERROR(FromGrpcStatus(stub_->GetStats(context.get(), {}, &response)));
  return response;
}

absl::StatusOr<HealthStatus> Client::CheckHealth(std::string_view service) {
  auto context = NewContext();
  grpc::health::v1::HealthCheckRequest request;
  request.set_service(std::string(service));
  grpc::health::v1::HealthCheckResponse response;
  RETURN_IF_ERROR(FromGrpcStatus(health_stub_->Check(context.get(), request, &response)));
  return response.status();
}

}  // namespace attnd::client
