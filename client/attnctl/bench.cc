// attnctl bench: a load generator and the e2e benchmark of PERFORMANCE.md. N sequences are
// prefilled, then decode together for S steps of L layers each (optionally with a prefill entry
// mixed into every step), over unary calls or one ForwardStream, with several layers in flight.
// The sequences may be split into M micro-batches (M steps open at once, their layers
// interleaved), as an orchestrator pipelines them. Forwards are zero-copy (Step::ForwardRaw)
// unless --raw=false.
//
// Reported: per-layer latency (one Forward's round trip) percentiles; the kernel time of the
// timed steps from GetStats (a delta, so run it alone on the daemon); overhead = latency minus
// the mean kernel time of a Forward; steps/s and the kernels-only rate (steps per second of
// summed kernel time).
//
// SIGINT or SIGTERM ends a run early: the stream is cancelled (unary calls in flight finish),
// what was measured so far is printed (RESULT ... interrupted=1), the cache is deleted, and the
// exit code is 128 + the signal's number. A second signal exits at once.
#include <string.h>
#include <unistd.h>

#include <algorithm>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "attnd/kernels/dtype.h"
#include "cache_flags.h"
#include "channel_bench.h"
#include "commands.h"
#include "global_flags.h"
#include "interrupt_watch.h"
#include "latency.h"
#include "printing.h"
#include "progress_bar.h"
#include "random_tensors.h"

ABSL_FLAG(int32_t, sequences, 8, "bench: sequences decoding together (batch size)");
ABSL_FLAG(int32_t, steps, 32, "bench: timed decode steps");
ABSL_FLAG(int32_t, prompt_tokens, 64, "bench: tokens prefilled per sequence before timing");
ABSL_FLAG(int32_t, prefill_tokens, 0,
          "bench: when > 0, every timed step also prefills this many tokens of a new sequence");
ABSL_FLAG(int32_t, window, 0,
          "bench: Forward calls in flight per step (0: all layers with --stream, 1 without)");
ABSL_FLAG(std::string, cache, "",
          "bench: run on this existing cache instead of creating (and deleting) one");
ABSL_FLAG(int32_t, micro_batches, 1,
          "bench: split the sequences into this many steps run together, layers interleaved");
ABSL_FLAG(int32_t, warmup_steps, 2, "bench: untimed decode steps before the timed ones");
ABSL_FLAG(std::string, transport, "grpc",
          "bench: grpc (Forward messages), shm (a HOST_SHM channel; attnd on this host), "
          "cuda_ipc (a CUDA_IPC channel; attnd on this host's GPU, or a peer of the client's) or "
          "nccl (an NCCL channel; the client on another GPU than attnd's, or another host), see "
          "channel_bench.cc");
ABSL_FLAG(int32_t, client_device, -1,
          "bench (cuda_ipc, nccl): the GPU (this process's CUDA ordinal) the client opens the "
          "channel from and runs its stream and emulator kernel on; another GPU than attnd's "
          "is the peer case. -1: the current one (0)");
ABSL_FLAG(bool, raw, true,
          "bench: zero-copy forwards (q/k/v from the bench's memory, o into it); false: "
          "ForwardRequest messages");

namespace attnd::attnctl {
namespace {

struct BenchSettings {
  int32_t sequences = 0;
  int32_t steps = 0;
  int32_t warmup_steps = 0;
  int32_t prompt_tokens = 0;
  int32_t prefill_tokens = 0;
  int32_t micro_batches = 1;
  int32_t window = 1;
  bool stream = false;
  bool raw = true;
};

// What one step's entries are: (sequence id, new tokens).
using Entries = std::vector<std::pair<uint64_t, int32_t>>;

// Sum of the kernel seconds and launches GetStats reports.
struct KernelTotal {
  double seconds = 0;
  int64_t count = 0;
};

KernelTotal SumKernels(const attnd::v1::GetStatsResponse& stats) {
  KernelTotal total;
  for (const attnd::v1::KernelStats& kernel : stats.kernels()) {
    total.seconds += kernel.total_seconds();
    total.count += kernel.count();
  }
  return total;
}

class Bench {
 public:
  Bench(client::Client& client, attnd::v1::CacheInfo cache, BenchSettings settings,
        uint64_t first_sequence_id, const InterruptWatch& interrupts)
      : client_(client),
        cache_(std::move(cache)),
        settings_(settings),
        first_id_(first_sequence_id),
        interrupts_(interrupts),
        rng_(absl::GetFlag(FLAGS_seed)) {}

  // From the interrupt watch's thread: stop issuing work and cancel the stream, so that every
  // forward waiting on it fails at once. Unary calls in flight finish (or reach --timeout).
  void Interrupt() {
    std::lock_guard lock(session_mu_);
    if (session_ != nullptr) session_->Cancel();
  }

  // Returns false when the benchmark could not run at all.
  bool Run(int64_t max_step_tokens) {
    if (settings_.stream) {
      auto session = client_.OpenStream({.window = settings_.window});
      if (!session.ok()) {
        PrintError("open ForwardStream", session.status());
        return false;
      }
      std::lock_guard lock(session_mu_);
      session_ = *std::move(session);
      // A signal that came before the stream existed cancels it now.
      if (interrupted()) session_->Cancel();
    }
    if (!Prefill(max_step_tokens)) return interrupted();
    int32_t step_index = 0;
    for (int32_t s = 0; s < settings_.warmup_steps && !interrupted(); ++s) {
      if (!RunDecodeStep(step_index++, /*timed=*/false)) return interrupted();
    }

    std::optional<attnd::v1::GetStatsResponse> before;
    if (!interrupted()) {
      auto stats = client_.GetStats();
      if (stats.ok()) before = *std::move(stats);
    }
    ProgressBar progress("bench", settings_.steps);
    const absl::Time start = absl::Now();
    for (int32_t s = 0; s < settings_.steps && !interrupted(); ++s) {
      const absl::Time step_start = absl::Now();
      if (RunDecodeStep(step_index++, /*timed=*/true)) {
        step_latency_.Record(absl::Now() - step_start);
        ++steps_ok_;
        tokens_ += settings_.sequences + settings_.prefill_tokens;
      }
      progress.Update(s + 1, errors_ > 0 ? absl::StrCat(errors_, " errors") : "");
    }
    elapsed_ = absl::Now() - start;
    progress.Finish();
    // Interrupted: no more calls than the cleanup needs (the daemon may be what hangs).
    if (before.has_value() && !interrupted()) {
      auto after = client_.GetStats();
      if (after.ok()) {
        const KernelTotal b = SumKernels(*before);
        const KernelTotal a = SumKernels(*after);
        kernel_seconds_ = a.seconds - b.seconds;
        kernel_launches_ = a.count - b.count;
        have_kernels_ = true;
      }
    }
    if (session_ != nullptr) {
      absl::Status closed = session_->Close();
      if (!closed.ok() && !interrupted()) PrintError("close ForwardStream", closed);
    }
    return true;
  }

  bool interrupted() const { return interrupts_.signal() != 0; }

  void PrintSummary() {
    const double seconds = absl::ToDoubleSeconds(elapsed_);
    const int32_t layers = cache_.config().num_layers();
    const int64_t forwards = steps_ok_ * layers * settings_.micro_batches;
    absl::PrintF("\nbench on cache %s (%s)\n", cache_.name(), DescribeConfig(cache_.config()));
    absl::PrintF("  load       %d sequences x %d layers in %d micro-batch(es), %d decode steps%s, "
                 "%s, window %d, %s forwards\n",
                 settings_.sequences, layers, settings_.micro_batches, settings_.steps,
                 settings_.prefill_tokens > 0
                     ? absl::StrCat(" + a ", settings_.prefill_tokens, "-token prefill each")
                     : "",
                 settings_.stream ? "ForwardStream" : "unary RPCs", settings_.window,
                 settings_.raw ? "zero-copy" : "message");
    absl::PrintF("  prompt     %d tokens per sequence in %d step(s), %s\n",
                 settings_.prompt_tokens, prefill_steps_, FormatLatency(prefill_elapsed_));
    const double steps_per_second = seconds > 0 ? steps_ok_ / seconds : 0.0;
    absl::PrintF("  timed      %d steps ok in %.3f s: %.1f steps/s, %.0f tokens/s, "
                 "%.0f layer forwards/s\n",
                 steps_ok_, seconds, steps_per_second,
                 seconds > 0 ? static_cast<double>(tokens_) / seconds : 0.0,
                 seconds > 0 ? static_cast<double>(forwards) / seconds : 0.0);
    PrintPercentiles("layer", layer_latency_);
    PrintPercentiles("plan", plan_latency_);
    PrintPercentiles("step", step_latency_);
    double kernel_us = 0;
    double kernel_rate = 0;
    if (have_kernels_ && forwards > 0 && kernel_seconds_ > 0) {
      kernel_us = kernel_seconds_ * 1e6 / static_cast<double>(forwards);
      kernel_rate = steps_ok_ / kernel_seconds_;
      const double p50 = absl::ToDoubleMicroseconds(layer_latency_.Percentile(50));
      const double p99 = absl::ToDoubleMicroseconds(layer_latency_.Percentile(99));
      absl::PrintF("  kernels    %.1f us per layer forward (GetStats: %d launches, %.4f s); "
                   "kernels-only rate %.1f steps/s\n",
                   kernel_us, kernel_launches_, kernel_seconds_, kernel_rate);
      absl::PrintF("  overhead   p50 %.0f us  p99 %.0f us per layer (latency minus kernel time); "
                   "steps/s at %.0f%% of the kernels-only rate\n",
                   p50 - kernel_us, p99 - kernel_us, 100.0 * steps_per_second / kernel_rate);
    } else {
      absl::PrintF("  kernels    (no kernel time from GetStats)\n");
    }
    absl::PrintF("  errors     %d%s\n", errors_,
                 first_error_.ok() ? "" : absl::StrCat(" (first: ", first_error_.ToString(), ")"));
    if (interrupted()) {
      absl::PrintF("  interrupted by %s after %d of %d timed steps (kernel time not fetched)\n",
                   strsignal(interrupts_.signal()), steps_ok_, settings_.steps);
    }
    // One line for scripts.
    absl::PrintF(
        "RESULT transport=%s window=%d micro_batches=%d raw=%d sequences=%d layers=%d "
        "prefill_tokens=%d steps=%d layer_p50_us=%.1f layer_p90_us=%.1f layer_p99_us=%.1f "
        "kernel_us=%.1f overhead_p50_us=%.1f overhead_p99_us=%.1f steps_per_s=%.2f "
        "kernel_steps_per_s=%.2f plan_p50_us=%.1f errors=%d interrupted=%d\n",
        settings_.stream ? "stream" : "unary", settings_.window, settings_.micro_batches,
        settings_.raw ? 1 : 0, settings_.sequences, layers, settings_.prefill_tokens, steps_ok_,
        absl::ToDoubleMicroseconds(layer_latency_.Percentile(50)),
        absl::ToDoubleMicroseconds(layer_latency_.Percentile(90)),
        absl::ToDoubleMicroseconds(layer_latency_.Percentile(99)), kernel_us,
        absl::ToDoubleMicroseconds(layer_latency_.Percentile(50)) - kernel_us,
        absl::ToDoubleMicroseconds(layer_latency_.Percentile(99)) - kernel_us, steps_per_second,
        kernel_rate, absl::ToDoubleMicroseconds(plan_latency_.Percentile(50)), errors_,
        interrupted() ? 1 : 0);
  }

  // Frees what the benchmark created on a cache it did not create.
  void FreeSequences() {
    std::vector<uint64_t> ids = extra_ids_;
    for (int32_t i = 0; i < settings_.sequences; ++i) ids.push_back(first_id_ + i);
    auto freed = client_.FreeSequences(cache_.name(), ids);
    if (!freed.ok()) PrintError("FreeSequences", freed.status());
  }

  int64_t errors() const { return errors_; }

 private:
  static void PrintPercentiles(const char* what, LatencyRecorder& latency) {
    absl::PrintF("  %-10s p50 %s  p90 %s  p99 %s  (n=%d)\n", absl::StrCat(what, " latency"),
                 FormatLatency(latency.Percentile(50)), FormatLatency(latency.Percentile(90)),
                 FormatLatency(latency.Percentile(99)), latency.count());
  }

  bool Prefill(int64_t max_step_tokens) {
    if (settings_.prompt_tokens <= 0) return true;
    const absl::Time start = absl::Now();
    Entries entries;
    int64_t tokens = 0;
    auto flush = [&] {
      if (entries.empty()) return true;
      ++prefill_steps_;
      const bool ok = RunSteps({entries}, /*timed=*/false);
      entries.clear();
      tokens = 0;
      return ok;
    };
    for (int32_t i = 0; i < settings_.sequences; ++i) {
      if (tokens + settings_.prompt_tokens > max_step_tokens && !flush()) return false;
      entries.emplace_back(first_id_ + i, settings_.prompt_tokens);
      tokens += settings_.prompt_tokens;
    }
    if (!flush()) return false;
    prefill_elapsed_ = absl::Now() - start;
    return true;
  }

  // One decode step of every sequence, in micro-batches (the optional prefill entry joins the
  // first).
  bool RunDecodeStep(int32_t index, bool timed) {
    std::vector<Entries> batches(settings_.micro_batches);
    for (int32_t i = 0; i < settings_.sequences; ++i) {
      batches[static_cast<size_t>(i) * settings_.micro_batches / settings_.sequences]
          .emplace_back(first_id_ + i, 1);
    }
    if (settings_.prefill_tokens > 0) {
      const uint64_t id = first_id_ + settings_.sequences + index;
      batches[0].emplace_back(id, settings_.prefill_tokens);
      extra_ids_.push_back(id);
    }
    return RunSteps(batches, timed);
  }

  // q/k/v for a step of `rows` rows; built once per row count and reused.
  const attnd::v1::ForwardRequest& Payload(int64_t rows) {
    auto it = payloads_.find(rows);
    if (it != payloads_.end()) return it->second;
    const attnd::v1::CacheConfig& config = cache_.config();
    const DType dtype = static_cast<DType>(config.q_dtype());
    attnd::v1::ForwardRequest request;
    *request.mutable_q() = *RandomTensor(rng_, dtype, {rows, config.num_qo_heads(),
                                                       config.head_dim()});
    *request.mutable_k() = *RandomTensor(rng_, dtype, {rows, config.num_kv_heads(),
                                                       config.head_dim()});
    *request.mutable_v() = *RandomTensor(rng_, dtype, {rows, config.num_kv_heads(),
                                                       config.head_dim()});
    return payloads_.emplace(rows, std::move(request)).first->second;
  }

  // The output buffer of micro-batch `batch`'s layer `layer` (reused from step to step).
  std::vector<uint8_t>& OutputBuffer(size_t batch, int32_t layer, size_t bytes) {
    const size_t layers = static_cast<size_t>(cache_.config().num_layers());
    if (outputs_.size() < (batch + 1) * layers) outputs_.resize((batch + 1) * layers);
    std::vector<uint8_t>& buffer = outputs_[batch * layers + static_cast<size_t>(layer)];
    buffer.resize(bytes);
    return buffer;
  }

  void CountError(const absl::Status& status) {
    // What an interruption cancels is not an error of the daemon's.
    if (interrupted()) return;
    if (first_error_.ok()) first_error_ = status;
    ++errors_;
  }

  // Plans one step per batch, runs every layer of all of them (layer-major: each layer of
  // every batch before the next layer) with up to `window` forwards in flight, and commits.
  // False on any error (the steps are then aborted by their handles).
  bool RunSteps(const std::vector<Entries>& batches, bool timed) {
    std::vector<std::unique_ptr<client::Step>> steps;
    for (const Entries& entries : batches) {
      if (entries.empty()) continue;
      attnd::v1::PlanRequest plan;
      plan.set_cache(cache_.name());
      for (const auto& [id, tokens] : entries) {
        attnd::v1::PlanEntry* entry = plan.add_entries();
        entry->set_sequence_id(id);
        entry->set_num_new_tokens(tokens);
      }
      const absl::Time plan_start = absl::Now();
      auto step = session_ != nullptr ? session_->BeginStep(plan) : client_.BeginStep(plan);
      if (!step.ok()) {
        CountError(step.status());
        return false;
      }
      if (timed) plan_latency_.Record(absl::Now() - plan_start);
      steps.push_back(*std::move(step));
    }

    std::mutex mu;
    std::condition_variable cv;
    int in_flight = 0;
    absl::Status step_error;
    const int32_t layers = cache_.config().num_layers();
    const attnd::v1::CacheConfig& config = cache_.config();
    const int64_t q_width = int64_t{config.num_qo_heads()} * config.head_dim();
    bool stop = false;
    for (int32_t layer = 0; layer < layers && !stop; ++layer) {
      for (size_t b = 0; b < steps.size(); ++b) {
        client::Step& step = *steps[b];
        {
          std::unique_lock lock(mu);
          cv.wait(lock, [&] { return in_flight < settings_.window; });
          stop = !step_error.ok() || interrupted();
          if (stop) break;
          ++in_flight;
        }
        const attnd::v1::ForwardRequest& payload = Payload(step.num_tokens());
        const absl::Time sent = absl::Now();
        auto finish = [&, sent, timed](const absl::Status& status) {
          const absl::Duration latency = absl::Now() - sent;
          std::lock_guard lock(mu);
          if (!status.ok()) {
            if (step_error.ok()) step_error = status;
          } else if (timed) {
            layer_latency_.Record(latency);
          }
          --in_flight;
          cv.notify_all();
        };
        if (settings_.raw) {
          const int64_t rows = step.num_tokens();
          std::vector<uint8_t>& o = OutputBuffer(b, layer, rows * q_width *
                                                               DTypeBytes(static_cast<DType>(
                                                                   config.q_dtype())));
          client::ForwardOutputBuffers outputs;
          outputs.o = o;
          step.ForwardRaw(layer, View(payload.q()), View(payload.k()), View(payload.v()),
                          outputs, [finish](absl::StatusOr<client::ForwardOutcome> result) {
                            finish(result.status());
                          });
        } else {
          attnd::v1::ForwardRequest request = payload;
          request.set_layer(layer);
          step.ForwardAsync(std::move(request),
                            [finish](client::ForwardResult result) { finish(result.status()); });
        }
      }
    }
    {
      std::unique_lock lock(mu);
      cv.wait(lock, [&] { return in_flight == 0; });
    }
    if (!step_error.ok() || interrupted()) {
      CountError(step_error);
      return false;
    }
    for (auto& step : steps) {
      if (!step->open()) continue;
      auto ended = step->End();
      if (!ended.ok()) {
        CountError(ended.status());
        return false;
      }
    }
    return true;
  }

  // A payload tensor as a zero-copy view (its shape lives in the payload message).
  static client::TensorView View(const attnd::v1::Tensor& tensor) {
    client::TensorView view;
    view.dtype = tensor.dtype();
    view.shape = {tensor.shape().data(), static_cast<size_t>(tensor.shape_size())};
    view.bytes = {reinterpret_cast<const uint8_t*>(tensor.data().data()), tensor.data().size()};
    return view;
  }

  client::Client& client_;
  const attnd::v1::CacheInfo cache_;
  const BenchSettings settings_;
  const uint64_t first_id_;
  const InterruptWatch& interrupts_;
  std::mt19937_64 rng_;
  std::mutex session_mu_;  // session_ is set once, by Run; Interrupt reads it from another thread
  std::unique_ptr<client::StreamSession> session_;
  std::map<int64_t, attnd::v1::ForwardRequest> payloads_;
  std::vector<std::vector<uint8_t>> outputs_;
  std::vector<uint64_t> extra_ids_;

  LatencyRecorder layer_latency_;  // guarded by RunSteps' mutex while steps run
  LatencyRecorder plan_latency_;
  LatencyRecorder step_latency_;
  int64_t errors_ = 0;
  absl::Status first_error_;
  int64_t steps_ok_ = 0;
  int64_t tokens_ = 0;
  int32_t prefill_steps_ = 0;
  absl::Duration prefill_elapsed_;
  absl::Duration elapsed_;
  bool have_kernels_ = false;
  double kernel_seconds_ = 0;
  int64_t kernel_launches_ = 0;
};

int64_t PagesNeeded(const BenchSettings& settings, int32_t page_size) {
  auto pages = [&](int64_t tokens) { return (tokens + page_size - 1) / page_size; };
  const int64_t steps = settings.steps + settings.warmup_steps;
  return settings.sequences * pages(settings.prompt_tokens + steps) +
         steps * pages(settings.prefill_tokens);
}

}  // namespace

int RunBench(const Args& args) {
  if (!args.empty()) {
    absl::FPrintF(stderr,
                  "usage: attnctl bench [--sequences=N --steps=S --warmup_steps=S0 "
                  "--prompt_tokens=P --prefill_tokens=T --stream --window=W --micro_batches=M "
                  "--raw=true|false --cache=NAME --transport=grpc|shm|cuda_ipc|nccl "
                  "--client_device=N] [cache shape flags]\n");
    return kExitUsage;
  }
  // Before the first channel, so that gRPC's threads start with the signals blocked.
  InterruptWatch interrupts;
  BenchSettings settings;
  settings.sequences = absl::GetFlag(FLAGS_sequences);
  settings.steps = absl::GetFlag(FLAGS_steps);
  settings.prompt_tokens = absl::GetFlag(FLAGS_prompt_tokens);
  settings.prefill_tokens = absl::GetFlag(FLAGS_prefill_tokens);
  settings.stream = absl::GetFlag(FLAGS_stream);
  settings.warmup_steps = absl::GetFlag(FLAGS_warmup_steps);
  settings.micro_batches = absl::GetFlag(FLAGS_micro_batches);
  settings.raw = absl::GetFlag(FLAGS_raw);
  if (settings.sequences < 1 || settings.steps < 1 || settings.prompt_tokens < 0 ||
      settings.prefill_tokens < 0 || absl::GetFlag(FLAGS_window) < 0 ||
      settings.warmup_steps < 0 || settings.micro_batches < 1 ||
      settings.micro_batches > settings.sequences) {
    absl::FPrintF(stderr, "attnctl bench: --sequences and --steps must be >= 1, "
                          "--prompt_tokens, --prefill_tokens, --warmup_steps and --window >= 0, "
                          "--micro_batches in [1, sequences]\n");
    return kExitUsage;
  }
  auto config = CacheConfigFromFlags(CacheShapeDefaults{});
  if (!config.ok()) {
    PrintError("bench", config.status());
    return kExitUsage;
  }
  auto client = ConnectFromFlags();
  if (!client.ok()) {
    PrintError("connect", client.status());
    return kExitFailure;
  }
  auto info = (*client)->GetServerInfo();
  if (!info.ok()) {
    PrintError("GetServerInfo", info.status());
    return kExitFailure;
  }

  const std::string existing = absl::GetFlag(FLAGS_cache);
  std::random_device entropy;
  attnd::v1::CacheInfo cache;
  uint64_t first_id = 1;
  if (!existing.empty()) {
    auto got = (*client)->GetCache(existing);
    if (!got.ok()) {
      PrintError(absl::StrCat("cache ", existing), got.status());
      return kExitFailure;
    }
    cache = *std::move(got);
    // Ids far from anyone else's on a shared cache.
    first_id = (uint64_t{entropy()} << 32) | (uint64_t{1} << 31);
  } else {
    if (!CapacityFlagGiven()) {
      BenchSettings sized = settings;
      // A CUDA_IPC or NCCL bench runs a chained phase after the timed steps (another `steps`
      // tokens per sequence) and, with micro-batches, a pipelined one (another steps + 3).
      if (absl::GetFlag(FLAGS_transport) == "cuda_ipc" ||
          absl::GetFlag(FLAGS_transport) == "nccl") {
        sized.steps = 2 * settings.steps + (settings.micro_batches > 1 ? settings.steps + 3 : 0);
      }
      config->set_num_pages(PagesNeeded(sized, config->page_size()) + settings.sequences);
    }
    const std::string name = absl::StrFormat("attnctl-bench-%d-%08x", getpid(), entropy());
    auto created = (*client)->CreateCache(name, *config);
    if (!created.ok()) {
      PrintError(absl::StrCat("create cache ", name), created.status());
      return kExitFailure;
    }
    cache = *std::move(created);
  }
  if (cache.config().kind() == attnd::v1::ATTENTION_KIND_MLA ||
      cache.config().page_table_mode() == attnd::v1::PAGE_TABLE_MODE_EXTERNAL) {
    absl::FPrintF(stderr, "attnctl bench: drives MHA/GQA caches in managed mode only\n");
    if (existing.empty()) (void)(*client)->DeleteCache(cache.name(), true);
    return kExitUsage;
  }
  const std::string transport = absl::GetFlag(FLAGS_transport);
  if (transport != "grpc") {
    if (transport != "shm" && transport != "cuda_ipc" && transport != "nccl") {
      absl::FPrintF(stderr,
                    "attnctl bench: --transport: expected grpc, shm, cuda_ipc or nccl, got %s\n",
                    transport);
      if (existing.empty()) (void)(*client)->DeleteCache(cache.name(), true);
      return kExitUsage;
    }
    // Each micro-batch would be its own communicator, and NCCL does not promise that kernels
    // of several communicators enqueued in different orders on the two ranks make progress.
    if (transport == "nccl" && settings.micro_batches > 1) {
      absl::FPrintF(stderr, "attnctl bench: --transport=nccl runs one micro-batch "
                            "(--micro_batches=1)\n");
      if (existing.empty()) (void)(*client)->DeleteCache(cache.name(), true);
      return kExitUsage;
    }
    ChannelBenchSettings channel_settings;
    channel_settings.sequences = settings.sequences;
    channel_settings.steps = settings.steps;
    channel_settings.warmup_steps = settings.warmup_steps;
    channel_settings.prompt_tokens = settings.prompt_tokens;
    channel_settings.max_step_tokens = info->limits().max_step_tokens();
    channel_settings.first_id = first_id;
    channel_settings.micro_batches = settings.micro_batches;
    channel_settings.client_device = absl::GetFlag(FLAGS_client_device);
    const int code = RunChannelBench(**client, cache, channel_settings,
                                     transport == "shm"        ? attnd::v1::CHANNEL_KIND_HOST_SHM
                                     : transport == "cuda_ipc" ? attnd::v1::CHANNEL_KIND_CUDA_IPC
                                                               : attnd::v1::CHANNEL_KIND_NCCL);
    if (existing.empty()) (void)(*client)->DeleteCache(cache.name(), /*force=*/true);
    return code;
  }
  const int32_t window = absl::GetFlag(FLAGS_window);
  settings.window = window > 0               ? window
                    : settings.stream          ? cache.config().num_layers() * settings.micro_batches
                                               : settings.micro_batches;

  Bench bench(**client, cache, settings, first_id, interrupts);
  interrupts.OnInterrupt([&bench] { bench.Interrupt(); });
  // Prefill steps stay within the step limit and within the message limit (q, k and v of a
  // step travel in one Forward message).
  int64_t max_step_tokens =
      info->limits().max_step_tokens() > 0 ? info->limits().max_step_tokens() : int64_t{1} << 40;
  const attnd::v1::CacheConfig& shape = cache.config();
  const int64_t token_bytes = int64_t{shape.num_qo_heads() + 2 * shape.num_kv_heads()} *
                              shape.head_dim() *
                              DTypeBytes(static_cast<DType>(shape.q_dtype()));
  const int64_t max_message_bytes = std::min<int64_t>(
      info->limits().max_message_bytes() > 0 ? info->limits().max_message_bytes() : int64_t{1} << 40,
      (*client)->options().max_message_bytes);
  if (token_bytes > 0) {
    max_step_tokens = std::max<int64_t>(
        1, std::min(max_step_tokens, max_message_bytes * 9 / 10 / token_bytes));
  }
  const bool ran = bench.Run(max_step_tokens);
  interrupts.OnInterrupt(nullptr);
  if (ran) bench.PrintSummary();
  if (existing.empty()) {
    absl::Status deleted = (*client)->DeleteCache(cache.name(), /*force=*/true);
    if (!deleted.ok()) PrintError(absl::StrCat("delete cache ", cache.name()), deleted);
  } else {
    bench.FreeSequences();
  }
  if (interrupts.signal() != 0) return InterruptedExitCode(interrupts.signal());
  return ran && bench.errors() == 0 ? kExitOk : kExitFailure;
}

}  // namespace attnd::attnctl
