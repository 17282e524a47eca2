// plan_bench: what planning a step costs on the CPU (PERFORMANCE.md e2e bar: a 256-sequence
// step planned in <= 50 us).
//
//   engine    Engine::Plan end to end (validation, slot allocation, the StepBatch, the
//             backend's PrepareStep, metrics) over a backend whose PrepareStep does nothing, then
//             EndStep: the engine's own cost.
//   kernel    the CUDA backend's host planning of the same batch (plan::PlanStep: the
//             split-KV decode plan, the array layout, then Fill into a host buffer), uncached
//             and from the plan cache; CUDA builds only (it runs on the CPU, no GPU needed).
//   decode    plan::PlanBatchDecode alone.
//
// Each for 256 decode sequences of equal length (1024 and 32768 keys) and of mixed lengths,
// median of many runs, after warm-up.
//
//   plan_bench [--sequences=256 --runs=2000 --kv_lens=1024,32768,mixed]
#include <algorithm>
#include <chrono>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_format.h"
#include "engine/engine.h"
#include "metrics/metrics.h"
#include "plan/decode_plan.h"
#ifdef ATTND_PLAN_BENCH_CUDA
#include "backend/cuda_plan_cache.h"
#include "plan/step_plan.h"
#endif

ABSL_FLAG(int32_t, sequences, 256, "decode sequences per step");
ABSL_FLAG(int32_t, runs, 2000, "timed runs per case");
ABSL_FLAG(std::vector<std::string>, kv_lens, std::vector<std::string>({"1024", "32768", "mixed"}),
          "keys per sequence of each case: a number, or mixed (uniform in [1, 8192])");
ABSL_FLAG(int32_t, ctas_per_wave, 132 * 8,
          "decode CTAs the device runs at once (the planner's input; 132 SMs x 8 here)");

namespace attnd {
namespace {

using Clock = std::chrono::steady_clock;

double Micros(Clock::duration d) { return std::chrono::duration<double, std::micro>(d).count(); }

double Median(std::vector<double> samples) {
  std::sort(samples.begin(), samples.end());
  return samples[samples.size() / 2];
}

double P90(std::vector<double> samples) {
  std::sort(samples.begin(), samples.end());
  return samples[samples.size() * 9 / 10];
}

// A backend that keeps no data and plans nothing: Engine::Plan's own cost.
class NoopStep final : public BackendStep {
 public:
  std::string_view KernelName() const override { return "decode"; }
  void RunLayer(const LayerIo&, DoneCallback done) override { done(absl::OkStatus()); }
};

class NoopCache final : public BackendCache {
 public:
  explicit NoopCache(const CacheGeometry& geometry) : geometry_(geometry) {}
  const CacheGeometry& geometry() const override { return geometry_; }
  absl::StatusOr<std::unique_ptr<BackendStep>> PrepareStep(
      std::shared_ptr<const StepBatch>) override {
    return std::make_unique<NoopStep>();
  }
  absl::Status ReadPages(int32_t, bool, int64_t, std::span<uint8_t>) override {
    return absl::UnimplementedError("noop");
  }

 private:
  CacheGeometry geometry_;
};

class NoopBackend final : public Backend {
 public:
  BackendInfo Info() const override {
    BackendInfo info;
    info.name = "noop";
    return info;
  }
  int64_t KvFreeBytes() const override { return int64_t{1} << 50; }
  absl::StatusOr<std::unique_ptr<BackendCache>> CreateCache(const CacheGeometry& g, int32_t /*device*/) override {
    return std::unique_ptr<BackendCache>(new NoopCache(g));
  }
};

std::vector<int64_t> Lengths(const std::string& kind, int32_t sequences) {
  std::vector<int64_t> lengths(sequences);
  if (kind == "mixed") {
    std::mt19937 rng(sequences);
    std::uniform_int_distribution<int64_t> uniform(1, 2 * 4096);
    for (int64_t& length : lengths) length = uniform(rng);
  } else {
    std::fill(lengths.begin(), lengths.end(), std::stoll(kind));
  }
  return lengths;
}

CacheSpec Spec(int64_t num_pages) {
  CacheSpec spec;
  spec.name = "bench";
  CacheGeometry& g = spec.geometry;
  g.num_layers = 32;
  g.num_qo_heads = 32;
  g.num_kv_heads = 8;
  g.k_head_dim = g.v_head_dim = 128;
  g.page_size = 16;
  g.num_pages = num_pages;
  return spec;
}

// Engine::Plan of a decode step over sequences already `lengths` long.
void BenchEngine(const std::string& kind, int32_t sequences, int32_t runs) {
  const std::vector<int64_t> lengths = Lengths(kind, sequences);
  int64_t pages = 0;
  for (int64_t length : lengths) pages += (length + runs + 100) / 16 + 2;
  NoopBackend backend;
  Metrics metrics(Metrics::BuildInfo{"bench", "noop", "none"});
  EngineOptions options;
  options.limits.max_step_tokens = int64_t{1} << 40;
  Engine engine(options, &backend, &metrics);
  if (!engine.CreateCache(Spec(pages)).ok()) return;
  // Give every sequence its length: one step of prefill tokens, committed without layers.
  PlanSpec prefill;
  prefill.cache = "bench";
  for (int32_t i = 0; i < sequences; ++i) {
    PlanEntrySpec& entry = prefill.entries.emplace_back();
    entry.sequence_id = static_cast<uint64_t>(i + 1);
    entry.num_new_tokens = static_cast<int32_t>(lengths[i]);
  }
  auto planned = engine.Plan(prefill);
  if (!planned.ok()) {
    absl::FPrintF(stderr, "prefill plan: %s\n", planned.status().ToString());
    return;
  }
  engine.EndStep(planned->step_id, false, [](absl::StatusOr<EndStepResult>) {});

  PlanSpec decode;
  decode.cache = "bench";
  for (int32_t i = 0; i < sequences; ++i) {
    PlanEntrySpec& entry = decode.entries.emplace_back();
    entry.sequence_id = static_cast<uint64_t>(i + 1);
    entry.num_new_tokens = 1;
  }
  std::vector<double> samples;
  for (int32_t run = 0; run < runs + 50; ++run) {
    const Clock::time_point start = Clock::now();
    auto step = engine.Plan(decode);
    const Clock::time_point end = Clock::now();
    if (!step.ok()) {
      absl::FPrintF(stderr, "plan: %s\n", step.status().ToString());
      return;
    }
    engine.EndStep(step->step_id, false, [](absl::StatusOr<EndStepResult>) {});
    if (run >= 50) samples.push_back(Micros(end - start));
  }
  absl::PrintF("%-8s %-8s %8d %12.1f %12.1f\n", "engine", kind, sequences, Median(samples),
               P90(samples));
}

void BenchDecodePlanner(const std::string& kind, int32_t sequences, int32_t runs) {
  const std::vector<int64_t> lengths = Lengths(kind, sequences);
  std::vector<int32_t> indptr(sequences + 1);
  for (int32_t i = 0; i <= sequences; ++i) indptr[i] = i;
  plan::DecodePlanOptions options;
  options.num_kv_heads = 8;
  options.ctas_per_wave = absl::GetFlag(FLAGS_ctas_per_wave);
  std::vector<double> samples;
  for (int32_t run = 0; run < runs + 50; ++run) {
    const Clock::time_point start = Clock::now();
    auto plan = plan::PlanBatchDecode(indptr, lengths, options);
    const Clock::time_point end = Clock::now();
    if (!plan.ok()) return;
    if (run >= 50) samples.push_back(Micros(end - start));
  }
  absl::PrintF("%-8s %-8s %8d %12.1f %12.1f\n", "decode", kind, sequences, Median(samples),
               P90(samples));
}

#ifdef ATTND_PLAN_BENCH_CUDA
// The CUDA backend's host planning: PlanStep (or a plan-cache hit) and Fill.
void BenchKernelPlan(const std::string& kind, int32_t sequences, int32_t runs, bool cached) {
  const std::vector<int64_t> lengths = Lengths(kind, sequences);
  const CacheSpec spec = Spec(0);
  StepBatch batch;
  batch.batch_size = sequences;
  batch.num_tokens = sequences;
  batch.phase = StepPhase::kDecode;
  batch.options.params.sm_scale = 0.088f;
  batch.qo_indptr.push_back(0);
  batch.page_indptr.push_back(0);
  int32_t next_page = 0;
  for (int32_t b = 0; b < sequences; ++b) {
    const int64_t pages = (lengths[b] + 15) / 16;
    for (int64_t p = 0; p < pages; ++p) batch.k_page_indices.push_back(next_page++);
    batch.qo_indptr.push_back(b + 1);
    batch.page_indptr.push_back(static_cast<int32_t>(batch.k_page_indices.size()));
    batch.last_page_len.push_back(static_cast<int32_t>(lengths[b] - (pages - 1) * 16));
    batch.token_batch_indices.push_back(b);
    batch.token_positions.push_back(static_cast<int32_t>(lengths[b] - 1));
  }
  // v_page_indices stays empty, as the engine leaves it for a cache of SHARED page tables.
  plan::StepPlanContext context;
  context.geometry = &spec.geometry;
  context.decode_supported = true;
  context.decode_ctas_per_wave = absl::GetFlag(FLAGS_ctas_per_wave);
  cuda_backend::PlanCache cache;
  std::vector<uint8_t> buffer;
  std::vector<double> samples;
  for (int32_t run = 0; run < runs + 50; ++run) {
    const Clock::time_point start = Clock::now();
    std::shared_ptr<const plan::StepPlan> plan;
    if (cached) {
      auto got = cache.Get(batch, context);
      if (!got.ok()) return;
      plan = *std::move(got);
    } else {
      auto built = plan::PlanStep(batch, context);
      if (!built.ok()) return;
      plan = std::make_shared<const plan::StepPlan>(*std::move(built));
    }
    if (buffer.size() < static_cast<size_t>(plan->offsets.total_bytes)) {
      buffer.resize(plan->offsets.total_bytes);
    }
    plan->Fill(batch, buffer.data());
    const Clock::time_point end = Clock::now();
    if (run >= 50) samples.push_back(Micros(end - start));
  }
  absl::PrintF("%-8s %-8s %8d %12.1f %12.1f\n", cached ? "kernel*" : "kernel", kind, sequences,
               Median(samples), P90(samples));
}
#endif

int Main() {
  const int32_t sequences = absl::GetFlag(FLAGS_sequences);
  const int32_t runs = absl::GetFlag(FLAGS_runs);
  absl::PrintF("%-8s %-8s %8s %12s %12s\n", "what", "kv_len", "batch", "p50 us", "p90 us");
  for (const std::string& kind : absl::GetFlag(FLAGS_kv_lens)) {
    BenchEngine(kind, sequences, runs);
#ifdef ATTND_PLAN_BENCH_CUDA
    BenchKernelPlan(kind, sequences, runs, /*cached=*/false);
    BenchKernelPlan(kind, sequences, runs, /*cached=*/true);
#endif
    BenchDecodePlanner(kind, sequences, runs);
  }
  absl::PrintF("(kernel*: from the plan cache; mixed: uniform in [1, 8192])\n");
  return 0;
}

}  // namespace
}  // namespace attnd

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return attnd::Main();
}
