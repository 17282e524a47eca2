// POD attention on the GPU (DESIGN 4.5) against the float64 CPU reference: mixed batches of 1..8
// prefill requests (1..8192 tokens) with 1..256 decode requests, page sizes 1 and 16, GQA groups
// 1/4/8, dtypes and head dims, causal/window/soft cap/lse, padding entries, and bitwise
// repeatability and equality with the separate mma.sync prefill launches under deterministic.
// GPU tests skip without a device; planner tests run everywhere.
//
// Smoke run (a few seconds): pod_tests --gtest_filter='PodSmoke*'
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "attnd/kernels/cuda/pod.h"
#include "attnd/kernels/cuda/prefill.h"
#include "gtest/gtest.h"
#include "plan/pod_plan.h"
#include "plan/prefill_plan.h"
#include "prefill_test_util.h"
#include "reference/attention.h"

namespace attnd {
namespace {

using namespace prefill_test;  // NOLINT: the helpers shared with prefill_test.cc

struct Output {
  bool ok = false;         // the launch succeeded and the device synchronised cleanly
  bool fused = false;      // the plan fused a prefill and a decode role
  bool split_kv = false;   // the plan split some request's keys
  std::vector<uint8_t> o;  // q dtype
  std::vector<float> lse;
};

enum class Runner { kPod, kSeparateMmaSync };

// Runs POD (or, for comparison, the same requests as ordinary mma.sync prefill launches) on a
// poisoned output.
Output RunGpu(const Batch& batch, Runner runner = Runner::kPod) {
  const Config& config = batch.config;
  Output out;
  auto waves = cuda::BatchPrefillCtasPerWave(config.head_dim, config.q_dtype, config.kv_dtype);
  EXPECT_TRUE(waves.ok()) << waves.status();
  if (!waves.ok()) return out;
  auto pod_waves = cuda::PodCtasPerWave(config.head_dim, config.q_dtype, config.kv_dtype);
  EXPECT_TRUE(pod_waves.ok()) << pod_waves.status();
  if (!pod_waves.ok()) return out;
  plan::PrefillPlanInput input;
  input.qo_indptr = batch.qo_indptr;
  input.kv_lengths = batch.kv_lens;
  input.num_qo_heads = config.num_qo_heads;
  input.num_kv_heads = config.num_kv_heads;
  input.head_dim = config.head_dim;
  input.causal = config.params.causal;
  input.ctas_per_wave = *waves;
  input.deterministic = config.deterministic;
  input.disable_split_kv = !config.split_kv;
  input.fixed_split_tokens = config.fixed_split_tokens;
  plan::PodPlan plan;
  if (runner == Runner::kPod) {
    auto plan_or = plan::PlanPod(input, *pod_waves);
    EXPECT_TRUE(plan_or.ok()) << plan_or.status();
    if (!plan_or.ok()) return out;
    plan = *std::move(plan_or);
  } else {
    input.kernel = plan::PrefillKernel::kMmaSync;
    auto plan_or = plan::PlanPrefill(input);
    EXPECT_TRUE(plan_or.ok()) << plan_or.status();
    if (!plan_or.ok()) return out;
    plan.prefill = *std::move(plan_or);
  }
  out.fused = plan.fused();
  out.split_kv = plan.prefill.split_kv();

  DeviceBuffer q = Upload(batch.q), k_pool = Upload(batch.k_pool), v_pool = Upload(batch.v_pool);
  DeviceBuffer qo_indptr = Upload(batch.qo_indptr), page_indptr = Upload(batch.page_indptr);
  DeviceBuffer k_ids = Upload(batch.k_page_ids), v_ids = Upload(batch.v_page_ids);
  DeviceBuffer last = Upload(batch.last_page_len);
  const int64_t o_elements = batch.num_rows * config.num_qo_heads * config.head_dim;
  const size_t o_bytes = o_elements * DTypeBytes(config.q_dtype);
  DeviceBuffer o(std::max<size_t>(o_bytes, 16));
  DeviceBuffer lse(std::max<size_t>(batch.num_rows * config.num_qo_heads * sizeof(float), 16));
  cudaMemset(o.get(), 0xff, o.bytes());  // NaN in fp16 and bf16: every row must be written
  cudaMemset(lse.get(), 0xff, lse.bytes());
  const int64_t workspace_bytes = cuda::PodWorkspaceBytes(plan);
  DeviceBuffer workspace(std::max<int64_t>(workspace_bytes, 16));
  // Stale counters from an earlier launch must not matter: the launcher zeroes them.
  cudaMemset(workspace.get(), 0x5a, workspace.bytes());

  cuda::BatchPrefillArgs args;
  args.q = {q.get(), config.q_dtype, batch.num_rows, config.num_qo_heads, config.head_dim};
  args.qo_indptr = static_cast<const int32_t*>(qo_indptr.get());
  args.pages.batch_size = static_cast<int32_t>(batch.q_lens.size());
  args.pages.page_size = config.page_size;
  args.pages.indptr = static_cast<const int32_t*>(page_indptr.get());
  args.pages.k_indices = static_cast<const int32_t*>(k_ids.get());
  args.pages.v_indices =
      static_cast<const int32_t*>(config.table == TableForm::kShared ? k_ids.get() : v_ids.get());
  args.pages.last_page_len = static_cast<const int32_t*>(last.get());
  args.k_cache = batch.Pool(k_pool.get());
  args.v_cache = batch.Pool(v_pool.get());
  args.params = batch.Params();
  args.o = {o.get(), config.q_dtype, batch.num_rows, config.num_qo_heads, config.head_dim};
  args.lse = config.return_lse ? static_cast<float*>(lse.get()) : nullptr;

  absl::Status status = cuda::UploadPodPlan(plan, workspace.get(), workspace_bytes, nullptr);
  EXPECT_TRUE(status.ok()) << status;
  // Twice on one stream: the second launch must find its counters zeroed again.
  for (int run = 0; run < 2 && status.ok(); ++run) {
    status = cuda::PodAttention(plan, args, workspace.get(), workspace_bytes, nullptr);
    EXPECT_TRUE(status.ok()) << status;
    if (run == 0) {
      cudaMemsetAsync(o.get(), 0xff, o.bytes(), nullptr);
      cudaMemsetAsync(lse.get(), 0xff, lse.bytes(), nullptr);
    }
  }
  const cudaError_t sync = cudaDeviceSynchronize();
  EXPECT_EQ(sync, cudaSuccess) << cudaGetErrorString(sync);
  out.o.resize(o_bytes);
  out.lse.resize(batch.num_rows * config.num_qo_heads);
  cudaMemcpy(out.o.data(), o.get(), o_bytes, cudaMemcpyDeviceToHost);
  cudaMemcpy(out.lse.data(), lse.get(), out.lse.size() * sizeof(float), cudaMemcpyDeviceToHost);
  out.ok = status.ok() && sync == cudaSuccess;
  return out;
}

// Returns whether the plan split KV.
bool CheckAgainstReference(const Config& config, const std::vector<int32_t>& q_lens,
                           const std::vector<int32_t>& kv_lens, bool expect_fused = true) {
  SCOPED_TRACE(config.Name());
  const Batch batch = MakeBatch(config, q_lens, kv_lens);
  const Output got = RunGpu(batch);
  if (!got.ok) return false;  // RunGpu has reported why
  if (expect_fused) {
    EXPECT_TRUE(got.fused) << config.Name() << ": the plan did not fuse";
  }
  ExpectMatches(batch, got, RunReference(batch));
  return got.split_kv;
}


// A mixed batch: a decode row, short and long prefills, chunked prefill (kv > q), page
// q lengths: `prefills` then `decodes` ones, kv lengths likewise; decode kv lengths cycle
// through `decode_kv` offsets so page boundaries fall everywhere.
struct MixedBatch {
  std::vector<int32_t> q, kv;
};

MixedBatch Mixed(const std::vector<std::pair<int32_t, int32_t>>& prefills, int32_t num_decodes,
                 int32_t decode_kv_min, int32_t decode_kv_max, uint32_t seed, int32_t padding_every = 0) {
  MixedBatch batch;
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int32_t> kv(decode_kv_min, decode_kv_max);
  // Interleaved: prefills among the decodes, so neither role is a contiguous range of requests.
  const int32_t total = static_cast<int32_t>(prefills.size()) + num_decodes;
  size_t next_prefill = 0;
  for (int32_t i = 0; i < total; ++i) {
    const bool prefill_here = next_prefill < prefills.size() &&
                              (i % std::max<int32_t>(1, total / static_cast<int32_t>(prefills.size())) == 0 ||
                               total - i <= static_cast<int32_t>(prefills.size() - next_prefill));
    if (prefill_here) {
      batch.q.push_back(prefills[next_prefill].first);
      batch.kv.push_back(prefills[next_prefill].second);
      ++next_prefill;
    } else {
      batch.q.push_back(1);
      batch.kv.push_back(kv(rng));
    }
    if (padding_every > 0 && i % padding_every == padding_every - 1) {
      batch.q.push_back(0);  // a padding slot: pages, no rows
      batch.kv.push_back(kv(rng));
    }
  }
  return batch;
}

Config Grouped(int32_t group, uint32_t seed) {
  Config config;
  config.num_kv_heads = group == 1 ? 4 : 2;
  config.num_qo_heads = config.num_kv_heads * group;
  config.seed = seed;
  return config;
}

// --- Smoke: one mixed batch per dtype pair at head_dim 128, and the options once -------------------

TEST(PodSmokeTest, MatchesReferenceAcrossDtypes) {
  ATTND_SKIP_WITHOUT_GPU();
  const std::pair<DType, DType> dtypes[] = {
      {DType::kFloat16, DType::kFloat16},    {DType::kBFloat16, DType::kBFloat16},
      {DType::kFloat16, DType::kFloat8E4M3}, {DType::kBFloat16, DType::kFloat8E4M3},
      {DType::kFloat16, DType::kBFloat16},   {DType::kBFloat16, DType::kFloat16}};
  uint32_t seed = 10;
  for (const auto& [q_dtype, kv_dtype] : dtypes) {
    Config config = Grouped(4, seed++);
    config.q_dtype = q_dtype;
    config.kv_dtype = kv_dtype;
    if (kv_dtype == DType::kFloat8E4M3) {
      config.params.k_scale = 1.0f / 64;
      config.params.v_scale = 1.0f / 32;
    }
    const MixedBatch batch = Mixed({{300, 300}, {77, 500}}, 24, 1, 700, seed, 7);
    CheckAgainstReference(config, batch.q, batch.kv);
  }
}

// A long decode (split by itself) among short ones, a prefill long enough to split alone.
Batch DeterministicBatch() {
  Config config = Grouped(4, 5);
  config.deterministic = true;
  MixedBatch mixed = Mixed({{200, 6000}, {64, 64}}, 40, 1, 900, 5);
  mixed.kv[1] = 20000;  // index 1 is a decode (prefills sit at 0 and 21)
  return MakeBatch(config, mixed.q, mixed.kv);
}

TEST(PodSmokeTest, DeterministicIsBitwiseRepeatable) {
  ATTND_SKIP_WITHOUT_GPU();
  const Batch batch = DeterministicBatch();
  ASSERT_EQ(batch.q_lens[1], 1);
  const Output first = RunGpu(batch);
  ASSERT_TRUE(first.ok);
  EXPECT_TRUE(first.fused);
  EXPECT_TRUE(first.split_kv);
  ExpectMatches(batch, first, RunReference(batch));
  // Roles land on other SMs in another order every run; the bits must not move.
  for (int run = 0; run < 3; ++run) {
    const Output again = RunGpu(batch);
    ASSERT_TRUE(again.ok);
    EXPECT_TRUE(first.o == again.o) << "o bits differ between runs";
    EXPECT_EQ(std::memcmp(first.lse.data(), again.lse.data(), first.lse.size() * sizeof(float)), 0);
  }
}

// Under deterministic the POD plan is the mma.sync prefill plan, and each block runs the same
// tile code over the same item, so the bits should be those of the separate mma.sync launches
// (which prefill_tests prove batch-invariant). Kept apart from the smoke run: a failure here with
// the reference and repeatability tests passing would mean the compiler contracted the fused
// kernel's arithmetic differently, not a wrong result.
TEST(PodTest, DeterministicBitsEqualTheSeparateMmaSyncLaunches) {
  ATTND_SKIP_WITHOUT_GPU();
  const Batch batch = DeterministicBatch();
  const Output fused = RunGpu(batch);
  const Output separate = RunGpu(batch, Runner::kSeparateMmaSync);
  ASSERT_TRUE(fused.ok && separate.ok);
  EXPECT_TRUE(fused.o == separate.o) << "o bits differ from the separate mma.sync launches";
  EXPECT_EQ(std::memcmp(fused.lse.data(), separate.lse.data(), fused.lse.size() * sizeof(float)), 0);
}

// --- Full sweep ----------------------------------------------------------------------------------

TEST(PodTest, MatchesReferenceAcrossHeadDims) {
  ATTND_SKIP_WITHOUT_GPU();
  uint32_t seed = 20;
  for (int32_t head_dim : {64, 256}) {
    for (DType kv_dtype : {DType::kBFloat16, DType::kFloat8E4M3}) {
      Config config = Grouped(4, seed++);
      config.head_dim = head_dim;
      config.kv_dtype = kv_dtype;
      if (kv_dtype == DType::kFloat8E4M3) {
        config.params.k_scale = 1.0f / 64;
        config.params.v_scale = 1.0f / 32;
      }
      const MixedBatch batch = Mixed({{260, 300}, {40, 700}}, 20, 1, 600, seed);
      CheckAgainstReference(config, batch.q, batch.kv);
    }
  }
}

TEST(PodTest, MatchesReferenceAcrossGroupsPageSizesAndBatchShapes) {
  ATTND_SKIP_WITHOUT_GPU();
  struct Shape {
    std::vector<std::pair<int32_t, int32_t>> prefills;
    int32_t decodes;
    int32_t decode_kv_max;
  };
  const Shape shapes[] = {
      {{{2048, 2048}}, 1, 2048},                                  // one decode beside a long prefill
      {{{700, 700}, {1, 1}, {2, 900}}, 3, 300},                  // 1- and 2-token "prefills"
      {{{512, 1024}, {300, 300}, {129, 129}, {16, 33}, {1000, 1000}, {5, 5}, {64, 4000}, {250, 251}}, 17, 1500},
      {{{128, 128}}, 256, 400},                                   // 256 decodes
  };
  uint32_t seed = 40;
  for (int32_t page_size : {1, 16}) {
    for (int32_t group : {1, 4, 8}) {
      for (const Shape& shape : shapes) {
        Config config = Grouped(group, seed++);
        config.page_size = page_size;
        config.table = seed % 2 == 0 ? TableForm::kShared : TableForm::kSeparateKv;
        config.layout = seed % 3 == 0 ? KvLayout::kHND : KvLayout::kNHD;
        const MixedBatch batch = Mixed(shape.prefills, shape.decodes, 1, shape.decode_kv_max, seed, 5);
        CheckAgainstReference(config, batch.q, batch.kv);
      }
    }
  }
}

TEST(PodTest, MatchesReferenceOnLongPrefills) {
  ATTND_SKIP_WITHOUT_GPU();
  Config config = Grouped(4, 60);
  config.num_qo_heads = 4;
  config.num_kv_heads = 1;
  MixedBatch batch = Mixed({{8192, 8192}}, 32, 1000, 9000, 60);
  CheckAgainstReference(config, batch.q, batch.kv);
  // Chunked prefill against a long history, non-causal.
  config.seed = 61;
  config.params.causal = false;
  config.page_size = 1;
  batch = Mixed({{1500, 6000}, {3000, 3000}}, 64, 1, 2000, 61);
  CheckAgainstReference(config, batch.q, batch.kv);
}

TEST(PodTest, MatchesReferenceWithSoftCapWindowNonCausalAndWithoutLse) {
  ATTND_SKIP_WITHOUT_GPU();
  uint32_t seed = 70;
  for (bool causal : {true, false}) {
    for (int32_t window : {-1, 0, 5, 200}) {
      for (float cap : {0.0f, 30.0f}) {
        Config config = Grouped(8, seed++);
        config.params.causal = causal;
        config.params.window_left = window;
        config.params.logits_soft_cap = cap;
        config.params.sm_scale = cap > 0 ? 1.0f : 0.0f;  // large logits make the cap bite
        config.return_lse = seed % 2 == 0;
        const MixedBatch batch = Mixed({{300, 400}, {90, 90}}, 12, 1, 800, seed, 4);
        CheckAgainstReference(config, batch.q, batch.kv);
      }
    }
  }
}

TEST(PodTest, FullyMaskedRowsAndEmptyDecodesGetZeroAndNegativeInfinity) {
  ATTND_SKIP_WITHOUT_GPU();
  Config config = Grouped(4, 80);
  // q longer than kv (the first rows see nothing), a decode with no keys, a prefill with none.
  CheckAgainstReference(config, {50, 1, 1, 20, 1}, {10, 0, 30, 0, 7});
}

TEST(PodTest, SplitAndFixedSplitMatchReference) {
  ATTND_SKIP_WITHOUT_GPU();
  Config config = Grouped(4, 90);
  // Few CTAs: both roles split their keys.
  EXPECT_TRUE(CheckAgainstReference(config, {100, 1, 1}, {9000, 12000, 3000}));
  config.fixed_split_tokens = 300;
  config.seed = 91;
  EXPECT_TRUE(CheckAgainstReference(config, {200, 1, 1, 1}, {2000, 1000, 5000, 17}));
  config.fixed_split_tokens = 0;
  config.split_kv = false;
  config.seed = 92;
  EXPECT_FALSE(CheckAgainstReference(config, {100, 1, 1}, {9000, 12000, 3000}));
}

// Non-finite inputs (NaN in, NaN out) in a fused batch, both roles: the rows the CPU reference
// marks NaN are NaN in o and lse, every other row equals the run without the poison exactly.
// Includes a NaN v of a key that earlier rows of its tile do not see (causal), and split KV.
TEST(PodTest, NonFiniteInputsGiveNaNRowsTheyTouchAndNoOthers) {
  ATTND_SKIP_WITHOUT_GPU();
  uint32_t seed = 1600;
  const std::pair<DType, DType> dtypes[] = {{DType::kBFloat16, DType::kBFloat16}, {DType::kFloat16, DType::kFloat8E4M3}};
  for (const auto& [q_dtype, kv_dtype] : dtypes) {
    for (int32_t fixed_split : {0, 64}) {
      Config config = Grouped(4, seed++);
      config.q_dtype = q_dtype;
      config.kv_dtype = kv_dtype;
      config.params.causal = true;
      config.fixed_split_tokens = fixed_split;
      SCOPED_TRACE(config.Name());
      // Requests 0-2 carry StandardPoisons; 3 is a clean decode row.
      const Batch clean = MakeBatch(config, {100, 40, 1, 1}, {100, 300, 129, 77});
      Batch poisoned = clean;
      const int64_t marked = ApplyPoisons(poisoned, StandardPoisons(config.head_dim));
      const Output clean_out = RunGpu(clean);
      const Output out = RunGpu(poisoned);
      ASSERT_TRUE(clean_out.ok && out.ok);
      EXPECT_TRUE(out.fused) << "the plan did not fuse";
      if (fixed_split > 0) {
        EXPECT_TRUE(out.split_kv) << "expected a split";
      }
      const Expected expected = RunReference(poisoned);
      kernel_test::ExpectNonFiniteRows(config.q_dtype, poisoned.num_rows * config.num_qo_heads, config.head_dim,
                                       expected.lse, out.o, out.lse, clean_out.o, clean_out.lse, marked);
    }
  }
}

TEST(PodTest, UnfusedPlansRunAsSeparateLaunches) {
  ATTND_SKIP_WITHOUT_GPU();
  Config config = Grouped(4, 95);
  CheckAgainstReference(config, {1, 1, 0, 1}, {100, 2000, 5, 7}, /*expect_fused=*/false);  // decode only
  CheckAgainstReference(config, {300, 40}, {300, 900}, /*expect_fused=*/false);             // prefill only
}

TEST(PodTest, SanitizerSweep) {
  // Small shapes for compute-sanitizer: pod_tests --gtest_filter='PodTest.SanitizerSweep'.
  ATTND_SKIP_WITHOUT_GPU();
  Config config = Grouped(4, 99);
  config.kv_dtype = DType::kFloat8E4M3;
  CheckAgainstReference(config, {70, 1, 0, 1, 3}, {70, 33, 4, 1, 3});
  config.kv_dtype = DType::kBFloat16;
  config.page_size = 1;
  config.params.causal = false;
  CheckAgainstReference(config, {1, 90, 1}, {5, 100, 300});
}

}  // namespace
}  // namespace attnd
