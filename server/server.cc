#include "server.h"

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <prometheus/exposer.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <limits>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "attnd/status_macros.h"
#include <prometheus/registry.h>
#include "absl/synchronization/mutex.h"
#include "backend/backend_factory.h"
#include "engine/engine.h"
#include "metrics/metrics.h"
#include "service/attention_service.h"
#include "service/auth.h"
#include "service/health_service.h"
#include "util/log.h"

#ifndef ATTND_VERSION
#define ATTND_VERSION "0.0.0"
#endif

namespace attnd {
namespace {

// Splits "host:port" and reports the port actually bound by the exposer.
int ExposerPort(const prometheus::Exposer& exposer) {
  const std::vector<int> ports = exposer.GetListeningPorts();
  return ports.empty() ? 0 : ports.front();
}

int ClampToInt(int64_t value) {
  return static_cast<int>(std::clamp<int64_t>(value, 0, std::numeric_limits<int>::max()));
}

absl::StatusOr<std::string> ReadPemFile(absl::string_view flag, const std::string& path) {
  std::ifstream file(path, std::ios::binary);
  if (!file) {
    return absl::NotFoundError(absl::StrCat("--", flag, "=", path, ": cannot open: ",
                                            std::strerror(errno)));
  }
  std::ostringstream contents;
  contents << file.rdbuf();
  if (!absl::StrContains(contents.str(), "-----BEGIN ")) {
    return absl::InvalidArgumentError(
        absl::StrCat("--", flag, "=", path, ": expected PEM (-----BEGIN ...), got none"));
  }
  return contents.str();
}

// The gRPC port's credentials, and a line for the log saying which they are.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeCredentials(
    const TlsServerOptions& tls, std::string& description) {
  if (tls.cert_file.empty() && tls.key_file.empty()) {
    if (!tls.client_ca_file.empty()) {
      return absl::InvalidArgumentError(
          "--tls_client_ca: mutual TLS needs TLS: set --tls_cert and --tls_key too");
    }
    description = "plaintext (no --tls_cert)";
    return grpc::InsecureServerCredentials();
  }
  if (tls.cert_file.empty() || tls.key_file.empty()) {
    return absl::InvalidArgumentError("--tls_cert and --tls_key: set both or neither");
  }
  grpc::SslServerCredentialsOptions ssl(GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  grpc::SslServerCredentialsOptions::PemKeyCertPair pair;
  ASSIGN_OR_RETURN(pair.cert_chain, ReadPemFile("tls_cert", tls.cert_file));
  ASSIGN_OR_RETURN(pair.private_key, ReadPemFile("tls_key", tls.key_file));
  ssl.pem_key_cert_pairs.push_back(std::move(pair));
  description = absl::StrCat("TLS (", tls.cert_file, ")");
  if (!tls.client_ca_file.empty()) {
    ASSIGN_OR_RETURN(ssl.pem_root_certs, ReadPemFile("tls_client_ca", tls.client_ca_file));
    ssl.client_certificate_request = GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY;
    description = absl::StrCat("mutual TLS (", tls.cert_file, "; clients verified against ",
                               tls.client_ca_file, ")");
  }
  return grpc::SslServerCredentials(ssl);
}

// The metrics family needs the backend's name, the backend needs the metrics as its observer:
// this forwards to the metrics once they exist.
class ObserverRelay final : public BackendObserver {
 public:
  void Set(BackendObserver* target) { target_ = target; }
  void OnKernel(std::string_view kernel, std::string_view phase, double seconds,
                int32_t device) override {
    if (BackendObserver* target = target_.load()) target->OnKernel(kernel, phase, seconds, device);
  }
  void OnTransfer(std::string_view direction, int64_t bytes, int32_t device) override {
    if (BackendObserver* target = target_.load()) target->OnTransfer(direction, bytes, device);
  }

 private:
  std::atomic<BackendObserver*> target_{nullptr};
};

class ServerImpl final : public Server {
 public:
  explicit ServerImpl(const ServerOptions& options) : options_(options) {}

  ~ServerImpl() override {
    Shutdown();
    Wait();
  }

  absl::Status Init() {
    BackendFactoryOptions backend_options;
    backend_options.kind = options_.backend;
    backend_options.devices = options_.devices;
    backend_options.kv_memory_bytes = options_.kv_memory_bytes;
    backend_options.kv_memory_fraction = options_.kv_memory_fraction;
    backend_options.observer = &relay_;
    backend_options.pod_mode = options_.pod_mode;
    backend_options.decode_kernel = options_.decode_kernel;
    backend_options.cuda_completion_wait = options_.cuda_completion_wait;
    backend_options.channel_timing_stride = options_.channel_kernel_timing;
    backend_options.channel_done_by_kernel = options_.channel_done_by_kernel;
    backend_options.host_shm_parts = options_.host_shm_parts;
    backend_options.nccl_init_timeout = options_.nccl_init_timeout;
    ASSIGN_OR_RETURN(backend_, MakeBackend(backend_options));
    const BackendInfo info = backend_->Info();

    AuthOptions auth_options;
    auth_options.token_file = options_.token_file;
    auth_options.default_page_quota = options_.tenant_page_quota;
    ASSIGN_OR_RETURN(auth_, Authenticator::Create(auth_options));
    std::string transport;
    ASSIGN_OR_RETURN(const std::shared_ptr<grpc::ServerCredentials> credentials,
                     MakeCredentials(options_.tls, transport));

    const bool cache_labels = options_.metrics_cache_labels.value_or(!auth_->enabled());
    metrics_ = std::make_unique<Metrics>(
        Metrics::BuildInfo{ATTND_VERSION, info.name, info.device}, cache_labels);
    relay_.Set(metrics_.get());

    EngineOptions engine_options;
    engine_options.limits = options_.limits;
    engine_options.step_ttl = options_.step_ttl;
    engine_ = std::make_unique<Engine>(engine_options, backend_.get(), metrics_.get());

    ServiceContext context;
    context.engine = engine_.get();
    context.backend = backend_.get();
    context.metrics = metrics_.get();
    context.auth = auth_.get();
    context.version = ATTND_VERSION;
    context.limits = options_.limits;
    context.step_ttl = options_.step_ttl;
    attention_ = std::make_unique<AttentionService>(context);
    health_ = std::make_unique<HealthService>();

    if (!options_.metrics_address.empty()) {
      try {
        exposer_ = std::make_unique<prometheus::Exposer>(options_.metrics_address);
      } catch (const std::exception& e) {
        return absl::UnavailableError(absl::StrCat("--metrics_address=", options_.metrics_address,
                                                   ": cannot listen: ", e.what()));
      }
      exposer_->RegisterCollectable(
          std::static_pointer_cast<prometheus::Collectable>(metrics_->registry()));
      metrics_port_ = ExposerPort(*exposer_);
    }

    grpc::reflection::InitProtoReflectionServerBuilderPlugin();
    grpc::ServerBuilder builder;
    builder.AddListeningPort(options_.listen_address, credentials, &port_);
    const int max_bytes = ClampToInt(options_.limits.max_message_bytes);
    builder.SetMaxReceiveMessageSize(max_bytes);
    builder.SetMaxSendMessageSize(max_bytes);
    builder.AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS,
                               std::max(1, options_.limits.max_streams_per_connection));
    // Keepalive: tolerate client pings down to min_ping_interval apart even without calls in
    // flight, so pooled orchestrator connections stay up (the client library pings every
    // 30 s); ping idle clients ourselves to drop dead ones.
    const KeepaliveServerOptions& keepalive = options_.keepalive;
    builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS,
                               ClampToInt(absl::ToInt64Milliseconds(keepalive.min_ping_interval)));
    builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS,
                               keepalive.permit_without_calls ? 1 : 0);
    builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS,
                               ClampToInt(absl::ToInt64Milliseconds(keepalive.time)));
    builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS,
                               ClampToInt(absl::ToInt64Milliseconds(keepalive.timeout)));
    // Without this the server stops its keepalive pings after two on an idle connection.
    builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
    builder.RegisterService(attention_.get());
    builder.RegisterService(health_.get());
    grpc_server_ = builder.BuildAndStart();
    if (grpc_server_ == nullptr || port_ == 0) {
      return absl::UnavailableError(absl::StrCat(
          "--listen_address=", options_.listen_address, ": cannot listen",
          options_.tls.cert_file.empty()
              ? ""
              : " (or --tls_cert/--tls_key are not a matching PEM certificate chain and key)"));
    }
    LogInfo(absl::StrCat("transport: ", transport));
    if (auth_->enabled()) {
      const Authenticator::Counts counts = auth_->counts();
      LogInfo(absl::StrCat("authentication: bearer tokens from ", options_.token_file, " (",
                           counts.tokens, " token(s), ", counts.tenants,
                           " tenant(s)); default page quota ",
                           options_.tenant_page_quota == 0
                               ? std::string("unlimited")
                               : absl::StrCat(options_.tenant_page_quota, " pages"),
                           "; reload with SIGHUP"));
    } else {
      LogInfo("authentication: none (no --token_file): every caller may use every cache");
    }
    LogInfo(absl::StrCat("metrics: per-cache labels ", cache_labels ? "on" : "off (cache=\"\")"));
    for (const DeviceInfo& device : info.devices) {
      LogInfo(absl::StrCat("device ", device.ordinal, ": ", device.name, ", KV budget ",
                           device.kv_budget_bytes, " bytes"));
    }
    LogInfo(absl::StrCat("serving attnd.v1.AttentionService on port ", port_, " (backend ",
                         info.name, ": ", info.device, ", KV budget ", info.kv_budget_bytes,
                         " bytes)", metrics_port_ ? absl::StrCat(", metrics on port ", metrics_port_)
                                                  : std::string()));
    return absl::OkStatus();
  }

  absl::Status ReloadTokens() override {
    absl::StatusOr<Authenticator::Counts> counts = auth_->Reload();
    if (!counts.ok()) {
      return absl::Status(counts.status().code(),
                          absl::StrCat("token file not reloaded, the previous tokens stay: ",
                                       counts.status().message()));
    }
    LogInfo(absl::StrCat("reloaded ", options_.token_file, ": ", counts->tokens, " token(s), ",
                         counts->tenants, " tenant(s)"));
    return absl::OkStatus();
  }

  int port() const override { return port_; }
  int metrics_port() const override { return metrics_port_; }
  std::string backend_name() const override { return backend_->Info().name; }

  void Shutdown() override {
    {
      absl::MutexLock lock(&mu_);
      if (shutting_down_) return;
      shutting_down_ = true;
    }
    if (grpc_server_ != nullptr) {
      health_->SetStatus(HealthService::kAttentionService,
                         grpc::health::v1::HealthCheckResponse::NOT_SERVING);
      engine_->SetDraining(true);
      const absl::Time drain_deadline = absl::Now() + options_.drain_grace;
      int open = engine_->OpenSteps();
      if (open > 0) {
        LogInfo(absl::StrCat("draining: waiting up to ", absl::FormatDuration(options_.drain_grace),
                             " for ", open, " open step(s)"));
      }
      while (open > 0 && absl::Now() < drain_deadline) {
        absl::SleepFor(absl::Milliseconds(20));
        open = engine_->OpenSteps();
      }
      if (open > 0) LogInfo(absl::StrCat("drain grace over: aborting ", open, " open step(s)"));
      // Channels end their OpenChannel calls and let go of the steps waiting on their flags.
      engine_->CloseAllChannels("server shutting down");
      health_->SetStatus("", grpc::health::v1::HealthCheckResponse::NOT_SERVING);
      health_->Shutdown();
      // Each phase is logged: when a shutdown hangs, the last line says where.
      LogInfo(absl::StrCat("stopping gRPC: calls in flight get up to ",
                           absl::FormatDuration(options_.exit_grace)));
      grpc_server_->Shutdown(std::chrono::system_clock::now() +
                             absl::ToChronoMilliseconds(options_.exit_grace));
    }
    // The engine aborts what is still open and waits for running layers before it goes.
    LogInfo("stopping the engine: waiting for layers still on the device");
    engine_.reset();
    exposer_.reset();
    LogInfo("stopped");
    absl::MutexLock lock(&mu_);
    stopped_ = true;
  }

  void Wait() override {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(&stopped_));
  }

 private:
  ServerOptions options_;
  ObserverRelay relay_;
  std::unique_ptr<Backend> backend_;
  std::unique_ptr<Authenticator> auth_;
  std::unique_ptr<Metrics> metrics_;
  std::unique_ptr<Engine> engine_;
  std::unique_ptr<AttentionService> attention_;
  std::unique_ptr<HealthService> health_;
  std::unique_ptr<prometheus::Exposer> exposer_;
  std::unique_ptr<grpc::Server> grpc_server_;
  int port_ = 0;
  int metrics_port_ = 0;

  absl::Mutex mu_;
  bool shutting_down_ ABSL_GUARDED_BY(mu_) = false;
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Server>> Server::Start(const ServerOptions& options) {
  auto server = std::make_unique<ServerImpl>(options);
  const absl::Status status = server->Init();
  if (!status.ok()) {
    server->Shutdown();
    return status;
  }
  return std::unique_ptr<Server>(std::move(server));
}

}  // namespace attnd
