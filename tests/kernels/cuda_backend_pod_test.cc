// The CUDA backend with POD forced on (ATTND_POD=on) against the CPU backend: mixed steps run as
// one fused launch (kernel label "pod"), their o and lse match the reference, deterministic
// mixed steps keep the separate kernels, and decode-only and prefill-only steps are unchanged.
// GPU tests skip without a device.
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "backend/cpu_backend.h"
#include "backend/cuda_backend.h"
#include "cuda_backend_test_util.h"
#include "gtest/gtest.h"

namespace attnd {
namespace {

using testing::Error;
using testing::MakeBackendPair;
using testing::MaxLseDifference;
using testing::NormwiseError;
using testing::RandomTensor;
using testing::SequenceBook;

class KernelCounter final : public BackendObserver {
 public:
  void OnKernel(std::string_view kernel, std::string_view phase, double seconds,
                int32_t /*device*/) override {
    std::lock_guard lock(mu_);
    ++counts_[std::string(kernel) + "/" + std::string(phase)];
    if (!(seconds > 0.0)) ++non_positive_;
  }
  void OnTransfer(std::string_view, int64_t, int32_t) override {}
  int Count(const std::string& kernel_phase) {
    std::lock_guard lock(mu_);
    return counts_[kernel_phase];
  }
  int non_positive() {
    std::lock_guard lock(mu_);
    return non_positive_;
  }

 private:
  std::mutex mu_;
  std::map<std::string, int> counts_;
  int non_positive_ = 0;
};

struct LayerOut {
  absl::Status status = absl::UnknownError("done not called");
  std::vector<uint8_t> o;
  std::vector<float> lse;
};

struct StepResult {
  std::string kernel;
  std::vector<LayerOut> layers;
};

// Every layer of the step in flight at once, outputs poisoned first.
StepResult RunStep(BackendCache& cache, const std::shared_ptr<StepBatch>& batch,
            const std::vector<std::vector<std::vector<uint8_t>>>& qkv) {
  const CacheGeometry& g = cache.geometry();
  StepResult run;
  auto step = cache.PrepareStep(batch);
  EXPECT_TRUE(step.ok()) << step.status();
  if (!step.ok()) return run;
  run.kernel = std::string((*step)->KernelName());
  run.layers.resize(g.num_layers);
  std::mutex mu;
  std::condition_variable done;
  int remaining = g.num_layers;
  for (int32_t layer = 0; layer < g.num_layers; ++layer) {
    LayerOut& out = run.layers[layer];
    out.o.assign(batch->num_tokens * g.num_qo_heads * g.v_head_dim * DTypeBytes(g.q_dtype), 0xFF);
    out.lse.assign(batch->num_tokens * g.num_qo_heads, std::nanf(""));
    LayerIo io;
    io.layer = layer;
    io.q = qkv[layer][0].data();
    io.k = qkv[layer][1].data();
    io.v = qkv[layer][2].data();
    io.o = out.o.data();
    io.lse = batch->options.return_lse ? out.lse.data() : nullptr;
    (*step)->RunLayer(io, [&, layer](absl::Status status) {
      std::lock_guard lock(mu);
      run.layers[layer].status = status;
      if (--remaining == 0) done.notify_all();
    });
  }
  std::unique_lock lock(mu);
  done.wait(lock, [&] { return remaining == 0; });
  return run;
}

struct Geometry {
  std::string name;
  DType kv_dtype;
  int32_t page_size;
  int32_t num_qo_heads;
  int32_t num_kv_heads;
};

TEST(CudaBackendPodTest, MixedStepsRunPodAndMatchTheCpuBackend) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  ::setenv("ATTND_POD", "on", 1);  // MakeBackendPair sets the backends' pod_mode from it
  for (const Geometry& shape : {Geometry{"bf16_g4_p16", DType::kBFloat16, 16, 8, 2},
                                Geometry{"fp8_g8_p1", DType::kFloat8E4M3, 1, 8, 1},
                                Geometry{"bf16_g1_p16", DType::kBFloat16, 16, 4, 4}}) {
    SCOPED_TRACE(shape.name);
    CacheGeometry g;
    g.num_layers = 2;
    g.num_qo_heads = shape.num_qo_heads;
    g.num_kv_heads = shape.num_kv_heads;
    g.k_head_dim = g.v_head_dim = 128;
    g.page_size = shape.page_size;
    g.num_pages = 16384 / shape.page_size + 64;  // every step below fits
    g.kv_dtype = shape.kv_dtype;
    g.q_dtype = DType::kBFloat16;
    if (shape.kv_dtype == DType::kFloat8E4M3) {
      g.k_scale = 0.5f;
      g.v_scale = 2.0f;
    }
    KernelCounter observer;
    auto backends = MakeBackendPair(g, int64_t{256} << 20, &observer);
    ASSERT_TRUE(backends.ok()) << backends.status();
    BackendCache& gpu = *backends->gpu;
    BackendCache& cpu = *backends->cpu;

    StepOptions options;
    options.params.sm_scale = 1.0f / std::sqrt(128.0f);
    options.params.k_scale = g.k_scale;
    options.params.v_scale = g.v_scale;
    options.return_lse = true;
    StepOptions deterministic = options;
    deterministic.deterministic = true;
    struct Step {
      std::string what;
      std::vector<std::pair<int, int32_t>> entries;
      StepOptions options;
      std::string kernel;
    };
    std::vector<std::pair<int, int32_t>> history, mixed, mixed_again;
    for (int id = 0; id < 24; ++id) history.push_back({id, 20 + 13 * id});
    // Decodes of every history sequence, a new prompt, a chunk of an old one, padding.
    for (int id = 0; id < 24; ++id) mixed.push_back({id, 1});
    mixed.insert(mixed.begin() + 5, {100, 700});
    mixed.insert(mixed.begin() + 11, {999, 0});
    mixed.push_back({3, 90});
    mixed.erase(mixed.begin() + 3);  // sequence 3 takes its chunk instead of a decode
    for (int id = 0; id < 24; ++id) mixed_again.push_back({id, id == 7 ? 33 : 1});
    const std::vector<Step> steps = {
        {"prefill", history, options, "prefill"},
        {"mixed", mixed, options, "pod"},
        {"decode", std::vector<std::pair<int, int32_t>>(mixed_again.begin(), mixed_again.begin() + 7), options,
         "decode"},
        {"mixed, deterministic", mixed_again, deterministic, "prefill"},
    };
    SequenceBook book(g, /*separate_kv=*/false, /*seed=*/11);
    std::mt19937 rng(77);
    for (const Step& scenario : steps) {
      SCOPED_TRACE(scenario.what);
      const std::shared_ptr<StepBatch> batch = book.Plan(scenario.entries, scenario.options);
      std::vector<std::vector<std::vector<uint8_t>>> qkv(g.num_layers);
      for (auto& layer : qkv) {
        layer.push_back(RandomTensor(g.q_dtype, batch->num_tokens * g.num_qo_heads * 128, rng));
        layer.push_back(RandomTensor(g.q_dtype, batch->num_tokens * g.num_kv_heads * 128, rng));
        layer.push_back(RandomTensor(g.q_dtype, batch->num_tokens * g.num_kv_heads * 128, rng));
      }
      const StepResult on_gpu = RunStep(gpu, batch, qkv);
      const StepResult on_cpu = RunStep(cpu, batch, qkv);
      EXPECT_EQ(on_gpu.kernel, scenario.kernel);
      ASSERT_EQ(on_gpu.layers.size(), on_cpu.layers.size());
      for (size_t layer = 0; layer < on_gpu.layers.size(); ++layer) {
        ASSERT_TRUE(on_gpu.layers[layer].status.ok()) << on_gpu.layers[layer].status;
        ASSERT_TRUE(on_cpu.layers[layer].status.ok()) << on_cpu.layers[layer].status;
        const Error error = NormwiseError(g.q_dtype, on_gpu.layers[layer].o, on_cpu.layers[layer].o);
        EXPECT_FALSE(error.nan) << "an element of o was not written";
        EXPECT_LE(error.relative, 1e-2);
        const double lse = MaxLseDifference(on_gpu.layers[layer].lse, on_cpu.layers[layer].lse);
        EXPECT_LE(lse, 2e-3);
        std::printf("[ %s | %s | layer %zu ] kernel %s, o rel err %.2e, lse max abs diff %.2e\n",
                    shape.name.c_str(), scenario.what.c_str(), layer, on_gpu.kernel.c_str(), error.relative, lse);
      }
    }
    EXPECT_EQ(observer.Count("pod/mixed"), g.num_layers);
    EXPECT_EQ(observer.non_positive(), 0);
  }
  ::unsetenv("ATTND_POD");
}

}  // namespace
}  // namespace attnd
