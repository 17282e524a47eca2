#include "server.h"

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <prometheus/exposer.h>

#include "absl/strings/str_cat.h"
#include "attnd/status_macros.h"
#include <prometheus/registry.h>
#include "absl/synchronization/mutex.h"
#include "backend/backend_factory.h"
#include "engine/engine.h"
#include "metrics/metrics.h"
#include "service/attention_service.h"
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

// The metrics family needs the backend's name, the backend needs the metrics as its observer:
// this forwards to the metrics once they exist.
class ObserverRelay final : public BackendObserver {
 public:
  void Set(BackendObserver* target) { target_ = target; }
  void OnKernel(std::string_view kernel, std::string_view phase, double seconds) override {
    if (BackendObserver* target = target_.load()) target->OnKernel(kernel, phase, seconds);
  }
  void OnTransfer(std::string_view direction, int64_t bytes) override {
    if (BackendObserver* target = target_.load()) target->OnTransfer(direction, bytes);
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
    backend_options.kv_memory_bytes = options_.kv_memory_bytes;
    backend_options.kv_memory_fraction = options_.kv_memory_fraction;
    backend_options.observer = &relay_;
    ASSIGN_OR_RETURN(backend_, MakeBackend(backend_options));
    const BackendInfo info = backend_->Info();
    metrics_ = std::make_unique<Metrics>(Metrics::BuildInfo{ATTND_VERSION, info.name, info.device});
    relay_.Set(metrics_.get());

    EngineOptions engine_options;
    engine_options.limits = options_.limits;
    engine_options.step_ttl = options_.step_ttl;
    engine_ = std::make_unique<Engine>(engine_options, backend_.get(), metrics_.get());

    ServiceContext context;
    context.engine = engine_.get();
    context.backend = backend_.get();
    context.metrics = metrics_.get();
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
    builder.AddListeningPort(options_.listen_address, grpc::InsecureServerCredentials(), &port_);
    const int max_bytes = static_cast<int>(std::min<int64_t>(options_.limits.max_message_bytes,
                                                             std::numeric_limits<int>::max()));
    builder.SetMaxReceiveMessageSize(max_bytes);
    builder.SetMaxSendMessageSize(max_bytes);
    // Keepalive: tolerate client pings every 10 s even without calls in flight, so pooled
    // orchestrator connections stay up; the client library pings at that rate.
    builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 10000);
    builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
    builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS, 60000);
    builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 20000);
    builder.RegisterService(attention_.get());
    builder.RegisterService(health_.get());
    grpc_server_ = builder.BuildAndStart();
    if (grpc_server_ == nullptr || port_ == 0) {
      return absl::UnavailableError(
          absl::StrCat("--listen_address=", options_.listen_address, ": cannot listen"));
    }
    LogInfo(absl::StrCat("serving attnd.v1.AttentionService on port ", port_, " (backend ",
                         info.name, ": ", info.device, ", KV budget ", info.kv_budget_bytes,
                         " bytes)", metrics_port_ ? absl::StrCat(", metrics on port ", metrics_port_)
                                                  : std::string()));
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
      health_->SetStatus("", grpc::health::v1::HealthCheckResponse::NOT_SERVING);
      health_->Shutdown();
      grpc_server_->Shutdown(std::chrono::system_clock::now() +
                             absl::ToChronoMilliseconds(options_.exit_grace));
    }
    // The engine aborts what is still open and waits for running layers before it goes.
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
