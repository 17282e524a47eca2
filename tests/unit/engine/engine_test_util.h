// Helpers for driving an Engine over the CPU backend in unit tests.
#pragma once

#include <memory>
#include <random>
#include <ostream>
#include <string>

#include "absl/synchronization/notification.h"
#include "attnd/kernels/dtype.h"
#include "backend/cpu_backend.h"
#include "engine/engine.h"

// Debian's Abseil has its own string_view; print it as text in gtest failure messages.
namespace absl {
ABSL_NAMESPACE_BEGIN
inline void PrintTo(absl::string_view text, std::ostream* os) { *os << '"' << text << '"'; }
ABSL_NAMESPACE_END
}  // namespace absl

namespace attnd::testing {

inline CacheSpec SmallCache(std::string name, int32_t num_pages = 16, int32_t page_size = 4) {
  CacheSpec spec;
  spec.name = std::move(name);
  CacheGeometry& g = spec.geometry;
  g.num_layers = 2;
  g.num_qo_heads = 4;
  g.num_kv_heads = 2;
  g.k_head_dim = g.v_head_dim = 64;
  g.page_size = page_size;
  g.num_pages = num_pages;
  g.kv_dtype = g.q_dtype = DType::kBFloat16;
  g.rope.style = RopeStyle::kNeox;
  g.rope.rotary_dim = 64;
  return spec;
}

inline PlanSpec Decode(const std::string& cache, std::vector<std::pair<uint64_t, int32_t>> entries) {
  PlanSpec spec;
  spec.cache = cache;
  for (const auto& [id, tokens] : entries) {
    PlanEntrySpec& entry = spec.entries.emplace_back();
    entry.sequence_id = id;
    entry.num_new_tokens = tokens;
  }
  return spec;
}

// Random bf16 q/k/v of one layer for a step of `tokens` rows.
struct LayerTensors {
  std::string q, k, v;
  // The arguments' pieces (one per tensor), set by Args(): valid while this object lives
  // unmoved and unchanged.
  mutable std::string_view pieces[3];
  ForwardArgs Args(uint64_t step_id, int32_t layer, const CacheGeometry& g, int64_t tokens) const {
    pieces[0] = q;
    pieces[1] = k;
    pieces[2] = v;
    ForwardArgs args;
    args.step_id = step_id;
    args.layer = layer;
    args.q = {true, g.q_dtype, {tokens, g.num_qo_heads, g.k_head_dim}, {&pieces[0], 1}};
    args.k = {true, g.q_dtype, {tokens, g.num_kv_heads, g.k_head_dim}, {&pieces[1], 1}};
    args.v = {true, g.q_dtype, {tokens, g.num_kv_heads, g.v_head_dim}, {&pieces[2], 1}};
    return args;
  }
};

inline std::string RandomBf16(int64_t elements, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::string bytes(elements * 2, '\0');
  for (int64_t i = 0; i < elements; ++i) StoreFromFloat(DType::kBFloat16, bytes.data(), i, normal(rng));
  return bytes;
}

inline LayerTensors RandomLayer(const CacheGeometry& g, int64_t tokens, uint32_t seed) {
  std::mt19937 rng(seed);
  LayerTensors t;
  t.q = RandomBf16(tokens * g.num_qo_heads * g.k_head_dim, rng);
  t.k = RandomBf16(tokens * g.num_kv_heads * g.k_head_dim, rng);
  t.v = RandomBf16(tokens * g.num_kv_heads * g.v_head_dim, rng);
  return t;
}

struct ForwardResult {
  absl::Status status;
  ForwardOutputs outputs;
  std::string o, lse;
};

// Runs Forward and waits for its callback.
inline std::unique_ptr<ForwardResult> ForwardSync(Engine& engine, const ForwardArgs& args) {
  auto result = std::make_unique<ForwardResult>();
  result->outputs.o = &result->o;
  result->outputs.lse = &result->lse;
  absl::Notification done;
  engine.Forward(args, &result->outputs, [&](absl::Status status) {
    result->status = status;
    done.Notify();
  });
  done.WaitForNotification();
  return result;
}

inline absl::StatusOr<EndStepResult> EndStepSync(Engine& engine, uint64_t step_id, bool abort) {
  absl::StatusOr<EndStepResult> result;
  absl::Notification done;
  engine.EndStep(step_id, abort, [&](absl::StatusOr<EndStepResult> r) {
    result = std::move(r);
    done.Notify();
  });
  done.WaitForNotification();
  return result;
}

// Runs every layer of a planned step with random inputs.
inline void RunAllLayers(Engine& engine, const CacheGeometry& g, const PlanResult& plan,
                         uint32_t seed = 1) {
  for (int32_t layer = 0; layer < g.num_layers; ++layer) {
    const LayerTensors t = RandomLayer(g, plan.num_tokens, seed + layer);
    auto result = ForwardSync(engine, t.Args(plan.step_id, layer, g, plan.num_tokens));
    if (!result->status.ok()) throw std::runtime_error(std::string(result->status.message()));
  }
}

class EngineFixture {
 public:
  explicit EngineFixture(absl::Duration ttl = absl::Seconds(60)) {
    CpuBackendOptions backend_options;
    backend_options.kv_budget_bytes = 64 << 20;
    backend_options.num_workers = 2;
    backend = MakeCpuBackend(backend_options);
    EngineOptions options;
    options.step_ttl = ttl;
    engine = std::make_unique<Engine>(options, backend.get(), nullptr);
  }
  std::unique_ptr<Backend> backend;
  std::unique_ptr<Engine> engine;
};

}  // namespace attnd::testing
