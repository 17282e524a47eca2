// Batch prefill on the GPU against the float64 CPU reference (DESIGN 4.3-4.4, 7): dtypes, head
// dims, page sizes, layouts, page-table forms, options, long and mixed batches, fully masked
// rows, and bitwise batch invariance. GPU tests skip without a device; planner and argument
// tests run everywhere.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "attnd/kernels/cuda/prefill.h"
#include "gtest/gtest.h"
#include "plan/prefill_plan.h"
#include "prefill_test_util.h"
#include "reference/attention.h"
#include "step_batch_test_util.h"  // Input (tests/unit/plan)

namespace attnd {
namespace {

using namespace prefill_test;  // NOLINT: the shared helpers of this file and pod_test.cc

// The sm_90a kernel exists in this build and runs on this device (compute capability 9.0).
bool HaveHopperKernel() {
  if (!HaveGpu()) return false;
  auto waves = cuda::BatchPrefillCtasPerWave(128, DType::kBFloat16, DType::kBFloat16);
  return waves.ok() && waves->hopper_tile128 > 0;
}

#define SKIP_WITHOUT_HOPPER() \
  if (!HaveHopperKernel()) GTEST_SKIP() << "no sm_90 device or no sm_90a code in this build"

struct Output {
  bool ok = false;         // the launch succeeded and the device synchronised cleanly
  bool split_kv = false;   // the plan split some request's keys
  bool hopper = false;     // some launch ran the Hopper kernel
  bool short_works = false;  // some Hopper launch pipelined across works (PrefillLaunch::short_works)
  std::vector<uint8_t> o;  // q dtype
  std::vector<float> lse;
};

// Runs the GPU kernel on a poisoned output.
Output RunGpu(const Batch& batch) {
  const Config& config = batch.config;
  Output out;
  auto waves = cuda::BatchPrefillCtasPerWave(config.head_dim, config.q_dtype, config.kv_dtype);
  EXPECT_TRUE(waves.ok()) << waves.status();
  if (!waves.ok()) return out;
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
  input.kernel = config.kernel;
  auto plan_or = plan::PlanPrefill(input);
  EXPECT_TRUE(plan_or.ok()) << plan_or.status();
  if (!plan_or.ok()) return out;
  const plan::PrefillPlan& plan = *plan_or;
  out.split_kv = plan.split_kv();
  for (const plan::PrefillLaunch& launch : plan.launches) {
    out.hopper |= launch.kernel == plan::PrefillKernel::kHopper;
    out.short_works |= launch.kernel == plan::PrefillKernel::kHopper && launch.short_works;
  }
  if (config.kernel != plan::PrefillKernel::kAuto) {
    for (const plan::PrefillLaunch& launch : plan.launches) EXPECT_EQ(launch.kernel, config.kernel) << config.Name();
  }

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
  const int64_t workspace_bytes = cuda::BatchPrefillWorkspaceBytes(plan);
  DeviceBuffer workspace(std::max<int64_t>(workspace_bytes, 16));

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
  args.max_persistent_ctas = config.max_persistent_ctas;
  args.works_on_demand = config.works_on_demand;
  args.pipeline_short_works = config.pipeline_short_works;
  args.tail_ctas = config.tail_ctas;

  absl::Status status = cuda::UploadBatchPrefillPlan(plan, workspace.get(), workspace_bytes, nullptr);
  EXPECT_TRUE(status.ok()) << status;
  for (int32_t launch = 0; launch < config.launches && status.ok(); ++launch) {
    if (launch > 0) {
      cudaMemsetAsync(o.get(), 0xff, o.bytes(), nullptr);
      cudaMemsetAsync(lse.get(), 0xff, lse.bytes(), nullptr);
    }
    if (config.tail_ctas == 0) {
      status = cuda::BatchPrefill(plan, args, workspace.get(), workspace_bytes, nullptr);
      EXPECT_TRUE(status.ok()) << status;
    } else {
      // As beside a decode: the first grid on a stream of its own, the tail grid on the legacy
      // stream, the merge there after both.
      cudaStream_t side = nullptr;
      cudaEvent_t forked = nullptr, joined = nullptr;
      cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking);
      cudaEventCreateWithFlags(&forked, cudaEventDisableTiming);
      cudaEventCreateWithFlags(&joined, cudaEventDisableTiming);
      cudaEventRecord(forked, nullptr);
      cudaStreamWaitEvent(side, forked, 0);
      status = cuda::BatchPrefill(plan, args, workspace.get(), workspace_bytes, side);
      EXPECT_TRUE(status.ok()) << status;
      cudaEventRecord(joined, side);
      if (status.ok()) status = cuda::BatchPrefillTail(plan, args, workspace.get(), workspace_bytes, nullptr);
      EXPECT_TRUE(status.ok()) << status;
      cudaStreamWaitEvent(nullptr, joined, 0);
      if (status.ok()) status = cuda::MergeBatchPrefill(plan, args, workspace.get(), workspace_bytes, nullptr);
      EXPECT_TRUE(status.ok()) << status;
      cudaEventDestroy(forked);
      cudaEventDestroy(joined);
      cudaStreamDestroy(side);
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
                           const std::vector<int32_t>& kv_lens) {
  SCOPED_TRACE(config.Name());
  const Batch batch = MakeBatch(config, q_lens, kv_lens);
  const Output got = RunGpu(batch);
  if (!got.ok) return false;  // RunGpu has reported why
  ExpectMatches(batch, got, RunReference(batch));
  return got.split_kv;
}

Config WithCausal(Config config, bool causal) {
  config.params.causal = causal;
  return config;
}

// A mixed batch: a decode row, short and long prefills, chunked prefill (kv > q), page
// boundaries on both sides, a request whose rows see no key (q > kv, causal), a padding slot.
const std::vector<int32_t> kMixedQ = {1, 7, 33, 100, 16, 0, 300, 5, 40};
const std::vector<int32_t> kMixedKv = {1, 7, 129, 611, 16, 12, 300, 2, 40};

// --- GPU tests --------------------------------------------------------------------------------

TEST(BatchPrefillTest, MatchesReferenceAcrossDtypesAndHeadDims) {
  ATTND_SKIP_WITHOUT_GPU();
  const std::pair<DType, DType> dtypes[] = {
      {DType::kFloat16, DType::kFloat16},     {DType::kBFloat16, DType::kBFloat16},
      {DType::kFloat16, DType::kFloat8E4M3},  {DType::kBFloat16, DType::kFloat8E4M3},
      {DType::kFloat16, DType::kBFloat16},    {DType::kBFloat16, DType::kFloat16}};
  uint32_t seed = 10;
  for (const auto& [q_dtype, kv_dtype] : dtypes) {
    for (int32_t head_dim : {64, 128, 256}) {
      Config config;
      config.q_dtype = q_dtype;
      config.kv_dtype = kv_dtype;
      config.head_dim = head_dim;
      config.seed = seed++;
      if (kv_dtype == DType::kFloat8E4M3) {
        config.params.k_scale = 1.0f / 64;
        config.params.v_scale = 1.0f / 32;
      }
      CheckAgainstReference(WithCausal(config, seed % 2 == 0), kMixedQ, kMixedKv);
    }
  }
}

TEST(BatchPrefillTest, MatchesReferenceAcrossPageSizesLayoutsAndTables) {
  ATTND_SKIP_WITHOUT_GPU();
  uint32_t seed = 40;
  for (int32_t page_size : {1, 16, 128}) {
    for (KvLayout layout : {KvLayout::kNHD, KvLayout::kHND}) {
      for (TableForm table : {TableForm::kShared, TableForm::kSeparateKv}) {
        Config config;
        config.page_size = page_size;
        config.layout = layout;
        config.table = table;
        config.seed = seed++;
        // Group sizes 1, 4 and 8 in turn.
        config.num_qo_heads = (seed % 3 == 0) ? 4 : (seed % 3 == 1 ? 8 : 16);
        config.num_kv_heads = (seed % 3 == 0) ? 4 : 2;
        CheckAgainstReference(WithCausal(config, true), {3, 129, 17, 256}, {130, 129, 300, 1000});
      }
    }
  }
}

TEST(BatchPrefillTest, MatchesReferenceWithSoftCapWindowAndNonCausal) {
  ATTND_SKIP_WITHOUT_GPU();
  for (bool causal : {true, false}) {
    for (int32_t window : {-1, 0, 5, 64, 200}) {
      for (float cap : {0.0f, 30.0f}) {
        Config config;
        config.params.causal = causal;
        config.params.window_left = window;
        config.params.logits_soft_cap = cap;
        config.params.sm_scale = cap > 0 ? 1.0f : 0.0f;  // large logits make the cap bite
        config.seed = 100 + window + (causal ? 7 : 0);
        CheckAgainstReference(config, kMixedQ, kMixedKv);
      }
    }
  }
}

TEST(BatchPrefillTest, FullyMaskedRowsGetZeroAndNegativeInfinity) {
  ATTND_SKIP_WITHOUT_GPU();
  Config config;
  // q longer than kv: with the causal bottom-right alignment the first q - kv rows see nothing;
  // the second request has no keys at all.
  CheckAgainstReference(config, {50, 20, 8}, {10, 0, 8});
  config.params.causal = false;
  CheckAgainstReference(config, {20, 3}, {0, 40});
}

TEST(BatchPrefillTest, MatchesReferenceOnLongSequences) {
  ATTND_SKIP_WITHOUT_GPU();
  Config config;
  config.num_qo_heads = 4;
  config.num_kv_heads = 1;
  CheckAgainstReference(config, {8192}, {8192});
  config.seed = 2;
  config.params.causal = false;
  CheckAgainstReference(config, {2048, 1}, {2048, 4097});
  // Chunked prefill against a long history; page boundaries at 32768.
  config.seed = 3;
  config.params.causal = true;
  config.page_size = 128;
  CheckAgainstReference(config, {300, 16}, {32768, 32767});
}

TEST(BatchPrefillTest, MatchesReferenceOnMixedBatchOf128Requests) {
  ATTND_SKIP_WITHOUT_GPU();
  std::mt19937 rng(7);
  std::vector<int32_t> q_lens, kv_lens;
  for (int i = 0; i < 128; ++i) {
    const int32_t q = i % 16 == 0 ? 0 : (i % 3 == 0 ? 1 : std::uniform_int_distribution<int32_t>(1, 200)(rng));
    q_lens.push_back(q);
    kv_lens.push_back(q + std::uniform_int_distribution<int32_t>(0, 700)(rng));
  }
  Config config;
  config.num_qo_heads = 16;
  config.num_kv_heads = 4;
  CheckAgainstReference(config, q_lens, kv_lens);
}

// A request's bits do not depend on its neighbours: alone, among many decode rows (mean query
// length ~1), among long prefills, and at another batch position.
void CheckBitwiseIndependentOfTheBatch(plan::PrefillKernel kernel) {
  Config config;
  config.num_qo_heads = 8;
  config.num_kv_heads = 2;
  config.deterministic = true;
  config.kernel = kernel;
  SCOPED_TRACE(config.Name());
  // Alone, the probe underfills the device, so its keys are split (per request, so the same
  // split in every batch below).
  const int32_t probe_q = 150, probe_kv = 7000;
  struct Composition {
    std::vector<int32_t> q, kv;
    int probe;
  };
  std::vector<Composition> compositions;
  compositions.push_back({{probe_q}, {probe_kv}, 0});
  Composition decode_heavy;
  for (int i = 0; i < 60; ++i) {
    decode_heavy.q.push_back(1);
    decode_heavy.kv.push_back(100 + i);
  }
  decode_heavy.q.insert(decode_heavy.q.begin() + 31, probe_q);
  decode_heavy.kv.insert(decode_heavy.kv.begin() + 31, probe_kv);
  decode_heavy.probe = 31;
  compositions.push_back(decode_heavy);
  compositions.push_back({{2000, 1500, probe_q, 3000}, {2000, 4000, probe_kv, 3000}, 2});
  compositions.push_back({{3, probe_q}, {50000, probe_kv}, 1});

  std::vector<uint8_t> first_o;
  std::vector<float> first_lse;
  for (size_t c = 0; c < compositions.size(); ++c) {
    const Composition& composition = compositions[c];
    // The probe's inputs are the same in every batch: same seed, and it is generated alone
    // first, then its q rows and pages are copied into the batch.
    Config probe_config = config;
    probe_config.seed = 99;
    const Batch probe = MakeBatch(probe_config, {probe_q}, {probe_kv});
    Config batch_config = config;
    batch_config.seed = 1000 + static_cast<uint32_t>(c);
    Batch batch = MakeBatch(batch_config, composition.q, composition.kv);
    const int row_bytes = config.num_qo_heads * config.head_dim * DTypeBytes(config.q_dtype);
    std::memcpy(batch.q.data() + int64_t{batch.qo_indptr[composition.probe]} * row_bytes, probe.q.data(),
                int64_t{probe_q} * row_bytes);
    const PagedKvView shape = batch.Pool(nullptr);
    const int64_t page_bytes = shape.PageElements() * DTypeBytes(config.kv_dtype);
    for (int32_t p = 0; p < probe.page_indptr[1]; ++p) {
      const int32_t slot = batch.page_indptr[composition.probe] + p;
      std::memcpy(batch.k_pool.data() + batch.k_page_ids[slot] * page_bytes,
                  probe.k_pool.data() + probe.k_page_ids[p] * page_bytes, page_bytes);
      std::memcpy(batch.v_pool.data() + batch.v_page_ids[slot] * page_bytes,
                  probe.v_pool.data() + probe.v_page_ids[p] * page_bytes, page_bytes);
    }
    const Output out = RunGpu(batch);
    ASSERT_TRUE(out.ok);
    const int64_t first_row = batch.qo_indptr[composition.probe];
    std::vector<uint8_t> o(out.o.begin() + first_row * row_bytes, out.o.begin() + (first_row + probe_q) * row_bytes);
    std::vector<float> lse(out.lse.begin() + first_row * config.num_qo_heads,
                           out.lse.begin() + (first_row + probe_q) * config.num_qo_heads);
    if (c == 0) {
      first_o = o;
      first_lse = lse;
      EXPECT_TRUE(out.split_kv) << "the lone probe should split";
      ExpectMatches(probe, out, RunReference(probe));
    } else {
      EXPECT_TRUE(o == first_o) << "composition " << c << ": o bits differ";
      EXPECT_EQ(std::memcmp(lse.data(), first_lse.data(), lse.size() * sizeof(float)), 0)
          << "composition " << c << ": lse bits differ";
    }
  }
}

// kAuto runs the probe (600 packed rows, tile 128) on the Hopper kernel on sm_90 devices.
TEST(BatchPrefillTest, OutputIsBitwiseIndependentOfTheBatch) {
  ATTND_SKIP_WITHOUT_GPU();
  CheckBitwiseIndependentOfTheBatch(plan::PrefillKernel::kAuto);
  CheckBitwiseIndependentOfTheBatch(plan::PrefillKernel::kMmaSync);
}

// --- The Hopper kernel, forced for every request (short ones too, in 128-row tiles) ----------

TEST(BatchPrefillHopperTest, AutoPicksHopperForLongRequestsOnSm90) {
  SKIP_WITHOUT_HOPPER();
  Config config;
  const Batch batch = MakeBatch(config, {300, 3}, {300, 50});
  const Output out = RunGpu(batch);
  ASSERT_TRUE(out.ok);
  EXPECT_TRUE(out.hopper);
  ExpectMatches(batch, out, RunReference(batch));
  config.head_dim = 256;  // the Hopper kernel at every head_dim
  const Batch wide = MakeBatch(config, {300, 3}, {300, 50});
  const Output wide_out = RunGpu(wide);
  ASSERT_TRUE(wide_out.ok);
  EXPECT_TRUE(wide_out.hopper);
  ExpectMatches(wide, wide_out, RunReference(wide));
}

TEST(BatchPrefillHopperTest, MatchesReferenceAcrossDtypesHeadDimsPagesAndLayouts) {
  SKIP_WITHOUT_HOPPER();
  uint32_t seed = 700;
  for (DType dtype : {DType::kBFloat16, DType::kFloat16}) {
    // 256: 64-key tiles, one Q buffer, 4 rows a producer lane (HopperShape).
    for (int32_t head_dim : {64, 128, 256}) {
      // Pages of 8 keys and more: the producer looks up one page per lane and tile; 1 and 4: a
      // page per row.
      for (int32_t page_size : {1, 4, 8, 16, 128}) {
        for (KvLayout layout : {KvLayout::kNHD, KvLayout::kHND}) {
          Config config;
          config.kernel = plan::PrefillKernel::kHopper;
          config.q_dtype = config.kv_dtype = dtype;
          config.head_dim = head_dim;
          config.page_size = page_size;
          config.layout = layout;
          config.table = seed % 2 ? TableForm::kSeparateKv : TableForm::kShared;
          config.seed = seed++;
          // Group sizes 1, 4 and 6 in turn (6: packed tiles straddle tokens unevenly).
          config.num_qo_heads = seed % 3 == 0 ? 4 : (seed % 3 == 1 ? 8 : 12);
          config.num_kv_heads = seed % 3 == 0 ? 4 : 2;
          config.params.causal = seed % 2 == 0;
          // Mostly unsplit, so CTAs walk up to 5 KV tiles and reuse every pipeline stage.
          config.split_kv = seed % 4 == 0;
          CheckAgainstReference(config, kMixedQ, kMixedKv);
        }
      }
    }
  }
}

TEST(BatchPrefillHopperTest, MatchesReferenceWithSoftCapWindowAndNonCausal) {
  SKIP_WITHOUT_HOPPER();
  for (bool causal : {true, false}) {
    for (int32_t window : {-1, 0, 5, 200}) {
      for (float cap : {0.0f, 30.0f}) {
        Config config;
        config.kernel = plan::PrefillKernel::kHopper;
        config.params.causal = causal;
        config.params.window_left = window;
        config.params.logits_soft_cap = cap;
        config.params.sm_scale = cap > 0 ? 1.0f : 0.0f;
        config.split_kv = false;
        config.seed = 800 + window + (causal ? 7 : 0);
        CheckAgainstReference(config, kMixedQ, kMixedKv);
      }
    }
  }
}

TEST(BatchPrefillHopperTest, FullyMaskedRowsGetZeroAndNegativeInfinity) {
  SKIP_WITHOUT_HOPPER();
  Config config;
  config.kernel = plan::PrefillKernel::kHopper;
  CheckAgainstReference(config, {50, 20, 8, 200}, {10, 0, 8, 130});
  config.params.causal = false;
  CheckAgainstReference(config, {20, 3}, {0, 40});
}

TEST(BatchPrefillHopperTest, MatchesReferenceOnLongAndMixedBatches) {
  SKIP_WITHOUT_HOPPER();
  Config config;
  config.kernel = plan::PrefillKernel::kHopper;
  config.num_qo_heads = 4;
  config.num_kv_heads = 1;
  config.params.causal = false;
  CheckAgainstReference(config, {2048, 1}, {2048, 4097});
  config.seed = 3;
  config.params.causal = true;
  config.page_size = 128;
  CheckAgainstReference(config, {300, 16}, {32768, 32767});
  std::mt19937 rng(9);
  std::vector<int32_t> q_lens, kv_lens;
  for (int i = 0; i < 128; ++i) {
    const int32_t q = i % 16 == 0 ? 0 : (i % 3 == 0 ? 1 : std::uniform_int_distribution<int32_t>(1, 200)(rng));
    q_lens.push_back(q);
    kv_lens.push_back(q + std::uniform_int_distribution<int32_t>(0, 700)(rng));
  }
  config = Config();
  config.kernel = plan::PrefillKernel::kHopper;
  config.num_qo_heads = 16;
  config.num_kv_heads = 4;
  config.seed = 4;
  CheckAgainstReference(config, q_lens, kv_lens);
}

// Many one-tile works per persistent CTA (64-token requests): the two consumer warpgroups'
// turn-taking once let consumer 0 run a whole work ahead and left consumer 1 waiting forever
// on a barrier phase made without it (an intermittent hang of the e2e prompt step, 128 x 64
// tokens). Launched many times: a hang here fails the test by its timeout; every launch must
// also give the same bits.
TEST(BatchPrefillHopperTest, ManyOneTileWorksPerCtaFinishAndAgree) {
  SKIP_WITHOUT_HOPPER();
  // head_dim 256 too: one Q buffer, so every work's Q waits for the work before to release it.
  for (int32_t head_dim : {128, 256}) {
    SCOPED_TRACE(head_dim);
    Config config;
    config.kernel = plan::PrefillKernel::kHopper;
    config.head_dim = head_dim;
    config.num_qo_heads = 8;
    config.num_kv_heads = 2;
    config.split_kv = false;
    const std::vector<int32_t> lens(256, 64);
    const Batch batch = MakeBatch(config, lens, lens);
    const Output first = RunGpu(batch);
    ASSERT_TRUE(first.ok);
    ASSERT_TRUE(first.hopper);
    ExpectMatches(batch, first, RunReference(batch));
    for (int launch = 0; launch < 40; ++launch) {
      const Output again = RunGpu(batch);
      ASSERT_TRUE(again.ok) << "launch " << launch;
      ASSERT_EQ(again.o, first.o) << "launch " << launch;
    }
  }
}

// The planner lays the Hopper works out for its one-wave grid (CTA b's r-th work at r * G + b,
// rounds balanced); on a smaller grid (a share of the SMs beside a decode) the CTAs snake
// through the same items. Either way every work runs once, with the same bits.
TEST(BatchPrefillHopperTest, EveryGridRunsEveryWorkWithTheSameBits) {
  SKIP_WITHOUT_HOPPER();
  Config config;
  config.kernel = plan::PrefillKernel::kHopper;
  config.num_qo_heads = 16;
  config.num_kv_heads = 4;
  config.split_kv = false;
  config.seed = 31;
  std::mt19937 rng(31);
  std::vector<int32_t> q_lens, kv_lens;
  for (int i = 0; i < 24; ++i) {
    q_lens.push_back(std::uniform_int_distribution<int32_t>(1, 700)(rng));
    kv_lens.push_back(q_lens.back() + std::uniform_int_distribution<int32_t>(0, 300)(rng));
  }
  const Batch batch = MakeBatch(config, q_lens, kv_lens);
  const Output balanced = RunGpu(batch);
  ASSERT_TRUE(balanced.ok);
  ASSERT_TRUE(balanced.hopper);
  ExpectMatches(batch, balanced, RunReference(batch));
  for (int32_t grid : {1, 7, 61}) {
    Config smaller = config;
    smaller.max_persistent_ctas = grid;
    const Batch same = MakeBatch(smaller, q_lens, kv_lens);
    const Output got = RunGpu(same);
    ASSERT_TRUE(got.ok) << "grid " << grid;
    EXPECT_EQ(got.o, balanced.o) << "grid " << grid;
    EXPECT_EQ(got.lse, balanced.lse) << "grid " << grid;
  }
}

// Works of at most one KV tile run a tile loop pipelined across works at head_dim 128
// (plan::PrefillLaunch::short_works): the bits of the loop that drains after each work
// (BatchPrefillArgs::pipeline_short_works = false), on the planner's grid and on grids where a CTA takes many works
// in a row, works of no keys among them, causal or not.
TEST(BatchPrefillHopperTest, ShortWorksPipelinedAcrossWorksKeepTheBits) {
  SKIP_WITHOUT_HOPPER();
  std::mt19937 rng(53);
  std::vector<int32_t> q_lens, kv_lens;
  for (int i = 0; i < 40; ++i) {
    q_lens.push_back(std::uniform_int_distribution<int32_t>(1, 128)(rng));
    kv_lens.push_back(q_lens.back() + std::uniform_int_distribution<int32_t>(0, 128 - q_lens.back())(rng));
    if (i % 9 == 4) kv_lens.back() = 0;  // no keys: o 0, lse -inf
  }
  for (bool causal : {true, false}) {
    for (int32_t grid : {0, 1, 7}) {
      Config config;
      config.kernel = plan::PrefillKernel::kHopper;
      config.num_qo_heads = 32;
      config.num_kv_heads = 8;
      config.split_kv = false;
      config.params.causal = causal;
      config.max_persistent_ctas = grid;
      config.seed = 53 + grid;
      const Batch batch = MakeBatch(config, q_lens, kv_lens);
      const Output across = RunGpu(batch);
      Batch drained_batch = batch;
      drained_batch.config.pipeline_short_works = false;
      const Output drained = RunGpu(drained_batch);
      ASSERT_TRUE(drained.ok && across.ok) << "causal " << causal << ", grid " << grid;
      ASSERT_TRUE(across.hopper);
      ASSERT_TRUE(across.short_works);
      ExpectMatches(batch, across, RunReference(batch));
      EXPECT_EQ(across.o, drained.o) << "causal " << causal << ", grid " << grid;
      EXPECT_EQ(across.lse, drained.lse) << "causal " << causal << ", grid " << grid;
    }
  }
}

// Works on demand (BatchPrefillArgs::works_on_demand): whatever the grid, every work runs once
// with the bits of the fixed layout, and the counter is back at 0 after each launch (o and lse
// are poisoned between the launches of one upload, so a launch that skipped works would show).
TEST(BatchPrefillHopperTest, WorksOnDemandRunEveryWorkOnceWithTheLayoutsBits) {
  SKIP_WITHOUT_HOPPER();
  std::mt19937 rng(47);
  std::vector<int32_t> q_lens, kv_lens;
  for (int i = 0; i < 24; ++i) {
    q_lens.push_back(std::uniform_int_distribution<int32_t>(1, 700)(rng));
    kv_lens.push_back(q_lens.back() + std::uniform_int_distribution<int32_t>(0, 300)(rng));
  }
  const std::vector<int32_t> short_lens(200, 64);  // many one-tile works per CTA
  struct Case {
    int32_t head_dim;
    bool causal;
    bool split;
    const std::vector<int32_t>* q;
    const std::vector<int32_t>* kv;
  };
  const Case cases[] = {{128, true, false, &q_lens, &kv_lens}, {128, false, true, &q_lens, &kv_lens},
                        {64, true, false, &q_lens, &kv_lens},  {256, true, false, &q_lens, &kv_lens},
                        {128, true, false, &short_lens, &short_lens}, {256, true, false, &short_lens, &short_lens}};
  uint32_t seed = 470;
  for (const Case& c : cases) {
    Config config;
    config.kernel = plan::PrefillKernel::kHopper;
    config.head_dim = c.head_dim;
    config.num_qo_heads = 16;
    config.num_kv_heads = 4;
    config.params.causal = c.causal;
    config.split_kv = c.split;
    config.fixed_split_tokens = c.split ? 256 : 0;
    config.seed = seed++;
    SCOPED_TRACE(config.Name());
    const Batch batch = MakeBatch(config, *c.q, *c.kv);
    const Output fixed = RunGpu(batch);
    ASSERT_TRUE(fixed.ok);
    ASSERT_TRUE(fixed.hopper);
    ExpectMatches(batch, fixed, RunReference(batch));
    // The launch options live in the batch's config; the inputs stay the same.
    Batch variant = batch;
    for (int32_t grid : {0, 1, 7, 61}) {
      variant.config = config;
      variant.config.works_on_demand = true;
      variant.config.max_persistent_ctas = grid;
      variant.config.launches = 3;
      const Output got = RunGpu(variant);
      ASSERT_TRUE(got.ok) << "grid " << grid;
      EXPECT_EQ(got.o, fixed.o) << "grid " << grid;
      EXPECT_EQ(got.lse, fixed.lse) << "grid " << grid;
    }
    // Two grids on two streams sharing the works (a prefill beside a decode, then the decode's
    // SMs), with split works merged after both.
    for (int32_t grid : {1, 20, 56}) {
      variant.config = config;
      variant.config.works_on_demand = true;
      variant.config.max_persistent_ctas = grid;
      variant.config.tail_ctas = 132 - grid;
      variant.config.launches = 3;
      const Output got = RunGpu(variant);
      ASSERT_TRUE(got.ok) << "grid " << grid << " + tail";
      EXPECT_EQ(got.o, fixed.o) << "grid " << grid << " + tail";
      EXPECT_EQ(got.lse, fixed.lse) << "grid " << grid << " + tail";
    }
  }
}

TEST(BatchPrefillHopperTest, SplitKvMatchesReference) {
  SKIP_WITHOUT_HOPPER();
  uint32_t seed = 900;
  for (int32_t head_dim : {64, 128, 256}) {
    for (bool causal : {true, false}) {
      Config config;
      config.kernel = plan::PrefillKernel::kHopper;
      config.head_dim = head_dim;
      config.params.causal = causal;
      config.params.window_left = seed % 3 == 0 ? 100 : -1;
      config.fixed_split_tokens = 128;
      config.seed = seed++;
      EXPECT_TRUE(CheckAgainstReference(config, kMixedQ, kMixedKv)) << config.Name() << ": expected a split";
    }
  }
  Config config;
  config.kernel = plan::PrefillKernel::kHopper;
  EXPECT_TRUE(CheckAgainstReference(config, {40, 100}, {8000, 3000}));
}

TEST(BatchPrefillHopperTest, OutputIsBitwiseIndependentOfTheBatch) {
  SKIP_WITHOUT_HOPPER();
  CheckBitwiseIndependentOfTheBatch(plan::PrefillKernel::kHopper);
}

// Small and quick: the Hopper sweep run under compute-sanitizer memcheck.
TEST(BatchPrefillHopperTest, SanitizerSweep) {
  SKIP_WITHOUT_HOPPER();
  uint32_t seed = 950;
  for (int32_t head_dim : {64, 128, 256}) {
    for (KvLayout layout : {KvLayout::kNHD, KvLayout::kHND}) {
      Config config;
      config.kernel = plan::PrefillKernel::kHopper;
      config.head_dim = head_dim;
      config.layout = layout;
      config.table = seed % 2 ? TableForm::kSeparateKv : TableForm::kShared;
      config.page_size = seed % 3 == 0 ? 1 : 16;
      config.params.window_left = seed % 4 == 0 ? 9 : -1;
      config.fixed_split_tokens = seed % 2 ? 64 : 0;
      config.split_kv = seed % 2 == 1;  // unsplit: 3 KV tiles, a stage reused
      config.seed = seed++;
      CheckAgainstReference(config, {1, 20, 170, 0, 3}, {1, 20, 300, 5, 0});
    }
  }
}

// Pinned chunks: every query tile kernel (16/64/128 rows) writes partials, MergeStates combines
// them; chunks past a tile's causal reach hold no visible key and must merge as nothing.
// Non-finite inputs (NaN in, NaN out): the rows the CPU reference marks NaN are NaN in o and
// lse, every other row equals the run without the poison exactly. Includes a NaN v of a key that
// earlier rows of its tile do not see (causal): 0 * NaN in P V must not reach them.
void CheckNonFiniteRows(const Config& config) {
  SCOPED_TRACE(config.Name());
  const Batch clean = MakeBatch(config, {100, 40, 1}, {100, 300, 129});
  Batch poisoned = clean;
  const int64_t marked = ApplyPoisons(poisoned, StandardPoisons(config.head_dim));
  const Output clean_out = RunGpu(clean);
  const Output out = RunGpu(poisoned);
  ASSERT_TRUE(clean_out.ok && out.ok);
  if (config.fixed_split_tokens > 0) {
    EXPECT_TRUE(out.split_kv) << "expected a split";
  }
  const Expected expected = RunReference(poisoned);
  kernel_test::ExpectNonFiniteRows(config.q_dtype, poisoned.num_rows * config.num_qo_heads, config.head_dim,
                                   expected.lse, out.o, out.lse, clean_out.o, clean_out.lse, marked);
}

std::vector<Config> NonFiniteConfigs(plan::PrefillKernel kernel) {
  std::vector<Config> configs;
  uint32_t seed = 1500;
  const std::pair<DType, DType> dtypes[] = {{DType::kBFloat16, DType::kBFloat16},
                                            {DType::kFloat16, DType::kFloat16},
                                            {DType::kFloat16, DType::kFloat8E4M3}};
  for (const auto& [q_dtype, kv_dtype] : dtypes) {
    if (kernel == plan::PrefillKernel::kHopper && q_dtype != kv_dtype) continue;
    for (int32_t head_dim : {64, 128, 256}) {
      Config config;
      config.kernel = kernel;
      config.q_dtype = q_dtype;
      config.kv_dtype = kv_dtype;
      config.head_dim = head_dim;
      config.params.causal = true;
      config.seed = seed++;
      configs.push_back(config);
    }
  }
  Config split;  // split-KV: a poisoned partial must make the merged row NaN
  split.kernel = kernel;
  split.params.causal = true;
  split.fixed_split_tokens = 64;
  configs.push_back(split);
  Config capped = split;  // tanh(inf) is finite: the check comes before the cap
  capped.fixed_split_tokens = 0;
  capped.params.logits_soft_cap = 30.0f;
  configs.push_back(capped);
  Config window = split;  // keys left of the window are hidden too
  window.params.window_left = 30;
  window.page_size = 1;
  window.layout = KvLayout::kHND;
  window.table = TableForm::kSeparateKv;
  configs.push_back(window);
  Config full = split;  // non-causal: every row sees every key of its request
  full.params.causal = false;
  full.fixed_split_tokens = 0;
  configs.push_back(full);
  return configs;
}

TEST(BatchPrefillTest, NonFiniteInputsGiveNaNRowsTheyTouchAndNoOthers) {
  ATTND_SKIP_WITHOUT_GPU();
  for (const Config& config : NonFiniteConfigs(plan::PrefillKernel::kMmaSync)) CheckNonFiniteRows(config);
}

TEST(BatchPrefillHopperTest, NonFiniteInputsGiveNaNRowsTheyTouchAndNoOthers) {
  SKIP_WITHOUT_HOPPER();
  for (const Config& config : NonFiniteConfigs(plan::PrefillKernel::kHopper)) CheckNonFiniteRows(config);
}

// Non-finite inputs in KV tiles that every row of a query tile sees whole (no masked key), where
// the Hopper kernel leaves scores alone and checks them on the side, and at the edges (first
// tile, the causal diagonal, the last partial tile). q_lens {200, 40, 1}, kv_lens {400, 300,
// 129}: +-inf k under rows whose q has either sign in that dim (scores +inf for some rows, -inf
// for others: -inf must not read as masked), +inf and NaN v of fully seen keys, NaN k mid-way
// (fully seen by later query tiles, on the diagonal of earlier ones), -inf v of the last key
// (seen by the last row alone), +inf q of the last row and -inf q of the first.
std::vector<Poison> SeenTilePoisons(int32_t head_dim) {
  using Where = Poison::Where;
  return {{Where::kK, 1, 100, 0, 5, INFINITY},      {Where::kK, 0, 3, 1, 0, -INFINITY},
          {Where::kV, 1, 200, 1, 7, INFINITY},      {Where::kV, 2, 0, 0, 0, NAN},
          {Where::kV, 0, 399, 0, head_dim - 1, -INFINITY}, {Where::kK, 0, 250, 0, 2, NAN},
          {Where::kQ, 0, 199, 3, 1, INFINITY},      {Where::kQ, 0, 0, 5, 4, -INFINITY}};
}

void CheckSeenTileNonFiniteRows(const Config& config) {
  SCOPED_TRACE(config.Name());
  const Batch clean = MakeBatch(config, {200, 40, 1}, {400, 300, 129});
  Batch poisoned = clean;
  const int64_t marked = ApplyPoisons(poisoned, SeenTilePoisons(config.head_dim));
  const Output clean_out = RunGpu(clean);
  const Output out = RunGpu(poisoned);
  ASSERT_TRUE(clean_out.ok && out.ok);
  if (config.fixed_split_tokens > 0) {
    EXPECT_TRUE(out.split_kv) << "expected a split";
  }
  const Expected expected = RunReference(poisoned);
  kernel_test::ExpectNonFiniteRows(config.q_dtype, poisoned.num_rows * config.num_qo_heads, config.head_dim,
                                   expected.lse, out.o, out.lse, clean_out.o, clean_out.lse, marked);
}

std::vector<Config> SeenTileNonFiniteConfigs(plan::PrefillKernel kernel) {
  std::vector<Config> configs;
  Config base;
  base.kernel = kernel;
  base.params.causal = true;
  base.split_kv = false;  // whole requests: several KV tiles per query tile
  base.seed = 1600;
  configs.push_back(base);
  Config half = base;
  half.q_dtype = DType::kFloat16;
  half.kv_dtype = DType::kFloat16;
  half.head_dim = 64;
  half.seed = 1601;
  configs.push_back(half);
  Config wide = base;  // head_dim 256: the Hopper kernel's 64-key tiles
  wide.head_dim = 256;
  wide.seed = 1602;
  configs.push_back(wide);
  Config capped = base;  // tanh(+-inf) is finite: checked before the cap
  capped.params.logits_soft_cap = 30.0f;
  configs.push_back(capped);
  Config window = base;  // window edges hide keys on the left of a tile
  window.params.window_left = 150;
  window.page_size = 1;
  configs.push_back(window);
  Config split = base;  // a poisoned partial makes the merged row NaN; chunks of whole tiles
  split.split_kv = true;
  split.fixed_split_tokens = 256;
  configs.push_back(split);
  Config full = base;  // non-causal: every row sees every key of its request
  full.params.causal = false;
  configs.push_back(full);
  return configs;
}

TEST(BatchPrefillTest, NonFiniteInputsInFullySeenTilesGiveNaNRowsTheyTouchAndNoOthers) {
  ATTND_SKIP_WITHOUT_GPU();
  for (const Config& config : SeenTileNonFiniteConfigs(plan::PrefillKernel::kMmaSync)) {
    CheckSeenTileNonFiniteRows(config);
  }
}

TEST(BatchPrefillHopperTest, NonFiniteInputsInFullySeenTilesGiveNaNRowsTheyTouchAndNoOthers) {
  SKIP_WITHOUT_HOPPER();
  for (const Config& config : SeenTileNonFiniteConfigs(plan::PrefillKernel::kHopper)) {
    CheckSeenTileNonFiniteRows(config);
  }
}

TEST(BatchPrefillTest, SplitKvMatchesReference) {
  ATTND_SKIP_WITHOUT_GPU();
  uint32_t seed = 300;
  const std::pair<DType, DType> dtypes[] = {{DType::kBFloat16, DType::kBFloat16},
                                            {DType::kFloat16, DType::kFloat8E4M3}};
  for (const auto& [q_dtype, kv_dtype] : dtypes) {
    for (int32_t head_dim : {64, 128, 256}) {
      for (bool causal : {true, false}) {
        Config config;
        config.q_dtype = q_dtype;
        config.kv_dtype = kv_dtype;
        config.head_dim = head_dim;
        config.params.causal = causal;
        config.params.window_left = seed % 3 == 0 ? 100 : -1;
        config.fixed_split_tokens = 128;
        config.seed = seed++;
        EXPECT_TRUE(CheckAgainstReference(config, kMixedQ, kMixedKv)) << config.Name() << ": expected a split";
      }
    }
  }
}

// No pinned chunk: a lone short query over a long history underfills the device and is split
// by the planner; in deterministic mode the same request splits the same way in any batch.
TEST(BatchPrefillTest, SplitsKvWhenTheBatchUnderfillsTheDevice) {
  ATTND_SKIP_WITHOUT_GPU();
  Config config;
  EXPECT_TRUE(CheckAgainstReference(config, {4}, {30000}));
  EXPECT_TRUE(CheckAgainstReference(config, {40, 100}, {8000, 3000}));
  config.deterministic = true;
  config.seed = 2;
  EXPECT_TRUE(CheckAgainstReference(config, {64, 1, 3}, {9000, 100, 20000}));
  config.split_kv = false;
  EXPECT_FALSE(CheckAgainstReference(config, {4}, {30000}));
}

// Small and quick: the sweep run under compute-sanitizer memcheck.
TEST(BatchPrefillTest, SanitizerSweep) {
  ATTND_SKIP_WITHOUT_GPU();
  uint32_t seed = 500;
  for (DType kv_dtype : {DType::kBFloat16, DType::kFloat8E4M3}) {
    for (int32_t head_dim : {64, 128, 256}) {
      for (KvLayout layout : {KvLayout::kNHD, KvLayout::kHND}) {
        Config config;
        config.kv_dtype = kv_dtype;
        config.head_dim = head_dim;
        config.layout = layout;
        config.table = seed % 2 ? TableForm::kSeparateKv : TableForm::kShared;
        config.page_size = seed % 3 == 0 ? 1 : 16;
        config.params.window_left = seed % 4 == 0 ? 9 : -1;
        config.fixed_split_tokens = seed % 2 ? 64 : 0;
        config.seed = seed++;
        CheckAgainstReference(config, {1, 20, 70, 0, 3}, {1, 20, 150, 5, 0});
      }
    }
  }
}

// --- Launcher argument checks (no GPU) ----------------------------------------------------

using testing::Input;

TEST(BatchPrefillArgsTest, RejectsMismatchedViewsBeforeTouchingTheDevice) {
  const std::vector<int32_t> qo_indptr = {0, 4};
  const std::vector<int32_t> kv_lengths = {4};
  auto plan = plan::PlanPrefill(Input(qo_indptr, kv_lengths, 8, 2, 128));
  ASSERT_TRUE(plan.ok());
  alignas(16) static uint8_t fake[64];
  cuda::BatchPrefillArgs args;
  args.q = {fake, DType::kBFloat16, 4, 8, 128};
  args.o = {fake, DType::kBFloat16, 4, 8, 128};
  args.qo_indptr = reinterpret_cast<const int32_t*>(fake);
  args.pages = {1, 16, args.qo_indptr, args.qo_indptr, args.qo_indptr, args.qo_indptr};
  args.k_cache = {fake, DType::kBFloat16, KvLayout::kNHD, 1, 16, 2, 128};
  args.v_cache = args.k_cache;
  args.params.sm_scale = 0.1f;

  cuda::BatchPrefillArgs bad = args;
  bad.q.head_dim = 64;
  EXPECT_EQ(cuda::BatchPrefill(*plan, bad, fake, 64, nullptr).code(), absl::StatusCode::kInvalidArgument);
  bad = args;
  bad.k_cache.dtype = DType::kFloat32;
  bad.v_cache.dtype = DType::kFloat32;
  EXPECT_EQ(cuda::BatchPrefill(*plan, bad, fake, 64, nullptr).code(), absl::StatusCode::kUnimplemented);
  bad = args;
  bad.pages.page_size = 12;
  bad.k_cache.page_size = bad.v_cache.page_size = 12;
  EXPECT_EQ(cuda::BatchPrefill(*plan, bad, fake, 64, nullptr).code(), absl::StatusCode::kInvalidArgument);
  bad = args;
  bad.params.sm_scale = 0.0f;
  EXPECT_EQ(cuda::BatchPrefill(*plan, bad, fake, 64, nullptr).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cuda::BatchPrefill(*plan, args, fake, 0, nullptr).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace attnd
