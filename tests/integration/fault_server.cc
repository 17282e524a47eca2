#include "fault_server.h"

#include <grpcpp/grpcpp.h>
#include <prometheus/metric_family.h>
#include <prometheus/registry.h>

#include <span>

#include "absl/strings/str_cat.h"
#include "attnd/status_macros.h"
#include "backend/cpu_backend.h"
#include "metrics/metrics.h"
#include "service/attention_service.h"
#include "service/auth.h"
#include "test_server.h"

namespace attnd::integration {

struct FaultServer::Parts {
  std::unique_ptr<Metrics> metrics;
  std::unique_ptr<Backend> backend;
  std::unique_ptr<Authenticator> auth;
  std::unique_ptr<Engine> engine;
  std::unique_ptr<AttentionService> service;
  std::unique_ptr<grpc::Server> server;
};

FaultServer::FaultServer() : parts_(std::make_unique<Parts>()) { PinGrpcCallbackQueue(); }

FaultServer::~FaultServer() {
  if (parts_->server != nullptr) {
    parts_->server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  }
  // As in server.cc: the engine aborts what is open and waits for running layers.
  parts_->engine.reset();
}

absl::StatusOr<std::unique_ptr<FaultServer>> FaultServer::Start(
    const FaultServerOptions& options) {
  std::unique_ptr<FaultServer> server(new FaultServer());
  Parts& parts = *server->parts_;
  parts.metrics = std::make_unique<Metrics>(Metrics::BuildInfo{"fault-test", "cpu", "cpu"});
  CpuBackendOptions backend_options;
  backend_options.kv_budget_bytes = options.kv_budget_bytes;
  backend_options.observer = parts.metrics.get();
  parts.backend = MakeCpuBackend(backend_options);
  AuthOptions auth_options;
  auth_options.token_file = options.token_file;
  ASSIGN_OR_RETURN(parts.auth, Authenticator::Create(auth_options));
  EngineOptions engine_options;
  engine_options.step_ttl = options.step_ttl;
  engine_options.limits.max_open_steps_per_tenant = options.max_open_steps_per_tenant;
  parts.engine = std::make_unique<Engine>(engine_options, parts.backend.get(), parts.metrics.get());

  ServiceContext context;
  context.engine = parts.engine.get();
  context.backend = parts.backend.get();
  context.metrics = parts.metrics.get();
  context.auth = parts.auth.get();
  context.version = "fault-test";
  context.limits = engine_options.limits;
  context.step_ttl = options.step_ttl;
  parts.service = std::make_unique<AttentionService>(context);

  grpc::ServerBuilder builder;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &server->port_);
  builder.SetMaxReceiveMessageSize(64 << 20);
  builder.SetMaxSendMessageSize(64 << 20);
  builder.RegisterService(parts.service.get());
  parts.server = builder.BuildAndStart();
  if (parts.server == nullptr || server->port_ == 0) {
    return absl::UnavailableError("fault server: cannot listen on 127.0.0.1");
  }
  server->engine_ = parts.engine.get();
  server->backend_ = parts.backend.get();
  return server;
}

std::string FaultServer::address() const { return absl::StrCat("127.0.0.1:", port_); }

std::pair<double, double> FaultServer::PageGauges(const std::string& cache) const {
  double used = -1, free = -1;
  for (const prometheus::MetricFamily& family : parts_->metrics->registry()->Collect()) {
    if (family.name != "attnd_kv_pages") continue;
    for (const prometheus::ClientMetric& metric : family.metric) {
      std::string cache_label, state;
      for (const prometheus::ClientMetric::Label& label : metric.label) {
        if (label.name == "cache") cache_label = label.value;
        if (label.name == "state") state = label.value;
      }
      if (cache_label != cache) continue;
      if (state == "used") used = metric.gauge.value;
      if (state == "free") free = metric.gauge.value;
    }
  }
  return {used, free};
}

std::unique_ptr<client::Client> FaultServer::NewClient(const std::string& token) const {
  client::ClientOptions options;
  options.address = address();
  options.timeout = absl::Seconds(60);
  options.bearer_token = token;
  auto made = client::Client::Connect(options);
  return made.ok() ? *std::move(made) : nullptr;
}

absl::StatusOr<PoolBytes> ReadPools(const Engine& engine, const std::string& cache) {
  ASSIGN_OR_RETURN(const CacheStatus status, engine.GetCache(cache));
  PoolBytes bytes;
  bytes.geometry = status.spec.geometry;
  const CacheGeometry& g = bytes.geometry;
  for (int32_t layer = 0; layer < g.num_layers; ++layer) {
    for (const bool v_pool : {false, true}) {
      const int64_t page_bytes = v_pool ? g.VPageBytes() : g.KPageBytes();
      std::string& pool = bytes.pools.emplace_back(g.num_pages * page_bytes, '\0');
      RETURN_IF_ERROR(engine.ReadPages(
          cache, layer, v_pool, 0,
          std::span<uint8_t>(reinterpret_cast<uint8_t*>(pool.data()), pool.size())));
    }
  }
  return bytes;
}

namespace {

// The slot of byte `offset` of a pool: (page, offset in page).
std::pair<int64_t, int32_t> SlotOf(const CacheGeometry& g, bool v_pool, int64_t offset) {
  const int64_t head_dim = v_pool ? g.v_head_dim : g.k_head_dim;
  const int64_t element = DTypeBytes(g.kv_dtype);
  const int64_t page_bytes = v_pool ? g.VPageBytes() : g.KPageBytes();
  const int64_t within = offset % page_bytes;
  // NHD: [token][head][dim]; HND: [head][token][dim].
  const int64_t slot = g.layout == KvLayout::kNHD ? within / (g.num_kv_heads * head_dim * element)
                                                  : (within / (head_dim * element)) % g.page_size;
  return {offset / page_bytes, static_cast<int32_t>(slot)};
}

}  // namespace

std::set<Slot> ChangedSlots(const PoolBytes& before, const PoolBytes& after) {
  std::set<Slot> changed;
  for (size_t index = 0; index < before.pools.size() && index < after.pools.size(); ++index) {
    const std::string& a = before.pools[index];
    const std::string& b = after.pools[index];
    if (a == b) continue;
    for (size_t offset = 0; offset < a.size() && offset < b.size(); ++offset) {
      if (a[offset] == b[offset]) continue;
      const auto [page, slot] = SlotOf(after.geometry, index % 2 == 1, static_cast<int64_t>(offset));
      changed.insert({index, page, slot});
    }
  }
  return changed;
}

std::set<Slot> NonZeroSlots(const PoolBytes& pools) {
  std::set<Slot> slots;
  for (size_t index = 0; index < pools.pools.size(); ++index) {
    const std::string& pool = pools.pools[index];
    for (size_t offset = 0; offset < pool.size(); ++offset) {
      if (pool[offset] == 0) continue;
      const auto [page, slot] = SlotOf(pools.geometry, index % 2 == 1, static_cast<int64_t>(offset));
      slots.insert({index, page, slot});
    }
  }
  return slots;
}

}  // namespace attnd::integration
