// hot_path_bench: where a Forward's time goes between the wire and the kernel.
//
// Starts the service in-process on a loopback port (gRPC over TCP, as attnd does) over a chosen
// backend, drives it with the client library (unary calls or one ForwardStream), attaches a
// LayerTrace to every Forward (backend/layer_trace.h), and prints, per stage, the median and p99
// of the time spent there. Client and server share one steady clock, so the wire segments
// (client send -> handler, write start -> client callback) are measured directly.
//
// Backends: "null" copies inputs into and outputs out of staging buffers the way the CUDA
// backend does and computes nothing (the daemon's own overhead on any machine); "cpu" is the
// reference backend; "cuda" the GPU one (in builds with CUDA).
//
//   hot_path_bench --backend=null --sequences=128 --layers=4 --steps=50 [--stream --window=2]
#include <algorithm>
#include <array>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <map>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/match.h"
#include "attnd/client/client.h"
#include "backend/backend_factory.h"
#include "backend/cpu_backend.h"
#include "engine/engine.h"
#include "service/attention_service.h"
#include "service/auth.h"

ABSL_FLAG(std::string, backend, "null", "null, cpu or cuda");
ABSL_FLAG(int32_t, sequences, 128, "decode sequences per step");
ABSL_FLAG(int32_t, layers, 4, "layers of the cache");
ABSL_FLAG(int32_t, steps, 50, "timed decode steps");
ABSL_FLAG(int32_t, warmup_steps, 5, "untimed decode steps first");
ABSL_FLAG(int32_t, prompt_tokens, 64, "tokens prefilled per sequence before timing");
ABSL_FLAG(int32_t, qo_heads, 32, "query heads");
ABSL_FLAG(int32_t, kv_heads, 8, "K/V heads");
ABSL_FLAG(int32_t, head_dim, 128, "head width");
ABSL_FLAG(bool, stream, false, "ForwardStream instead of unary Forward calls");
ABSL_FLAG(int32_t, window, 1, "layers in flight");
ABSL_FLAG(std::string, channel_args, "",
          "comma-separated name=int gRPC channel arguments set on both server and client "
          "(e.g. grpc.http2.lookahead_bytes=16777216)");
ABSL_FLAG(std::string, listen, "127.0.0.1:0",
          "server address: host:port (port 0 picks one) or unix:/path (a Unix socket)");
ABSL_FLAG(bool, raw_client, true,
          "zero-copy client calls (Step::ForwardRaw) instead of ForwardRequest messages");

namespace attnd {
namespace {

// ---- a backend that only moves bytes -----------------------------------------------------------

class NullStep final : public BackendStep {
 public:
  NullStep(std::shared_ptr<const StepBatch> batch, const CacheGeometry& g)
      : batch_(std::move(batch)) {
    const int64_t t = batch_->num_tokens;
    const int64_t e = DTypeBytes(g.q_dtype);
    q_bytes_ = t * g.num_qo_heads * g.k_head_dim * e;
    kv_bytes_ = t * g.num_kv_heads * g.k_head_dim * e;
    o_bytes_ = t * g.num_qo_heads * g.v_head_dim * e;
  }
  std::string_view KernelName() const override { return "decode"; }
  void RunLayer(const LayerIo& io, DoneCallback done) override;

  int64_t q_bytes_, kv_bytes_, o_bytes_;
  std::shared_ptr<const StepBatch> batch_;
};

// One worker thread stands in for the CUDA backend's completion thread; staging buffers are
// reused (as pinned staging is).
class NullBackend final : public Backend, public BackendCache {
 public:
  NullBackend() : worker_([this] { Loop(); }) {}
  ~NullBackend() override {
    {
      std::lock_guard lock(mu_);
      stopping_ = true;
    }
    cv_.notify_all();
    worker_.join();
  }
  BackendInfo Info() const override {
    BackendInfo info;
    info.name = "null";
    info.device = "none";
    return info;
  }
  int64_t KvFreeBytes() const override { return int64_t{1} << 40; }
  absl::StatusOr<std::unique_ptr<BackendCache>> CreateCache(const CacheGeometry& g, int32_t /*device*/) override {
    geometry_ = g;
    return std::unique_ptr<BackendCache>(new CacheRef(this));
  }
  const CacheGeometry& geometry() const override { return geometry_; }
  absl::StatusOr<std::unique_ptr<BackendStep>> PrepareStep(
      std::shared_ptr<const StepBatch> batch) override {
    return std::make_unique<NullStep>(std::move(batch), geometry_);
  }
  absl::Status ReadPages(int32_t, bool, int64_t, std::span<uint8_t>) override {
    return absl::UnimplementedError("null backend");
  }

  void Post(std::function<void()> task) {
    {
      std::lock_guard lock(mu_);
      tasks_.push_back(std::move(task));
    }
    cv_.notify_one();
  }
  std::vector<uint8_t>& staging_in() { return staging_in_; }
  std::vector<uint8_t>& staging_out() { return staging_out_; }

 private:
  // The engine owns its BackendCache; this one forwards to the backend.
  class CacheRef final : public BackendCache {
   public:
    explicit CacheRef(NullBackend* backend) : backend_(backend) {}
    const CacheGeometry& geometry() const override { return backend_->geometry(); }
    absl::StatusOr<std::unique_ptr<BackendStep>> PrepareStep(
        std::shared_ptr<const StepBatch> batch) override {
      return backend_->PrepareStep(std::move(batch));
    }
    absl::Status ReadPages(int32_t l, bool v, int64_t p, std::span<uint8_t> b) override {
      return backend_->ReadPages(l, v, p, b);
    }

   private:
    NullBackend* backend_;
  };

  void Loop() {
    for (;;) {
      std::function<void()> task;
      {
        std::unique_lock lock(mu_);
        cv_.wait(lock, [&] { return stopping_ || !tasks_.empty(); });
        if (tasks_.empty()) return;
        task = std::move(tasks_.front());
        tasks_.erase(tasks_.begin());
      }
      task();
    }
  }

  CacheGeometry geometry_;
  std::vector<uint8_t> staging_in_, staging_out_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::function<void()>> tasks_;
  bool stopping_ = false;
  std::thread worker_;
};

NullBackend* g_null_backend = nullptr;

void NullStep::RunLayer(const LayerIo& io, DoneCallback done) {
  g_null_backend->Post([this, io, done = std::move(done)] {
    std::vector<uint8_t>& in = g_null_backend->staging_in();
    std::vector<uint8_t>& out = g_null_backend->staging_out();
    if (in.size() < static_cast<size_t>(q_bytes_ + 2 * kv_bytes_)) in.resize(q_bytes_ + 2 * kv_bytes_);
    if (out.size() < static_cast<size_t>(o_bytes_)) out.resize(o_bytes_, 0);
    if (q_bytes_ > 0) {
      LayerIo::Input(io.q, io.q_bytes).CopyTo(in.data(), q_bytes_);
      LayerIo::Input(io.k, io.k_bytes).CopyTo(in.data() + q_bytes_, kv_bytes_);
      LayerIo::Input(io.v, io.v_bytes).CopyTo(in.data() + q_bytes_ + kv_bytes_, kv_bytes_);
    }
    MarkStage(io.trace, LayerTrace::kStaged);
    MarkStage(io.trace, LayerTrace::kEnqueued);
    MarkStage(io.trace, LayerTrace::kDeviceDone);
    if (io.o != nullptr) {
      if (o_bytes_ > 0) std::memcpy(io.o, out.data(), o_bytes_);
    } else if (io.lease != nullptr) {
      // Lent as the CUDA backend lends its pinned buffer (one buffer: the bytes are not checked).
      io.lease->o = out.data();
      io.lease->release = [](void*) {};
    }
    MarkStage(io.trace, LayerTrace::kCopiedOut);
    done(absl::OkStatus());
  });
}

// ---- traces ------------------------------------------------------------------------------------

class TraceCollector final : public LayerTraceSink {
 public:
  void Record(const LayerTrace& trace) override {
    std::lock_guard lock(mu_);
    if (enabled_) server_[{trace.step_id, trace.layer}] = trace;
  }
  void RecordClient(uint64_t step, int32_t layer, int64_t sent, int64_t received) {
    std::lock_guard lock(mu_);
    if (enabled_) client_[{step, layer}] = {sent, received};
  }
  void Enable(bool on) {
    std::lock_guard lock(mu_);
    enabled_ = on;
  }
  void Print() {
    std::lock_guard lock(mu_);
    struct Segment {
      const char* name;
      std::vector<double> us;
    };
    using S = LayerTrace;
    std::vector<Segment> segments = {{"client send -> handler (serialise, wire, parse)", {}},
                                     {"decode request fields", {}},
                                     {"engine validation", {}},
                                     {"backend staging (inputs -> staging)", {}},
                                     {"enqueue device work", {}},
                                     {"device: H2D + kernels + D2H + wake-up", {}},
                                     {"copy outputs out of staging", {}},
                                     {"completion -> response built", {}},
                                     {"response built -> handed to gRPC", {}},
                                     {"write start -> client callback", {}},
                                     {"round trip (client)", {}}};
    for (const auto& [key, c] : client_) {
      auto it = server_.find(key);
      if (it == server_.end()) continue;
      const auto& t = it->second.ns;
      const int64_t points[] = {c.first,           t[S::kReceived],   t[S::kDecoded],
                                t[S::kValidated],  t[S::kStaged],     t[S::kEnqueued],
                                t[S::kDeviceDone], t[S::kCopiedOut],  t[S::kEncoded],
                                t[S::kWriteStarted], c.second};
      for (size_t i = 0; i + 1 < std::size(points); ++i) {
        segments[i].us.push_back((points[i + 1] - points[i]) / 1e3);
      }
      segments.back().us.push_back((c.second - c.first) / 1e3);
    }
    absl::PrintF("%-50s %10s %10s %10s  (n=%d)\n", "stage", "p50 us", "p90 us", "p99 us",
                 segments.back().us.size());
    for (Segment& s : segments) {
      if (s.us.empty()) continue;
      std::sort(s.us.begin(), s.us.end());
      auto pct = [&](double p) {
        return s.us[std::min(s.us.size() - 1, static_cast<size_t>(p / 100.0 * s.us.size()))];
      };
      absl::PrintF("%-50s %10.1f %10.1f %10.1f\n", s.name, pct(50), pct(90), pct(99));
    }
  }

 private:
  std::mutex mu_;
  bool enabled_ = false;
  std::map<std::pair<uint64_t, int32_t>, LayerTrace> server_;
  std::map<std::pair<uint64_t, int32_t>, std::pair<int64_t, int64_t>> client_;
};

v1::Tensor RandomBf16(std::mt19937& rng, std::vector<int64_t> shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  std::normal_distribution<float> normal;
  std::string bytes(n * 2, '\0');
  for (int64_t i = 0; i < n; ++i) {
    const float f = normal(rng);
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    const uint16_t half = static_cast<uint16_t>(bits >> 16);
    std::memcpy(&bytes[i * 2], &half, 2);
  }
  v1::Tensor t;
  t.set_dtype(v1::DTYPE_BFLOAT16);
  for (int64_t d : shape) t.add_shape(d);
  t.set_data(std::move(bytes));
  return t;
}

int Main() {
  const std::string backend_name = absl::GetFlag(FLAGS_backend);
  std::unique_ptr<Backend> backend;
  if (backend_name == "null") {
    auto null_backend = std::make_unique<NullBackend>();
    g_null_backend = null_backend.get();
    backend = std::move(null_backend);
  } else {
    BackendFactoryOptions options;
    options.kind = backend_name == "cuda" ? BackendKind::kCuda : BackendKind::kCpu;
    options.kv_memory_bytes = int64_t{4} << 30;
    auto made = MakeBackend(options);
    if (!made.ok()) {
      absl::FPrintF(stderr, "backend: %s\n", made.status().ToString());
      return 1;
    }
    backend = *std::move(made);
  }
  EngineOptions engine_options;
  Engine engine(engine_options, backend.get(), nullptr);
  auto auth = Authenticator::Create({});
  if (!auth.ok()) return 1;
  TraceCollector traces;
  ServiceContext context;
  context.engine = &engine;
  context.backend = backend.get();
  context.auth = auth->get();
  context.version = "bench";
  context.limits = engine_options.limits;
  context.step_ttl = engine_options.step_ttl;
  context.trace_sink = &traces;
  AttentionService service(context);
  int port = 0;
  grpc::ServerBuilder builder;
  const std::string listen = absl::GetFlag(FLAGS_listen);
  builder.AddListeningPort(listen, grpc::InsecureServerCredentials(), &port);
  builder.SetMaxReceiveMessageSize(512 << 20);
  builder.SetMaxSendMessageSize(512 << 20);
  std::vector<std::pair<std::string, int>> channel_args;
  for (absl::string_view arg : absl::StrSplit(absl::GetFlag(FLAGS_channel_args), ',',
                                              absl::SkipEmpty())) {
    std::pair<std::string, std::string> kv = absl::StrSplit(arg, absl::MaxSplits('=', 1));
    int value = 0;
    if (!absl::SimpleAtoi(kv.second, &value)) return 2;
    channel_args.emplace_back(kv.first, value);
    builder.AddChannelArgument(kv.first, value);
  }
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr) return 1;

  client::ClientOptions client_options;
  client_options.address = absl::StartsWith(listen, "unix:")
                               ? listen
                               : absl::StrCat(listen.substr(0, listen.rfind(':')), ":", port);
  grpc::ChannelArguments arguments;
  arguments.SetMaxReceiveMessageSize(512 << 20);
  arguments.SetMaxSendMessageSize(512 << 20);
  for (const auto& [name, value] : channel_args) arguments.SetInt(name, value);
  auto client = std::make_unique<client::Client>(
      grpc::CreateCustomChannel(client_options.address, grpc::InsecureChannelCredentials(),
                                arguments),
      client_options);

  const int32_t sequences = absl::GetFlag(FLAGS_sequences);
  const int32_t layers = absl::GetFlag(FLAGS_layers);
  const int32_t steps = absl::GetFlag(FLAGS_steps);
  const int32_t warmup = absl::GetFlag(FLAGS_warmup_steps);
  const int32_t prompt = absl::GetFlag(FLAGS_prompt_tokens);
  const int32_t hq = absl::GetFlag(FLAGS_qo_heads);
  const int32_t hkv = absl::GetFlag(FLAGS_kv_heads);
  const int32_t dim = absl::GetFlag(FLAGS_head_dim);
  const int32_t window = std::max(1, absl::GetFlag(FLAGS_window));
  v1::CacheConfig config;
  config.set_num_layers(layers);
  config.set_num_qo_heads(hq);
  config.set_num_kv_heads(hkv);
  config.set_head_dim(dim);
  config.set_page_size(16);
  config.mutable_rope()->set_style(v1::ROPE_STYLE_NEOX);
  config.set_num_pages(sequences * ((prompt + warmup + steps + 15) / 16 + 1));
  auto cache = client->CreateCache("bench", config);
  if (!cache.ok()) {
    absl::FPrintF(stderr, "create cache: %s\n", cache.status().ToString());
    return 1;
  }
  std::unique_ptr<client::StreamSession> session;
  if (absl::GetFlag(FLAGS_stream)) {
    auto opened = client->OpenStream({.window = std::max(window, 2)});
    if (!opened.ok()) return 1;
    session = *std::move(opened);
  }

  std::mt19937 rng(1);
  std::map<int64_t, v1::ForwardRequest> payloads;
  auto payload = [&](int64_t rows) -> const v1::ForwardRequest& {
    auto it = payloads.find(rows);
    if (it != payloads.end()) return it->second;
    v1::ForwardRequest request;
    *request.mutable_q() = RandomBf16(rng, {rows, hq, dim});
    *request.mutable_k() = RandomBf16(rng, {rows, hkv, dim});
    *request.mutable_v() = RandomBf16(rng, {rows, hkv, dim});
    return payloads.emplace(rows, std::move(request)).first->second;
  };
  const bool raw_client = absl::GetFlag(FLAGS_raw_client);
  // Output buffers of the zero-copy client, one per layer in flight, reused.
  std::vector<std::vector<uint8_t>> outputs(layers);

  auto run_step = [&](int32_t new_tokens, bool timed) -> bool {
    v1::PlanRequest plan;
    plan.set_cache("bench");
    for (int32_t i = 0; i < sequences; ++i) {
      v1::PlanEntry* entry = plan.add_entries();
      entry->set_sequence_id(i + 1);
      entry->set_num_new_tokens(new_tokens);
    }
    auto step = session ? session->BeginStep(plan) : client->BeginStep(plan);
    if (!step.ok()) {
      absl::FPrintF(stderr, "plan: %s\n", step.status().ToString());
      return false;
    }
    const v1::ForwardRequest& base = payload((*step)->num_tokens());
    std::mutex mu;
    std::condition_variable cv;
    int in_flight = 0;
    bool failed = false;
    for (int32_t layer = 0; layer < layers; ++layer) {
      {
        std::unique_lock lock(mu);
        cv.wait(lock, [&] { return in_flight < window; });
        ++in_flight;
      }
      const uint64_t step_id = (*step)->id();
      auto finish = [&, step_id, layer, timed](const absl::Status& status, int64_t sent) {
        const int64_t received = LayerTrace::NowNs();
        if (timed) traces.RecordClient(step_id, layer, sent, received);
        std::lock_guard lock(mu);
        if (!status.ok()) {
          absl::FPrintF(stderr, "forward: %s\n", status.ToString());
          failed = true;
        }
        --in_flight;
        cv.notify_all();
      };
      if (raw_client) {
        const int64_t rows = (*step)->num_tokens();
        const int64_t q_shape[] = {rows, hq, dim};
        const int64_t kv_shape[] = {rows, hkv, dim};
        auto view = [](const v1::Tensor& t, std::span<const int64_t> shape) {
          client::TensorView v;
          v.dtype = t.dtype();
          v.shape = shape;
          v.bytes = {reinterpret_cast<const uint8_t*>(t.data().data()), t.data().size()};
          return v;
        };
        std::vector<uint8_t>& o = outputs[layer];
        o.resize(base.q().data().size());
        client::ForwardOutputBuffers out;
        out.o = o;
        const int64_t sent = LayerTrace::NowNs();
        (*step)->ForwardRaw(layer, view(base.q(), q_shape), view(base.k(), kv_shape),
                            view(base.v(), kv_shape), out,
                            [finish, sent](absl::StatusOr<client::ForwardOutcome> result) {
                              finish(result.status(), sent);
                            });
      } else {
        v1::ForwardRequest request = base;
        request.set_layer(layer);
        const int64_t sent = LayerTrace::NowNs();
        (*step)->ForwardAsync(std::move(request), [finish, sent](client::ForwardResult result) {
          finish(result.status(), sent);
        });
      }
    }
    std::unique_lock lock(mu);
    cv.wait(lock, [&] { return in_flight == 0; });
    return !failed;
  };

  if (!run_step(prompt, false)) return 1;
  for (int32_t s = 0; s < warmup; ++s) {
    if (!run_step(1, false)) return 1;
  }
  traces.Enable(true);
  const int64_t start = LayerTrace::NowNs();
  for (int32_t s = 0; s < steps; ++s) {
    if (!run_step(1, true)) return 1;
  }
  const double seconds = (LayerTrace::NowNs() - start) / 1e9;
  traces.Enable(false);
  absl::PrintF("hot_path_bench: backend %s, %d sequences x %d layers (Hq %d, Hkv %d, D %d, bf16), "
               "%s, window %d, %s client: %.1f steps/s\n",
               backend_name, sequences, layers, hq, hkv, dim,
               session ? "ForwardStream" : "unary", window,
               raw_client ? "zero-copy" : "proto", steps / seconds);
  traces.Print();
  if (session) (void)session->Close();
  session.reset();
  client.reset();
  server->Shutdown();
  return 0;
}

}  // namespace
}  // namespace attnd

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return attnd::Main();
}
