// The CUDA backend against the CPU backend (the reference) through the Backend interface, on
// identical inputs: steps built the way the engine builds them (managed pages scattered over the
// pool, or SEPARATE_KV tables), run layer by layer with every layer of a step in flight at once,
// then o/lse and the raw bytes of every pool page compared, for MHA/GQA and MLA caches. GPU tests
// skip without a device; the range allocator's and the MLA step plan's tests run everywhere.
//
// Tolerances: o normwise relative error <= 1e-2 for bf16 q (fp8 KV included), <= 5e-3 for fp16
// q; lse max abs difference <= 2e-3. Pools: bitwise equal without RoPE and with fp16/bf16 KV;
// with RoPE (k rotated in fp32 with the GPU's sin/cos) or fp8 KV (quantisation after a scale),
// codes may differ by one ulp, never more.
#include <algorithm>
#include <array>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <numeric>
#include <ostream>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "attnd/kernels/cuda/prefill.h"
#include "backend/backend.h"
#include "backend/backend_factory.h"
#include "backend/cpu_backend.h"
#include "backend/cuda_backend.h"
#include "cuda_backend_test_util.h"
#include "gtest/gtest.h"
#include "plan/pod_choice.h"
#include "plan/step_plan.h"

namespace attnd {
namespace {

using testing::Error;
using testing::MakeBackendPair;
using testing::MaxLseDifference;
using testing::MlaCacheConfig;
using testing::MlaGeometryOf;
using testing::MlaOptions;
using testing::NormwiseError;
using testing::RandomTensor;
using testing::SequenceBook;
using testing::UlpDistance;

bool HaveGpu() { return CudaDeviceCount() > 0; }

#define SKIP_WITHOUT_GPU() \
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device"

// ---- Fixtures ----

struct CacheConfig {
  std::string name;
  DType q_dtype = DType::kBFloat16;
  DType kv_dtype = DType::kBFloat16;
  int32_t head_dim = 128;
  int32_t num_qo_heads = 8;
  int32_t num_kv_heads = 2;
  int32_t page_size = 16;
  KvLayout layout = KvLayout::kNHD;
  RopeStyle rope = RopeStyle::kNone;
  int32_t rotary_dim = 0;  // 0: head_dim
  bool separate_kv = false;
  float k_scale = 1.0f;
  float v_scale = 1.0f;
  int32_t num_layers = 3;  // more than a step's layer slots: one layer waits for a slot
};

CacheGeometry GeometryOf(const CacheConfig& config) {
  CacheGeometry g;
  g.num_layers = config.num_layers;
  g.num_qo_heads = config.num_qo_heads;
  g.num_kv_heads = config.num_kv_heads;
  g.k_head_dim = g.v_head_dim = config.head_dim;
  g.page_size = config.page_size;
  g.num_pages = 256 / config.page_size + 16;
  g.kv_dtype = config.kv_dtype;
  g.q_dtype = config.q_dtype;
  g.layout = config.layout;
  g.k_scale = config.k_scale;
  g.v_scale = config.v_scale;
  g.rope.style = config.rope;
  g.rope.theta = 10000.0;
  g.rope.rotary_dim = config.rope == RopeStyle::kNone
                          ? 0
                          : (config.rotary_dim > 0 ? config.rotary_dim : config.head_dim);
  return g;
}

class RecordingObserver final : public BackendObserver {
 public:
  void OnKernel(std::string_view kernel, std::string_view phase, double seconds,
                int32_t device) override {
    std::lock_guard lock(mu_);
    ++kernels_[std::string(kernel) + "/" + std::string(phase)];
    if (!(seconds > 0.0)) ++non_positive_;
    devices_.insert(device);
  }
  void OnTransfer(std::string_view direction, int64_t bytes, int32_t device) override {
    std::lock_guard lock(mu_);
    bytes_[std::string(direction)] += bytes;
    devices_.insert(device);
  }
  int Count(const std::string& kernel_phase) {
    std::lock_guard lock(mu_);
    return kernels_[kernel_phase];
  }
  int64_t Bytes(const std::string& direction) {
    std::lock_guard lock(mu_);
    return bytes_[direction];
  }
  int non_positive() {
    std::lock_guard lock(mu_);
    return non_positive_;
  }
  // Every device a kernel or transfer was reported on.
  std::set<int32_t> devices() {
    std::lock_guard lock(mu_);
    return devices_;
  }

 private:
  std::mutex mu_;
  std::map<std::string, int> kernels_;
  std::map<std::string, int64_t> bytes_;
  int non_positive_ = 0;
  std::set<int32_t> devices_;
};

// MHA: q, k, v. MLA: q (q_nope), q_pe, ckv, kpe.
struct LayerInputs {
  std::vector<uint8_t> q, k, v;
  std::vector<uint8_t> q_pe, ckv, kpe;
};

struct LayerResult {
  absl::Status status = absl::UnknownError("done not called");
  std::vector<uint8_t> o;
  std::vector<float> lse;
  bool on_caller_thread = false;
};

// Prepares `batch` on `cache` and runs every layer at once (all RunLayer calls before any
// wait), with outputs poisoned (0xFF: NaN in fp16/bf16/fp32) beforehand.
struct StepRun {
  std::string kernel;
  std::vector<LayerResult> layers;
};

StepRun RunStep(BackendCache& cache, const std::shared_ptr<StepBatch>& batch,
                const std::vector<LayerInputs>& inputs) {
  const CacheGeometry& g = cache.geometry();
  StepRun run;
  auto step = cache.PrepareStep(batch);
  EXPECT_TRUE(step.ok()) << step.status();
  if (!step.ok()) return run;
  run.kernel = std::string((*step)->KernelName());
  run.layers.resize(g.num_layers);
  std::mutex mu;
  std::condition_variable all_done;
  int remaining = g.num_layers;
  const std::thread::id caller = std::this_thread::get_id();
  for (int32_t layer = 0; layer < g.num_layers; ++layer) {
    LayerResult& result = run.layers[layer];
    const int32_t o_dim = g.mla ? g.k_head_dim : g.v_head_dim;  // MLA: latent output
    result.o.assign(batch->num_tokens * g.num_qo_heads * o_dim * DTypeBytes(g.q_dtype), 0xFF);
    if (batch->options.return_lse) {
      result.lse.assign(batch->num_tokens * g.num_qo_heads, std::nanf(""));
    }
    LayerIo io;
    io.layer = layer;
    io.q = inputs[layer].q.data();
    if (g.mla) {
      io.q_pe = inputs[layer].q_pe.data();
      io.ckv = inputs[layer].ckv.data();
      io.kpe = inputs[layer].kpe.data();
    } else {
      io.k = inputs[layer].k.data();
      io.v = inputs[layer].v.data();
    }
    io.o = result.o.data();
    io.lse = batch->options.return_lse ? result.lse.data() : nullptr;
    (*step)->RunLayer(io, [&, caller, layer](absl::Status status) {
      std::lock_guard lock(mu);
      run.layers[layer].status = status;
      run.layers[layer].on_caller_thread = std::this_thread::get_id() == caller;
      if (--remaining == 0) all_done.notify_all();
    });
  }
  std::unique_lock lock(mu);
  all_done.wait(lock, [&] { return remaining == 0; });
  return run;
}

struct PoolDifference {
  int64_t differing_elements = 0;
  int64_t max_ulp = 0;
};

PoolDifference ComparePools(BackendCache& gpu, BackendCache& cpu) {
  const CacheGeometry& g = gpu.geometry();
  const int bits = DTypeBytes(g.kv_dtype) * 8;
  PoolDifference difference;
  for (int32_t layer = 0; layer < g.num_layers; ++layer) {
    for (const bool v_pool : {false, true}) {
      const int64_t bytes = g.num_pages * (v_pool ? g.VPageBytes() : g.KPageBytes());
      std::vector<uint8_t> a(bytes);
      std::vector<uint8_t> b(bytes);
      EXPECT_TRUE(gpu.ReadPages(layer, v_pool, 0, a).ok());
      EXPECT_TRUE(cpu.ReadPages(layer, v_pool, 0, b).ok());
      for (int64_t i = 0; i < bytes * 8 / bits; ++i) {
        uint32_t x = 0;
        uint32_t y = 0;
        std::memcpy(&x, a.data() + i * bits / 8, bits / 8);
        std::memcpy(&y, b.data() + i * bits / 8, bits / 8);
        if (x == y) continue;
        ++difference.differing_elements;
        difference.max_ulp = std::max(difference.max_ulp, UlpDistance(x, y, bits));
      }
    }
  }
  return difference;
}

struct ScenarioStep {
  std::string what;
  std::vector<std::pair<int, int32_t>> entries;
  StepOptions options;
  std::string expected_kernel;
};

StepOptions Options(const CacheGeometry& g) {
  StepOptions options;
  options.params.sm_scale = 1.0f / std::sqrt(static_cast<float>(g.k_head_dim));
  options.params.k_scale = g.k_scale;
  options.params.v_scale = g.v_scale;
  options.return_lse = true;
  return options;
}

// The kernel of a mixed, non-deterministic step of a cache of geometry `g`: POD where the auto
// rule picks it (pod_choice.h: the separate prefill would not be the Hopper kernel), unless
// ATTND_POD says otherwise (MakeBackendPair sets the backends' pod_mode from it); the
// separate kernels ("prefill") elsewhere.
std::string MixedKernel(const CacheGeometry& g) {
  const auto waves = cuda::BatchPrefillCtasPerWave(g.k_head_dim, g.q_dtype, g.kv_dtype);
  const bool hopper_prefill = waves.ok() && waves->hopper_tile128 > 0;
  const auto mode = plan::PodModeFromEnvironment();
  plan::PodStepShape shape;
  shape.num_prefill_requests = 1;
  shape.num_decode_requests = 1;
  shape.num_prefill_rows = 12;
  shape.page_size = g.page_size;
  shape.hopper_prefill = hopper_prefill;
  return mode.ok() && plan::ChoosePod(*mode, shape) ? "pod" : "prefill";
}

// Prefill, split-KV decode, mixed with padding, windowed soft-capped decode, non-causal chunked
// prefill (mixed: POD where the auto rule picks it), and an all-padding step, in that order over
// the same sequences.
std::vector<ScenarioStep> Scenario(const CacheGeometry& g) {
  std::vector<ScenarioStep> steps;
  StepOptions options = Options(g);
  steps.push_back({"prefill", {{0, 37}, {1, 16}, {2, 5}, {3, 70}}, options, "prefill"});
  options.fixed_split_tokens = 16;  // several chunks per request: decode partials + merge
  steps.push_back({"split-KV decode", {{0, 1}, {1, 1}, {2, 1}, {3, 1}}, options, "decode"});
  options = Options(g);
  options.deterministic = true;
  steps.push_back({"mixed with padding",
                   {{0, 1}, {9, 0}, {1, 9}, {4, 20}, {2, 1}, {9, 0}},
                   options,
                   "prefill"});
  options = Options(g);
  options.return_lse = false;
  options.params.window_left = 8;
  options.params.logits_soft_cap = 30.0f;
  steps.push_back({"windowed decode with padding",
                   {{9, 0}, {0, 1}, {1, 1}, {2, 1}, {3, 1}, {4, 1}, {9, 0}},
                   options,
                   "decode"});
  options = Options(g);
  options.params.causal = false;
  steps.push_back({"non-causal chunked prefill", {{3, 12}, {0, 1}}, options, MixedKernel(g)});
  steps.push_back({"all padding", {{9, 0}, {9, 0}}, Options(g), "none"});
  return steps;
}

// gtest prints a parameter in test listings and failures; without this, as raw bytes
// (padding included), which change from build to build.
void PrintTo(const CacheConfig& c, std::ostream* os) { *os << c.name; }

class CudaBackendVsCpuTest : public ::testing::TestWithParam<CacheConfig> {};

TEST_P(CudaBackendVsCpuTest, MatchesTheReferenceStepByStep) {
  SKIP_WITHOUT_GPU();
  const CacheConfig& config = GetParam();
  const CacheGeometry geometry = GeometryOf(config);
  RecordingObserver observer;
  auto backends = MakeBackendPair(geometry, int64_t{64} << 20, &observer);
  ASSERT_TRUE(backends.ok()) << backends.status();
  BackendCache& gpu = *backends->gpu;
  BackendCache& cpu = *backends->cpu;

  const bool exact_pools =
      config.rope == RopeStyle::kNone && config.kv_dtype != DType::kFloat8E4M3;
  const double o_tolerance = config.q_dtype == DType::kFloat16 ? 5e-3 : 1e-2;
  SequenceBook book(geometry, config.separate_kv, /*seed=*/7);
  std::mt19937 rng(1234);
  for (const ScenarioStep& scenario : Scenario(geometry)) {
    SCOPED_TRACE(scenario.what);
    const std::shared_ptr<StepBatch> batch = book.Plan(scenario.entries, scenario.options);
    std::vector<LayerInputs> inputs(geometry.num_layers);
    const int64_t tokens = batch->num_tokens;
    for (LayerInputs& layer : inputs) {
      layer.q = RandomTensor(geometry.q_dtype, tokens * geometry.num_qo_heads * geometry.k_head_dim, rng);
      layer.k = RandomTensor(geometry.q_dtype, tokens * geometry.num_kv_heads * geometry.k_head_dim, rng);
      layer.v = RandomTensor(geometry.q_dtype, tokens * geometry.num_kv_heads * geometry.v_head_dim, rng);
    }
    const StepRun on_gpu = RunStep(gpu, batch, inputs);
    const StepRun on_cpu = RunStep(cpu, batch, inputs);
    EXPECT_EQ(on_gpu.kernel, scenario.expected_kernel);
    ASSERT_EQ(on_gpu.layers.size(), on_cpu.layers.size());
    for (size_t layer = 0; layer < on_gpu.layers.size(); ++layer) {
      SCOPED_TRACE(::testing::Message() << "layer " << layer);
      const LayerResult& a = on_gpu.layers[layer];
      const LayerResult& b = on_cpu.layers[layer];
      ASSERT_TRUE(a.status.ok()) << a.status;
      ASSERT_TRUE(b.status.ok()) << b.status;
      EXPECT_FALSE(a.on_caller_thread) << "done must come from a backend thread";
      const Error o_error = NormwiseError(geometry.q_dtype, a.o, b.o);
      EXPECT_FALSE(o_error.nan) << "an element of o was not written";
      EXPECT_LE(o_error.relative, o_tolerance);
      const double lse_error = MaxLseDifference(a.lse, b.lse);
      EXPECT_LE(lse_error, 2e-3);
      std::printf("[ %s | %s | layer %zu ] kernel %s, o rel err %.2e, lse max abs diff %.2e\n",
                  config.name.c_str(), scenario.what.c_str(), layer, on_gpu.kernel.c_str(),
                  o_error.relative, lse_error);
    }
    const PoolDifference pools = ComparePools(gpu, cpu);
    std::printf("[ %s | %s ] pools: %lld elements differ, max %lld ulp\n", config.name.c_str(),
                scenario.what.c_str(), static_cast<long long>(pools.differing_elements),
                static_cast<long long>(pools.max_ulp));
    if (exact_pools) {
      EXPECT_EQ(pools.differing_elements, 0);
    } else {
      EXPECT_LE(pools.max_ulp, 1);
    }
  }
  EXPECT_GT(observer.Count("append/append"), 0);
  EXPECT_GT(observer.Count("decode/decode"), 0);
  EXPECT_GT(observer.Count("prefill/prefill"), 0);
  EXPECT_GT(observer.Count("decode/mixed"), 0);  // the mixed step's decode rows
  EXPECT_GT(observer.Count("prefill/mixed"), 0);
  EXPECT_EQ(observer.non_positive(), 0) << "kernel times must be positive";
  // Each report names the device of the cache it ran for (the GPU's or the CPU's pretend one).
  EXPECT_EQ(observer.devices(), (std::set<int32_t>{gpu.device(), cpu.device()}));
  EXPECT_GT(observer.Bytes("h2d"), 0);
  EXPECT_GT(observer.Bytes("d2h"), 0);
}

std::vector<CacheConfig> Configs() {
  std::vector<CacheConfig> configs;
  {
    CacheConfig c;
    c.name = "bf16_nhd_d128_g4_p16";
    configs.push_back(c);
  }
  {
    CacheConfig c;
    c.name = "bf16_hnd_d64_g1_p4_neox";
    c.head_dim = 64;
    c.num_qo_heads = 4;
    c.num_kv_heads = 4;
    c.page_size = 4;
    c.layout = KvLayout::kHND;
    c.rope = RopeStyle::kNeox;
    configs.push_back(c);
  }
  {
    CacheConfig c;
    c.name = "fp16_hnd_d128_g8_p8_interleaved_rot32";
    c.q_dtype = c.kv_dtype = DType::kFloat16;
    c.num_qo_heads = 16;
    c.num_kv_heads = 2;
    c.page_size = 8;
    c.layout = KvLayout::kHND;
    c.rope = RopeStyle::kInterleaved;
    c.rotary_dim = 32;
    configs.push_back(c);
  }
  {
    CacheConfig c;
    c.name = "fp8kv_bf16q_nhd_d128_g8_p16_neox";
    c.kv_dtype = DType::kFloat8E4M3;
    c.num_qo_heads = 8;
    c.num_kv_heads = 1;
    c.rope = RopeStyle::kNeox;
    c.k_scale = 0.5f;
    c.v_scale = 2.0f;
    configs.push_back(c);
  }
  {
    CacheConfig c;
    c.name = "bf16_nhd_d128_g4_p8_separate_kv";
    c.page_size = 8;
    c.separate_kv = true;
    configs.push_back(c);
  }
  {
    CacheConfig c;
    c.name = "bf16_nhd_d256_g2_p1_neox";
    c.head_dim = 256;
    c.num_qo_heads = 2;
    c.num_kv_heads = 1;
    c.page_size = 1;
    c.rope = RopeStyle::kNeox;
    configs.push_back(c);
  }
  {
    CacheConfig c;
    c.name = "fp8kv_fp16q_hnd_d64_g2_p32_separate_kv";
    c.q_dtype = DType::kFloat16;
    c.kv_dtype = DType::kFloat8E4M3;
    c.head_dim = 64;
    c.num_qo_heads = 4;
    c.num_kv_heads = 2;
    c.page_size = 32;
    c.layout = KvLayout::kHND;
    c.separate_kv = true;
    c.v_scale = 0.25f;
    configs.push_back(c);
  }
  {
    // Group 16: no CUDA-core decode kernel, so decode rows run the tensor-core one (issue 14).
    CacheConfig c;
    c.name = "bf16_nhd_d128_g16_p16_tensor_core_decode";
    c.num_qo_heads = 32;
    c.num_kv_heads = 2;
    c.rope = RopeStyle::kNeox;
    configs.push_back(c);
  }
  return configs;
}

INSTANTIATE_TEST_SUITE_P(Configs, CudaBackendVsCpuTest, ::testing::ValuesIn(Configs()),
                         [](const ::testing::TestParamInfo<CacheConfig>& info) {
                           return info.param.name;
                         });

// ---- MLA caches: the CUDA backend against the CPU backend ----
//
// Every MLA row runs the MLA decode kernel (prefill rows unsplit, rows of up to 4 tokens with
// KV-split), after the fused ckv/kpe append with RoPE on kpe and q_pe. Tolerances: o normwise
// relative error <= 1.5e-2 for 16-bit caches (P and o rounded to 16 bits on the GPU, o rounded on
// both sides), <= 5e-2 for fp8 caches; lse within 5e-3 + 5e-4 |lse|. Pools as for MHA: bitwise
// without RoPE on a 16-bit cache, else within one ulp.

// Chunked prefill (several chunks per sequence), decode, speculative rows (2..4 tokens),
// padding, lse on and off, pinned and automatic KV-split, deterministic mode, soft cap and
// window, non-causal; in that order over the same sequences.
std::vector<ScenarioStep> MlaScenario(const CacheGeometry& g) {
  std::vector<ScenarioStep> steps;
  StepOptions options = MlaOptions(g);
  steps.push_back({"prefill, first chunks", {{0, 37}, {1, 16}, {2, 5}, {3, 70}}, options,
                   "mla_prefill"});
  steps.push_back({"chunked prefill + decode + speculative rows + padding",
                   {{0, 1}, {9, 0}, {1, 40}, {3, 3}, {4, 20}, {2, 1}, {9, 0}},
                   options,
                   "mla_prefill"});
  options.fixed_split_tokens = 16;  // several chunks per request: partials + merge
  steps.push_back({"split-KV decode", {{0, 1}, {1, 1}, {2, 1}, {3, 1}, {4, 1}}, options,
                   "mla_decode"});
  options.fixed_split_tokens = 32;
  steps.push_back({"split-KV speculative rows with prefill", {{0, 4}, {2, 2}, {1, 1}, {4, 9}},
                   options, "mla_prefill"});
  options = MlaOptions(g);
  options.deterministic = true;
  steps.push_back({"deterministic mixed with padding",
                   {{0, 2}, {1, 1}, {9, 0}, {3, 12}, {4, 1}},
                   options,
                   "mla_prefill"});
  options = MlaOptions(g);
  options.return_lse = false;
  steps.push_back({"decode without lse", {{9, 0}, {0, 1}, {1, 1}, {2, 1}, {3, 1}, {4, 1}},
                   options, "mla_decode"});
  options = MlaOptions(g);
  options.params.window_left = 24;
  options.params.logits_soft_cap = 20.0f;
  steps.push_back({"windowed soft-capped mixed", {{0, 1}, {3, 6}, {1, 1}}, options,
                   "mla_prefill"});
  options = MlaOptions(g);
  options.params.causal = false;
  steps.push_back({"non-causal chunked prefill", {{3, 12}, {0, 1}}, options, "mla_prefill"});
  steps.push_back({"all padding", {{9, 0}, {9, 0}}, MlaOptions(g), "none"});
  return steps;
}

std::vector<LayerInputs> RandomMlaInputs(const CacheGeometry& g, int64_t tokens,
                                         std::mt19937& rng) {
  std::vector<LayerInputs> inputs(g.num_layers);
  for (LayerInputs& layer : inputs) {
    layer.q = RandomTensor(g.q_dtype, tokens * g.num_qo_heads * g.k_head_dim, rng);
    layer.q_pe = RandomTensor(g.q_dtype, tokens * g.num_qo_heads * g.v_head_dim, rng);
    layer.ckv = RandomTensor(g.q_dtype, tokens * g.k_head_dim, rng);
    layer.kpe = RandomTensor(g.q_dtype, tokens * g.v_head_dim, rng);
  }
  return inputs;
}

class CudaBackendMlaVsCpuTest : public ::testing::TestWithParam<MlaCacheConfig> {};

TEST_P(CudaBackendMlaVsCpuTest, MatchesTheReferenceStepByStep) {
  SKIP_WITHOUT_GPU();
  const MlaCacheConfig& config = GetParam();
  const CacheGeometry geometry = MlaGeometryOf(config);
  RecordingObserver observer;
  auto backends = MakeBackendPair(geometry, int64_t{128} << 20, &observer);
  ASSERT_TRUE(backends.ok()) << backends.status();
  BackendCache& gpu = *backends->gpu;
  BackendCache& cpu = *backends->cpu;

  const bool fp8 = config.kv_dtype == DType::kFloat8E4M3;
  const bool exact_pools = config.rope == RopeStyle::kNone && !fp8;
  const double o_tolerance = fp8 ? 5e-2 : 1.5e-2;
  SequenceBook book(geometry, config.separate_kv, /*seed=*/11);
  std::mt19937 rng(4321);
  for (const ScenarioStep& scenario : MlaScenario(geometry)) {
    SCOPED_TRACE(scenario.what);
    const std::shared_ptr<StepBatch> batch = book.Plan(scenario.entries, scenario.options);
    const std::vector<LayerInputs> inputs = RandomMlaInputs(geometry, batch->num_tokens, rng);
    const StepRun on_gpu = RunStep(gpu, batch, inputs);
    const StepRun on_cpu = RunStep(cpu, batch, inputs);
    EXPECT_EQ(on_gpu.kernel, scenario.expected_kernel);
    EXPECT_EQ(on_gpu.kernel, on_cpu.kernel);
    ASSERT_EQ(on_gpu.layers.size(), on_cpu.layers.size());
    for (size_t layer = 0; layer < on_gpu.layers.size(); ++layer) {
      SCOPED_TRACE(::testing::Message() << "layer " << layer);
      const LayerResult& a = on_gpu.layers[layer];
      const LayerResult& b = on_cpu.layers[layer];
      ASSERT_TRUE(a.status.ok()) << a.status;
      ASSERT_TRUE(b.status.ok()) << b.status;
      EXPECT_FALSE(a.on_caller_thread) << "done must come from a backend thread";
      const Error o_error = NormwiseError(geometry.q_dtype, a.o, b.o);
      EXPECT_FALSE(o_error.nan) << "an element of o was not written";
      EXPECT_LE(o_error.relative, o_tolerance);
      double lse_excess = 0.0;  // worst |a - b| beyond the tolerance
      double lse_worst = 0.0;
      for (size_t i = 0; i < a.lse.size(); ++i) {
        if (std::isinf(b.lse[i]) || std::isinf(a.lse[i])) {
          if (a.lse[i] != b.lse[i]) lse_excess = INFINITY;
          continue;
        }
        const double difference = std::fabs(static_cast<double>(a.lse[i]) - b.lse[i]);
        if (std::isnan(difference)) {
          lse_excess = NAN;
          break;
        }
        lse_worst = std::max(lse_worst, difference);
        lse_excess = std::max(lse_excess, difference - (5e-3 + 5e-4 * std::fabs(b.lse[i])));
      }
      EXPECT_LE(lse_excess, 0.0) << "lse beyond tolerance; max abs diff " << lse_worst;
      std::printf("[ %s | %s | layer %zu ] kernel %s, o rel err %.2e, lse max abs diff %.2e\n",
                  config.name.c_str(), scenario.what.c_str(), layer, on_gpu.kernel.c_str(),
                  o_error.relative, lse_worst);
    }
    const PoolDifference pools = ComparePools(gpu, cpu);
    std::printf("[ %s | %s ] pools: %lld elements differ, max %lld ulp\n", config.name.c_str(),
                scenario.what.c_str(), static_cast<long long>(pools.differing_elements),
                static_cast<long long>(pools.max_ulp));
    if (exact_pools) {
      EXPECT_EQ(pools.differing_elements, 0);
    } else {
      EXPECT_LE(pools.max_ulp, 1);
    }
  }
  EXPECT_GT(observer.Count("append/append"), 0);
  EXPECT_GT(observer.Count("mla_prefill/prefill"), 0);
  EXPECT_GT(observer.Count("mla_prefill/mixed"), 0);
  EXPECT_GT(observer.Count("mla_decode/decode"), 0);
  EXPECT_EQ(observer.non_positive(), 0) << "kernel times must be positive";
  // Each report names the device of the cache it ran for (the GPU's or the CPU's pretend one).
  EXPECT_EQ(observer.devices(), (std::set<int32_t>{gpu.device(), cpu.device()}));
  EXPECT_GT(observer.Bytes("h2d"), 0);
  EXPECT_GT(observer.Bytes("d2h"), 0);
}

std::vector<MlaCacheConfig> MlaConfigs() {
  std::vector<MlaCacheConfig> configs;
  {
    MlaCacheConfig c;
    c.name = "bf16_r512_h16_p64_shared_neox";
    configs.push_back(c);
  }
  {
    MlaCacheConfig c;
    c.name = "bf16_r512_h128_p32_separate_kv_neox";
    c.num_heads = 128;
    c.page_size = 32;
    c.separate_kv = true;
    configs.push_back(c);
  }
  {
    MlaCacheConfig c;
    c.name = "fp8kv_bf16q_r512_h128_p64_shared_interleaved";
    c.kv_dtype = DType::kFloat8E4M3;
    c.num_heads = 128;
    c.rope = RopeStyle::kInterleaved;
    c.k_scale = 0.5f;
    c.v_scale = 2.0f;
    configs.push_back(c);
  }
  {
    MlaCacheConfig c;
    c.name = "fp8kv_fp16q_r256_h16_p32_separate_kv_neox";
    c.q_dtype = DType::kFloat16;
    c.kv_dtype = DType::kFloat8E4M3;
    c.kv_lora_rank = 256;
    c.page_size = 32;
    c.separate_kv = true;
    c.k_scale = 0.25f;
    c.v_scale = 0.5f;
    configs.push_back(c);
  }
  {
    MlaCacheConfig c;
    c.name = "fp16_r256_h128_p64_shared_norope";
    c.q_dtype = c.kv_dtype = DType::kFloat16;
    c.kv_lora_rank = 256;
    c.num_heads = 128;
    c.rope = RopeStyle::kNone;
    configs.push_back(c);
  }
  {
    MlaCacheConfig c;
    c.name = "bf16_r512_h24_p32_separate_kv_neox_rot32";  // 24 heads: row tiles cut tokens
    c.num_heads = 24;
    c.page_size = 32;
    c.separate_kv = true;
    c.rotary_dim = 32;
    configs.push_back(c);
  }
  {
    MlaCacheConfig c;
    c.name = "bf16_r256_h16_p64_shared_norope";
    c.kv_lora_rank = 256;
    c.rope = RopeStyle::kNone;
    configs.push_back(c);
  }
  return configs;
}

INSTANTIATE_TEST_SUITE_P(MlaConfigs, CudaBackendMlaVsCpuTest, ::testing::ValuesIn(MlaConfigs()),
                         [](const ::testing::TestParamInfo<MlaCacheConfig>& info) {
                           return info.param.name;
                         });

// deterministic=true: a request's o and lse are bitwise the same whether it runs alone or among
// others, at another row, in another cache (same inputs, same history), for its prefill rows
// (unsplit) and its decode row (split in pinned 64-token chunks) alike.
TEST(CudaBackendMlaTest, DeterministicRequestIsBitwiseBatchInvariant) {
  SKIP_WITHOUT_GPU();
  MlaCacheConfig config;
  config.num_heads = 64;
  config.num_layers = 1;
  const CacheGeometry g = MlaGeometryOf(config);
  CudaBackendOptions options;
  options.kv_budget_bytes = int64_t{128} << 20;
  auto backend = MakeCudaBackend(options);
  ASSERT_TRUE(backend.ok()) << backend.status();
  auto alone = (*backend)->CreateCache(g);
  auto crowded = (*backend)->CreateCache(g);
  ASSERT_TRUE(alone.ok() && crowded.ok());
  SequenceBook book_alone(g, false, 1);
  SequenceBook book_crowded(g, true, 2);
  StepOptions step_options = MlaOptions(g);
  step_options.deterministic = true;
  step_options.fixed_split_tokens = 64;
  std::mt19937 rng(99);
  auto rows_of = [&](int64_t rows) { return RandomMlaInputs(g, rows, rng)[0]; };
  auto append = [](LayerInputs& to, const LayerInputs& from) {
    for (auto [a, b] : {std::pair{&to.q, &from.q}, std::pair{&to.q_pe, &from.q_pe},
                        std::pair{&to.ckv, &from.ckv}, std::pair{&to.kpe, &from.kpe}}) {
      a->insert(a->end(), b->begin(), b->end());
    }
  };
  const int64_t o_row_bytes = int64_t{g.num_qo_heads} * g.k_head_dim * DTypeBytes(g.q_dtype);
  struct Phase {
    int32_t rows;                                        // of sequence 0
    std::vector<std::pair<int, int32_t>> before, after;  // the crowded batch's other entries
  };
  const Phase phases[] = {{300, {{1, 50}}, {{2, 7}}}, {1, {{2, 1}, {9, 0}}, {{1, 3}, {3, 20}}}};
  for (const Phase& phase : phases) {
    SCOPED_TRACE(::testing::Message() << phase.rows << " rows");
    const LayerInputs mine = rows_of(phase.rows);
    LayerInputs together;
    std::vector<std::pair<int, int32_t>> entries = phase.before;
    int64_t my_row = 0;
    for (const auto& [id, rows] : phase.before) {
      append(together, rows_of(rows));
      my_row += rows;
    }
    append(together, mine);
    entries.push_back({0, phase.rows});
    for (const auto& entry : phase.after) {
      append(together, rows_of(entry.second));
      entries.push_back(entry);
    }
    const StepRun a = RunStep(**alone, book_alone.Plan({{0, phase.rows}}, step_options), {mine});
    const StepRun b = RunStep(**crowded, book_crowded.Plan(entries, step_options), {together});
    ASSERT_EQ(a.layers.size(), 1u);
    ASSERT_EQ(b.layers.size(), 1u);
    ASSERT_TRUE(a.layers[0].status.ok() && b.layers[0].status.ok());
    EXPECT_EQ(std::memcmp(a.layers[0].o.data(), b.layers[0].o.data() + my_row * o_row_bytes,
                          phase.rows * o_row_bytes),
              0)
        << "o differs between batches";
    EXPECT_EQ(std::memcmp(a.layers[0].lse.data(), b.layers[0].lse.data() + my_row * g.num_qo_heads,
                          phase.rows * g.num_qo_heads * sizeof(float)),
              0)
        << "lse differs between batches";
  }
}

// ---- Backend-level behaviour ----

std::unique_ptr<Backend> SmallCudaBackend(int64_t budget_bytes) {
  CudaBackendOptions options;
  options.kv_budget_bytes = budget_bytes;
  auto backend = MakeCudaBackend(options);
  EXPECT_TRUE(backend.ok()) << backend.status();
  return backend.ok() ? std::move(backend).value() : nullptr;
}

// A mixed step the planner runs side by side (its decode and its Hopper prefill on two streams,
// the prefill over part of the SMs: StepPlan::side_by_side_prefill_ctas) gives bitwise the o and
// lse of the same step one kernel after the other (CudaBackendOptions::side_by_side = false):
// the same work items, whatever the persistent grid. (The sequential path is checked against the
// CPU reference by CudaBackendVsCpuTest.)
TEST(CudaBackendTest, MixedStepsSideBySideMatchOneAfterTheOtherBitwise) {
  SKIP_WITHOUT_GPU();
  CacheGeometry g;
  g.num_layers = 2;
  g.num_qo_heads = 32;
  g.num_kv_heads = 8;
  g.k_head_dim = g.v_head_dim = 128;
  g.page_size = 16;
  g.num_pages = 1280;
  g.q_dtype = g.kv_dtype = DType::kBFloat16;
  g.rope.style = RopeStyle::kNeox;
  g.rope.rotary_dim = 128;
  const auto waves = cuda::BatchPrefillCtasPerWave(g.k_head_dim, g.q_dtype, g.kv_dtype);
  ASSERT_TRUE(waves.ok()) << waves.status();
  if (waves->hopper_tile128 == 0) GTEST_SKIP() << "side by side needs the Hopper prefill kernel (sm_90a)";
  std::vector<std::unique_ptr<Backend>> backends;
  std::vector<std::unique_ptr<BackendCache>> caches;
  for (bool side_by_side : {true, false}) {
    CudaBackendOptions options;
    options.kv_budget_bytes = int64_t{256} << 20;
    options.side_by_side = side_by_side;
    auto backend = MakeCudaBackend(options);
    ASSERT_TRUE(backend.ok()) << backend.status();
    auto cache = (*backend)->CreateCache(g);
    ASSERT_TRUE(cache.ok()) << cache.status();
    backends.push_back(*std::move(backend));
    caches.push_back(*std::move(cache));
  }
  SequenceBook book(g, /*separate_kv=*/false, /*seed=*/11);
  StepOptions options = Options(g);
  std::vector<std::pair<int, int32_t>> prompts, mixed_entries;
  for (int s = 0; s < 24; ++s) {
    prompts.push_back({s, 600 + 7 * s});
    mixed_entries.push_back({s, 1});
  }
  mixed_entries.insert(mixed_entries.begin() + 9, {100, 200});  // a new prompt among the decodes
  std::mt19937 rng(77);
  for (int step = 0; step < 2; ++step) {
    const std::shared_ptr<StepBatch> batch = book.Plan(step == 0 ? prompts : mixed_entries, options);
    if (step == 1) {
      // The premise: the planner puts this step side by side.
      ASSERT_GT(plan::SideBySidePrefillCtas(*batch, g, waves->hopper_tile128), 0);
    }
    std::vector<LayerInputs> inputs(g.num_layers);
    const int64_t tokens = batch->num_tokens;
    for (LayerInputs& layer : inputs) {
      layer.q = RandomTensor(g.q_dtype, tokens * g.num_qo_heads * g.k_head_dim, rng);
      layer.k = RandomTensor(g.q_dtype, tokens * g.num_kv_heads * g.k_head_dim, rng);
      layer.v = RandomTensor(g.q_dtype, tokens * g.num_kv_heads * g.v_head_dim, rng);
    }
    const StepRun side = RunStep(*caches[0], batch, inputs);
    const StepRun sequential = RunStep(*caches[1], batch, inputs);
    ASSERT_EQ(side.layers.size(), sequential.layers.size());
    for (size_t layer = 0; layer < side.layers.size(); ++layer) {
      SCOPED_TRACE(::testing::Message() << side.kernel << " step, layer " << layer);
      ASSERT_TRUE(side.layers[layer].status.ok()) << side.layers[layer].status;
      ASSERT_TRUE(sequential.layers[layer].status.ok()) << sequential.layers[layer].status;
      EXPECT_TRUE(side.layers[layer].o == sequential.layers[layer].o);
      EXPECT_EQ(std::memcmp(side.layers[layer].lse.data(), sequential.layers[layer].lse.data(),
                            side.layers[layer].lse.size() * sizeof(float)),
                0);
      const Error o_error = NormwiseError(g.q_dtype, side.layers[layer].o, sequential.layers[layer].o);
      EXPECT_FALSE(o_error.nan) << "an element of o was not written";
    }
  }
}

TEST(CudaBackendTest, InfoDescribesTheDeviceAndWhatWorks) {
  SKIP_WITHOUT_GPU();
  auto backend = SmallCudaBackend(int64_t{16} << 20);
  ASSERT_NE(backend, nullptr);
  const BackendInfo info = backend->Info();
  EXPECT_EQ(info.name, "cuda");
  EXPECT_FALSE(info.device.empty());
  EXPECT_GT(info.num_sms, 0);
  EXPECT_GT(info.device_memory_bytes, info.kv_budget_bytes);
  EXPECT_EQ(info.kv_budget_bytes, int64_t{16} << 20);
  EXPECT_EQ(backend->KvFreeBytes(), info.kv_budget_bytes);
  const auto& ext = info.extensions;
  EXPECT_NE(std::find(ext.begin(), ext.end(), "fp8_kv"), ext.end());
  EXPECT_NE(std::find(ext.begin(), ext.end(), "separate_kv_index"), ext.end());
  EXPECT_NE(std::find(ext.begin(), ext.end(), "mla"), ext.end());
  if (std::getenv("ATTND_POD") == nullptr) {
    EXPECT_NE(std::find(ext.begin(), ext.end(), "pod"), ext.end());
  }
  std::printf("device %s, %d SMs, %lld bytes\n", info.device.c_str(), info.num_sms,
              static_cast<long long>(info.device_memory_bytes));
}

TEST(CudaBackendTest, ServesMlaCachesAndRefusesUnsupportedMlaShapesByName) {
  SKIP_WITHOUT_GPU();
  auto backend = SmallCudaBackend(int64_t{16} << 20);
  ASSERT_NE(backend, nullptr);
  CacheGeometry g;
  g.mla = true;
  g.num_layers = 1;
  g.num_qo_heads = 16;
  g.num_kv_heads = 1;
  g.k_head_dim = 512;
  g.v_head_dim = 64;
  g.page_size = 64;
  g.num_pages = 4;
  {
    const auto cache = backend->CreateCache(g);
    EXPECT_TRUE(cache.ok()) << cache.status();
  }
  EXPECT_EQ(backend->KvFreeBytes(), int64_t{16} << 20);
  CacheGeometry rank = g;
  rank.k_head_dim = 384;
  auto refused = backend->CreateCache(rank);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kUnimplemented) << refused.status();
  EXPECT_NE(std::string(refused.status().message()).find("kv_lora_rank"), std::string::npos)
      << refused.status();
  CacheGeometry rope = g;
  rope.v_head_dim = 32;
  refused = backend->CreateCache(rope);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kUnimplemented) << refused.status();
  EXPECT_NE(std::string(refused.status().message()).find("rope_dim"), std::string::npos)
      << refused.status();
  EXPECT_EQ(backend->KvFreeBytes(), int64_t{16} << 20);
}

TEST(CudaBackendTest, CachesCarveTheBudgetAndGiveItBack) {
  SKIP_WITHOUT_GPU();
  auto backend = SmallCudaBackend(int64_t{8} << 20);
  ASSERT_NE(backend, nullptr);
  CacheConfig config;
  CacheGeometry g = GeometryOf(config);
  g.num_layers = 1;
  g.num_pages = (int64_t{3} << 20) / g.BytesPerPage();  // 3 MiB
  auto first = backend->CreateCache(g);
  auto second = backend->CreateCache(g);
  ASSERT_TRUE(first.ok()) << first.status();
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ(backend->KvFreeBytes(), (int64_t{8} << 20) - 2 * g.PoolBytes());
  const auto third = backend->CreateCache(g);
  EXPECT_EQ(third.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(std::string(third.status().message()).find("free"), std::string::npos);
  first->reset();
  EXPECT_EQ(backend->KvFreeBytes(), (int64_t{8} << 20) - g.PoolBytes());
  auto again = backend->CreateCache(g);
  ASSERT_TRUE(again.ok()) << again.status();
  // A fresh cache over reused memory reads as zeros.
  std::vector<uint8_t> bytes(g.num_pages * g.KPageBytes(), 0xAB);
  ASSERT_TRUE((*again)->ReadPages(0, false, 0, bytes).ok());
  EXPECT_TRUE(std::all_of(bytes.begin(), bytes.end(), [](uint8_t b) { return b == 0; }));
  EXPECT_EQ((*again)->ReadPages(1, false, 0, bytes).code(), absl::StatusCode::kOutOfRange);
}

// Runs everywhere: without a device (or driver) auto serves on the CPU and cuda is refused.
TEST(CudaBackendTest, AutoPicksCudaExactlyWhenADeviceIsVisible) {
  BackendFactoryOptions options;
  options.kv_memory_bytes = int64_t{16} << 20;
  auto backend = MakeBackend(options);
  ASSERT_TRUE(backend.ok()) << backend.status();
  EXPECT_EQ((*backend)->Info().name, HaveGpu() ? "cuda" : "cpu");
  options.kind = BackendKind::kCuda;
  backend = MakeBackend(options);
  if (HaveGpu()) {
    EXPECT_TRUE(backend.ok()) << backend.status();
  } else {
    EXPECT_EQ(backend.status().code(), absl::StatusCode::kFailedPrecondition);
  }
}

}  // namespace
}  // namespace attnd
