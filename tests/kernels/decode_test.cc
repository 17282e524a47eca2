// Batch decode with split-KV on the GPU against the float64 CPU reference (DESIGN 4.2, 4.4, 7).
// Sweep: q/KV dtypes, head dims, page sizes 1/16/128, NHD/HND, SHARED/SEPARATE_KV tables, GQA
// groups 1..8, lengths 0, 1, page boundaries and long; planner-chosen, pinned and disabled
// splits; soft cap, sliding window, lse. The tensor-core kernel (issue 14) runs its own sweep
// (batch 1..256, groups 4..16, page sizes 1/16/64), forced and through the planner's choice. Outputs are poisoned (NaN) before each launch, and
// cache slots no request owns hold NaN, so a read past a sequence's end or an unwritten output
// shows. Tolerances (normwise relative error of o against the float64 reference, whose o is
// kept in float32): 4e-3 for bf16 o, 6e-4 for fp16 o (the outputs' own rounding is ~1.1e-3 and
// ~1.4e-4; 1e-3 for fp16 on the tensor-core kernel, which also rounds P); lse within
// 1e-4 + 1e-5 |lse|. Deterministic mode is checked bitwise.
#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "attnd/kernels/cuda/decode.h"
#include "gtest/gtest.h"
#include "kernel_test_util.h"
#include "plan/decode_plan.h"
#include "reference/attention.h"

namespace attnd {
namespace {

using kernel_test::DevicePageTable;
using kernel_test::DeviceBuffer;
using kernel_test::HostPageTable;
using kernel_test::Upload;

enum class Split { kAuto, kDisabled, kFixed, kDeterministic };

using plan::DecodeKernel;
using plan::DecodeKernelChoice;

struct DecodeCase {
  DType q_dtype = DType::kBFloat16;
  DType kv_dtype = DType::kBFloat16;
  int32_t head_dim = 128;
  int32_t group = 4;
  int32_t num_kv_heads = 2;
  int32_t page_size = 16;
  KvLayout layout = KvLayout::kNHD;
  bool separate_kv = false;
  float soft_cap = 0.0f;
  int32_t window_left = -1;
  Split split = Split::kAuto;
  int32_t fixed_split_tokens = 37;  // odd on purpose: chunks end mid-page and mid-tile
  std::vector<int64_t> lengths;     // empty: the standard mix for the page size
  uint32_t seed = 1;
  // q is uniform in [-q_range, q_range); sm_scale is scaled by 3 / q_range, so the scores keep the
  // same spread whatever the range (the fp8 tensor-core path rescales q rows into fp16's range).
  float q_range = 3.0f;
  // kAuto: the planner picks among the kernels the launcher has for the config, as the backend
  // lets it; otherwise forced.
  DecodeKernelChoice kernel = DecodeKernelChoice::kAuto;
  // Checked against the plan when set (the planner's choice under kAuto).
  std::optional<DecodeKernel> expect_kernel;
};

std::string CaseName(const DecodeCase& c) {
  std::string name = std::string(kernel_test::ShortName(c.q_dtype)) + "_kv" +
                     kernel_test::ShortName(c.kv_dtype) + "_d" + std::to_string(c.head_dim) +
                     "_g" + std::to_string(c.group) + "_p" + std::to_string(c.page_size) +
                     (c.layout == KvLayout::kNHD ? "_nhd" : "_hnd") + (c.separate_kv ? "_sep" : "");
  if (c.kernel == DecodeKernelChoice::kTensorCore) name += "_tc";
  if (c.kernel == DecodeKernelChoice::kCudaCore) name += "_cc";
  if (!c.lengths.empty()) name += "_b" + std::to_string(c.lengths.size());
  if (c.soft_cap > 0) name += "_cap";
  if (c.window_left >= 0) name += "_win" + std::to_string(c.window_left);
  if (c.q_range > 1e3f) name += "_qlarge";
  if (c.q_range < 1e-3f) name += "_qtiny";
  switch (c.split) {
    case Split::kAuto:
      break;
    case Split::kDisabled:
      name += "_nosplit";
      break;
    case Split::kFixed:
      name += "_fixed" + std::to_string(c.fixed_split_tokens);
      break;
    case Split::kDeterministic:
      name += "_det";
      break;
  }
  return name;
}

std::vector<int64_t> StandardLengths(int32_t page_size) {
  // 0 (fully masked), 1, around page boundaries, and a few hundred to a thousand (split).
  return {0, 1, std::max(1, page_size - 1), page_size, page_size + 1, 2 * page_size + 3, 300, 1029};
}

// The host side of one decode problem: q, the two pools and the table.
struct DecodeProblem {
  DecodeCase config;
  int32_t num_qo_heads = 0;
  HostPageTable table;
  std::vector<int32_t> qo_indptr;  // a padding slot (0 rows) sits at index 1 when batch > 2
  int32_t num_rows = 0;
  std::vector<uint8_t> q;
  std::vector<uint8_t> k_pool, v_pool;
  AttentionParams params;

  PagedKvView Pool(std::vector<uint8_t>& bytes) const {
    return PagedKvView{bytes.data(), config.kv_dtype, config.layout, table.num_pages,
                       config.page_size, config.num_kv_heads, config.head_dim};
  }
};

DecodeProblem MakeProblem(const DecodeCase& c) {
  std::mt19937 rng(c.seed);
  DecodeProblem problem;
  problem.config = c;
  problem.num_qo_heads = c.num_kv_heads * c.group;
  std::vector<int64_t> lengths = c.lengths.empty() ? StandardLengths(c.page_size) : c.lengths;
  // A padding slot with keys but no query row: it must produce nothing and break nothing.
  if (lengths.size() > 2) lengths.insert(lengths.begin() + 1, 50);
  problem.table = kernel_test::MakePageTable(lengths, c.page_size, c.separate_kv, 3, rng);
  problem.qo_indptr.push_back(0);
  for (size_t b = 0; b < lengths.size(); ++b) {
    const bool padding = lengths.size() > 2 && b == 1;
    problem.qo_indptr.push_back(problem.qo_indptr.back() + (padding ? 0 : 1));
  }
  problem.num_rows = problem.qo_indptr.back();
  problem.q = kernel_test::RandomElements(
      c.q_dtype, int64_t{problem.num_rows} * problem.num_qo_heads * c.head_dim, c.q_range, rng);

  // Every slot starts as NaN; only the slots of real tokens get values.
  const int64_t pool_elements =
      problem.table.num_pages * c.page_size * c.num_kv_heads * int64_t{c.head_dim};
  problem.k_pool.assign(pool_elements * DTypeBytes(c.kv_dtype), 0xff);
  problem.v_pool.assign(pool_elements * DTypeBytes(c.kv_dtype), 0xff);
  PagedKvView k = problem.Pool(problem.k_pool);
  PagedKvView v = problem.Pool(problem.v_pool);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  for (size_t b = 0; b < lengths.size(); ++b) {
    for (int64_t t = 0; t < lengths[b]; ++t) {
      const int32_t slot = problem.table.indptr[b] + static_cast<int32_t>(t / c.page_size);
      const int32_t entry = static_cast<int32_t>(t % c.page_size);
      for (int32_t h = 0; h < c.num_kv_heads; ++h) {
        const int64_t k_base = k.Offset(problem.table.k_indices[slot], entry, h);
        const int64_t v_base = v.Offset(problem.table.v_indices[slot], entry, h);
        for (int32_t d = 0; d < c.head_dim; ++d) {
          StoreFromFloat(c.kv_dtype, k.data, k_base + d, uniform(rng));
          StoreFromFloat(c.kv_dtype, v.data, v_base + d, uniform(rng));
        }
      }
    }
  }
  problem.params.causal = true;
  problem.params.sm_scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim)) * (3.0f / c.q_range);
  problem.params.logits_soft_cap = c.soft_cap;
  problem.params.window_left = c.window_left;
  if (c.kv_dtype == DType::kFloat8E4M3) {
    problem.params.k_scale = 0.75f;
    problem.params.v_scale = 1.5f;
  }
  return problem;
}

struct DecodeOutput {
  std::vector<uint8_t> o;  // [num_rows][Hq][D], q dtype
  std::vector<float> lse;  // [num_rows][Hq]
  plan::DecodePlan plan;
  // With a signal (RunGpuDecode's `signal_values`): the word and the counter after each launch.
  std::vector<std::pair<uint32_t, uint32_t>> signals;
};

// Runs the CUDA decode on `problem`; fails the test (and returns false) on any error. With
// `signal_values`, one launch per value, each asked to set a word (poisoned before it) to that
// value (BatchDecodeArgs::done); the word and counter are read after each.
bool RunGpuDecode(DecodeProblem& problem, DecodeOutput* out,
                  const std::vector<uint32_t>& signal_values = {}) {
  const DecodeCase& c = problem.config;
  cuda::DecodeKernelConfig config{c.q_dtype, c.kv_dtype, c.head_dim, c.group};
  plan::DecodePlanOptions options;
  options.num_kv_heads = c.num_kv_heads;
  // Both kernels' support and waves, as the backend gives them to the planner.
  options.cuda_core_supported = cuda::DecodeSupports(config);
  if (options.cuda_core_supported) {
    auto ctas = cuda::DecodeCtasPerWave(config);
    EXPECT_TRUE(ctas.ok()) << ctas.status();
    if (!ctas.ok()) return false;
    options.ctas_per_wave = *ctas;
  }
  if (cuda::TensorCoreDecodeSupports(config)) {
    auto ctas = cuda::TensorCoreDecodeCtasPerWave(config);
    EXPECT_TRUE(ctas.ok()) << ctas.status();
    if (!ctas.ok()) return false;
    options.tensor_core_ctas_per_wave = *ctas;
    options.tensor_core_supported = *ctas > 0;
    // Every tested shape fits an H100's shared memory.
    EXPECT_GT(*ctas, 0) << "the tensor-core kernel does not fit this device";
  }
  options.kernel_choice = c.kernel;
  options.window_left = c.window_left;
  options.disable_split_kv = c.split == Split::kDisabled;
  options.deterministic = c.split == Split::kDeterministic;
  if (c.split == Split::kFixed) options.fixed_split_tokens = c.fixed_split_tokens;
  std::vector<int64_t> lengths;
  for (int32_t b = 0; b + 1 < static_cast<int32_t>(problem.table.indptr.size()); ++b)
    lengths.push_back(problem.table.KvLength(b));
  auto plan = plan::PlanBatchDecode(problem.qo_indptr, lengths, options);
  EXPECT_TRUE(plan.ok()) << plan.status();
  if (!plan.ok()) return false;
  out->plan = *plan;
  if (c.kernel == DecodeKernelChoice::kTensorCore) {
    EXPECT_EQ(plan->kernel, DecodeKernel::kTensorCore);
  } else if (c.kernel == DecodeKernelChoice::kCudaCore) {
    EXPECT_EQ(plan->kernel, DecodeKernel::kCudaCore);
  }
  if (c.expect_kernel.has_value()) {
    EXPECT_EQ(plan->kernel, *c.expect_kernel) << "the planner's choice: " << plan->DebugString().substr(0, 200);
  }

  DevicePageTable table(problem.table, c.separate_kv);
  DeviceBuffer q = Upload(problem.q);
  DeviceBuffer k_pool = Upload(problem.k_pool);
  DeviceBuffer v_pool = Upload(problem.v_pool);
  DeviceBuffer packed = Upload(plan->Pack());
  const int64_t o_elements = int64_t{problem.num_rows} * problem.num_qo_heads * c.head_dim;
  std::vector<uint8_t> poison(o_elements * DTypeBytes(c.q_dtype), 0xff);
  DeviceBuffer o = Upload(poison);
  std::vector<float> lse_poison(int64_t{problem.num_rows} * problem.num_qo_heads, NAN);
  DeviceBuffer lse = Upload(lse_poison);
  const int64_t workspace_bytes =
      cuda::BatchDecodeWorkspaceBytes(plan->num_partials, problem.num_qo_heads, c.head_dim);
  DeviceBuffer workspace(workspace_bytes);
  if (workspace_bytes > 0) cudaMemset(workspace.get(), 0xff, workspace_bytes);

  cuda::BatchDecodeArgs args;
  args.q = TokenHeadsView{q.get(), c.q_dtype, problem.num_rows, problem.num_qo_heads, c.head_dim};
  args.pages = table.view;
  args.k_cache = problem.Pool(problem.k_pool);
  args.k_cache.data = k_pool.get();
  args.v_cache = problem.Pool(problem.v_pool);
  args.v_cache.data = v_pool.get();
  args.params = problem.params;
  args.work = plan->View(packed.as<int32_t>());
  args.o = TokenHeadsView{o.get(), c.q_dtype, problem.num_rows, problem.num_qo_heads, c.head_dim};
  args.lse = lse.as<float>();
  args.workspace = workspace.get();
  args.workspace_bytes = workspace_bytes;
  // [0] the word, [1] the counter.
  DeviceBuffer signal = Upload(std::vector<uint32_t>{0xdeadbeefu, 0u});
  for (size_t launch = 0; launch < std::max<size_t>(1, signal_values.size()); ++launch) {
    if (!signal_values.empty()) {
      args.done = {signal.as<uint32_t>(), signal_values[launch], signal.as<uint32_t>() + 1};
      cudaMemset(signal.get(), 0xee, sizeof(uint32_t));  // the word poisoned, the counter kept
    }
    const absl::Status status = cuda::BatchDecode(args, nullptr);
    EXPECT_TRUE(status.ok()) << status;
    if (!status.ok()) return false;
    const cudaError_t error = cudaDeviceSynchronize();
    EXPECT_EQ(error, cudaSuccess) << cudaGetErrorString(error);
    if (error != cudaSuccess) return false;
    if (!signal_values.empty()) {
      const std::vector<uint32_t> words = kernel_test::Download<uint32_t>(signal, 2);
      out->signals.push_back({words[0], words[1]});
    }
  }
  out->o = kernel_test::Download<uint8_t>(o, poison.size());
  out->lse = kernel_test::Download<float>(lse, lse_poison.size());
  return true;
}

struct ReferenceOutput {
  std::vector<uint8_t> o;  // float32
  std::vector<float> lse;
};

ReferenceOutput RunReference(DecodeProblem& problem) {
  const DecodeCase& c = problem.config;
  ReferenceOutput ref;
  const int64_t o_elements = int64_t{problem.num_rows} * problem.num_qo_heads * c.head_dim;
  ref.o.assign(o_elements * sizeof(float), 0);
  ref.lse.assign(int64_t{problem.num_rows} * problem.num_qo_heads, 0.0f);
  reference::BatchAttentionArgs args;
  args.q = TokenHeadsView{problem.q.data(), c.q_dtype, problem.num_rows, problem.num_qo_heads,
                          c.head_dim};
  args.qo_indptr = problem.qo_indptr.data();
  args.pages = problem.table.View();
  args.k_cache = problem.Pool(problem.k_pool);
  args.v_cache = problem.Pool(problem.v_pool);
  args.params = problem.params;
  args.o = TokenHeadsView{ref.o.data(), DType::kFloat32, problem.num_rows, problem.num_qo_heads,
                          c.head_dim};
  args.lse = ref.lse.data();
  args.accumulation = reference::Accumulation::kFloat64;
  reference::BatchAttention(args);
  return ref;
}

// The tensor-core kernel also rounds P to the MMA type before P V (~1.1e-3 normwise for bf16,
// ~2.8e-4 for fp16 on these inputs, on top of o's own rounding): fp16 gets 1e-3 there.
double Tolerance(DType o_dtype, DecodeKernel kernel) {
  if (o_dtype == DType::kBFloat16) return 4e-3;
  return kernel == DecodeKernel::kTensorCore ? 1e-3 : 6e-4;
}

void ExpectMatchesReference(const DecodeProblem& problem, const DecodeOutput& gpu,
                            const ReferenceOutput& ref) {
  const DecodeCase& c = problem.config;
  const int64_t rows = int64_t{problem.num_rows} * problem.num_qo_heads;
  const double error = kernel_test::NormwiseRelativeError(c.q_dtype, gpu.o, DType::kFloat32, ref.o,
                                                          rows * c.head_dim);
  EXPECT_LE(error, Tolerance(c.q_dtype, gpu.plan.kernel)) << "normwise relative error of o";
  int lse_failures = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const float expected = ref.lse[r];
    const float actual = gpu.lse[r];
    if (std::isinf(expected)) {
      if (actual != expected && lse_failures++ < 5) ADD_FAILURE() << "lse row " << r << ": " << actual;
      // A row that sees no key: o exactly 0.
      for (int32_t d = 0; d < c.head_dim; ++d) {
        const double value = kernel_test::ElementAt(c.q_dtype, gpu.o, r * c.head_dim + d);
        if (value != 0.0 && lse_failures++ < 5) ADD_FAILURE() << "masked row " << r << " o=" << value;
      }
    } else if (!(std::fabs(actual - expected) <= 1e-4f + 1e-5f * std::fabs(expected))) {
      if (lse_failures++ < 5) ADD_FAILURE() << "lse row " << r << ": " << actual << " vs " << expected;
    }
  }
}

class DecodeSweepTest : public ::testing::TestWithParam<DecodeCase> {};

TEST_P(DecodeSweepTest, MatchesFloat64Reference) {
  ATTND_SKIP_WITHOUT_GPU();
  DecodeProblem problem = MakeProblem(GetParam());
  DecodeOutput gpu;
  ASSERT_TRUE(RunGpuDecode(problem, &gpu));
  ExpectMatchesReference(problem, gpu, RunReference(problem));
}

std::vector<DecodeCase> SweepCases() {
  std::vector<DecodeCase> cases;
  const std::pair<DType, DType> dtypes[] = {{DType::kBFloat16, DType::kBFloat16},
                                            {DType::kFloat16, DType::kFloat16},
                                            {DType::kBFloat16, DType::kFloat8E4M3},
                                            {DType::kFloat16, DType::kFloat8E4M3}};
  uint32_t seed = 100;
  for (const auto& [q_dtype, kv_dtype] : dtypes) {
    for (int32_t head_dim : {64, 128, 256}) {
      for (int32_t page_size : {1, 16, 128}) {
        for (KvLayout layout : {KvLayout::kNHD, KvLayout::kHND}) {
          for (int32_t group : {1, 4, 8}) {
            DecodeCase c;
            c.q_dtype = q_dtype;
            c.kv_dtype = kv_dtype;
            c.head_dim = head_dim;
            c.page_size = page_size;
            c.layout = layout;
            c.group = group;
            c.separate_kv = (seed % 3) == 0;
            // The CUDA-core kernel's sweep: the planner would now take the tensor-core kernel
            // for most of these shapes (its own sweep is TensorCoreDecodeSweepTest).
            c.kernel = DecodeKernelChoice::kCudaCore;
            c.seed = seed++;
            cases.push_back(c);
          }
        }
      }
    }
  }
  // Mixed q/KV 16-bit types, odd groups (padded up inside the kernel), options.
  DecodeCase mixed;
  mixed.q_dtype = DType::kFloat16;
  mixed.kv_dtype = DType::kBFloat16;
  cases.push_back(mixed);
  for (int32_t group : {2, 3, 5, 6, 7}) {
    DecodeCase c;
    c.group = group;
    c.seed = 200 + group;
    cases.push_back(c);
  }
  for (Split split : {Split::kDisabled, Split::kFixed, Split::kDeterministic}) {
    for (int32_t page_size : {1, 16}) {
      DecodeCase c;
      c.split = split;
      c.page_size = page_size;
      c.layout = page_size == 1 ? KvLayout::kHND : KvLayout::kNHD;
      c.seed = 300 + page_size + static_cast<int>(split);
      cases.push_back(c);
    }
  }
  for (KvLayout layout : {KvLayout::kNHD, KvLayout::kHND}) {
    DecodeCase cap;
    cap.soft_cap = 5.0f;
    cap.layout = layout;
    cases.push_back(cap);
    DecodeCase window;
    window.window_left = 100;
    window.layout = layout;
    window.kv_dtype = DType::kFloat8E4M3;
    cases.push_back(window);
    DecodeCase window_fixed = window;
    window_fixed.window_left = 0;
    window_fixed.split = Split::kFixed;
    cases.push_back(window_fixed);
  }
  // Long sequences (~32k keys) beside short ones.
  for (const auto& [kv_dtype, page_size] :
       {std::pair{DType::kBFloat16, 16}, std::pair{DType::kFloat8E4M3, 128},
        std::pair{DType::kFloat16, 1}}) {
    DecodeCase c;
    c.q_dtype = kv_dtype == DType::kFloat16 ? DType::kFloat16 : DType::kBFloat16;
    c.kv_dtype = kv_dtype;
    c.page_size = page_size;
    c.group = 8;
    c.lengths = {32768, 1, 32771, 4096};
    c.seed = 400 + page_size;
    cases.push_back(c);
  }
  return cases;
}

// gtest prints a parameter in test listings and failures; without this, as raw bytes
// (padding included), which change from build to build.
void PrintTo(const DecodeCase& c, std::ostream* os) { *os << CaseName(c); }

INSTANTIATE_TEST_SUITE_P(Sweep, DecodeSweepTest, ::testing::ValuesIn(SweepCases()),
                         [](const ::testing::TestParamInfo<DecodeCase>& info) {
                           return CaseName(info.param) + "_" + std::to_string(info.index);
                         });

// The same request, alone and among others at another position (different q row, different
// partner lengths, so a batch-dependent chunking would change its reduction order), must give
// bitwise identical o and lse in deterministic mode.
void ExpectBatchInvariant(DecodeCase base) {
  base.split = Split::kDeterministic;
  base.seed = 7;
  // Batch A: the request alone (plus a short one, so the table isn't trivial).
  // Batch B: the request at index 3 of mixed lengths. Same key values via the same seed are not
  // enough (pools are drawn in order), so batch B's request is copied from batch A's pools.
  DecodeCase case_a = base;
  case_a.lengths = {5000, 3};
  DecodeProblem a = MakeProblem(case_a);
  DecodeCase case_b = base;
  case_b.lengths = {700, 20000, 1, 5000, 9000, 64};
  case_b.seed = 8;
  DecodeProblem b = MakeProblem(case_b);
  // Request 0 of A is request 4 of B (index 1 of B is the inserted padding slot).
  const int32_t request_b = 4;
  ASSERT_EQ(b.table.KvLength(request_b), 5000);
  const int64_t row_elements = int64_t{base.num_kv_heads} * base.head_dim;
  const PagedKvView a_k = a.Pool(a.k_pool), a_v = a.Pool(a.v_pool);
  const PagedKvView b_k = b.Pool(b.k_pool), b_v = b.Pool(b.v_pool);
  const int bytes = DTypeBytes(base.kv_dtype);
  for (int64_t t = 0; t < 5000; ++t) {
    const int32_t slot_a = a.table.indptr[0] + static_cast<int32_t>(t / base.page_size);
    const int32_t slot_b = b.table.indptr[request_b] + static_cast<int32_t>(t / base.page_size);
    const int32_t entry = static_cast<int32_t>(t % base.page_size);
    for (int32_t h = 0; h < base.num_kv_heads; ++h) {
      std::memcpy(b.k_pool.data() + b_k.Offset(b.table.k_indices[slot_b], entry, h) * bytes,
                  a.k_pool.data() + a_k.Offset(a.table.k_indices[slot_a], entry, h) * bytes,
                  base.head_dim * bytes);
      std::memcpy(b.v_pool.data() + b_v.Offset(b.table.v_indices[slot_b], entry, h) * bytes,
                  a.v_pool.data() + a_v.Offset(a.table.v_indices[slot_a], entry, h) * bytes,
                  base.head_dim * bytes);
    }
  }
  (void)row_elements;
  const int32_t row_b = b.qo_indptr[request_b];
  const int64_t q_row_bytes = int64_t{a.num_qo_heads} * base.head_dim * DTypeBytes(base.q_dtype);
  std::memcpy(b.q.data() + row_b * q_row_bytes, a.q.data(), q_row_bytes);

  DecodeOutput out_a, out_b;
  ASSERT_TRUE(RunGpuDecode(a, &out_a));
  ASSERT_TRUE(RunGpuDecode(b, &out_b));
  ASSERT_TRUE(out_a.plan.split_kv) << "the request should be split: " << out_a.plan.DebugString();
  EXPECT_EQ(std::memcmp(out_a.o.data(), out_b.o.data() + row_b * q_row_bytes, q_row_bytes), 0)
      << "o differs between batches";
  EXPECT_EQ(std::memcmp(out_a.lse.data(), out_b.lse.data() + int64_t{row_b} * a.num_qo_heads,
                        a.num_qo_heads * sizeof(float)),
            0)
      << "lse differs between batches";
  // And the answer is right.
  ExpectMatchesReference(a, out_a, RunReference(a));
}

class DecodeDeterminismTest : public ::testing::TestWithParam<DType> {};

TEST_P(DecodeDeterminismTest, RequestResultIsBitwiseBatchInvariant) {
  ATTND_SKIP_WITHOUT_GPU();
  DecodeCase base;
  base.kv_dtype = GetParam();
  ExpectBatchInvariant(base);
}

// The tensor-core kernel's reduction order depends on the item alone too (fixed warp split and
// merge order), so a deterministic plan forced onto it is batch-invariant as well.
TEST(TensorCoreDecodeDeterminismTest, RequestResultIsBitwiseBatchInvariant) {
  ATTND_SKIP_WITHOUT_GPU();
  DecodeCase base;
  base.group = 8;
  base.kernel = DecodeKernelChoice::kTensorCore;
  ExpectBatchInvariant(base);
}

// A channel layer's done word set by the decode's last grid (BatchDecodeArgs::done, DESIGN 3b):
// each launch sets the word to its value and leaves the counter at zero for the next, whichever
// grid is last (the decode kernel, or the merge of a split plan), and o and lse are bitwise those
// of a launch without the signal.
TEST(DecodeSignalTest, LastGridSetsTheWordAndLeavesTheCounterZero) {
  ATTND_SKIP_WITHOUT_GPU();
  for (const DecodeKernelChoice kernel : {DecodeKernelChoice::kTensorCore, DecodeKernelChoice::kCudaCore}) {
    for (const Split split : {Split::kDisabled, Split::kFixed}) {
      DecodeCase c;
      c.kernel = kernel;
      c.split = split;
      c.fixed_split_tokens = 64;
      c.lengths = {0, 1, 17, 300, 1029, 4000, 64};
      DecodeProblem problem = MakeProblem(c);
      SCOPED_TRACE(CaseName(c));
      DecodeOutput plain, signalled;
      ASSERT_TRUE(RunGpuDecode(problem, &plain));
      const std::vector<uint32_t> values = {1, 2, 0x80000005u};
      ASSERT_TRUE(RunGpuDecode(problem, &signalled, values));
      EXPECT_EQ(plain.plan.split_kv, split == Split::kFixed) << plain.plan.DebugString();
      ASSERT_EQ(signalled.signals.size(), values.size());
      for (size_t i = 0; i < values.size(); ++i) {
        EXPECT_EQ(signalled.signals[i].first, values[i]) << "launch " << i << ": the word";
        EXPECT_EQ(signalled.signals[i].second, 0u) << "launch " << i << ": the counter";
      }
      EXPECT_EQ(plain.o, signalled.o) << "o differs with the signal";
      EXPECT_EQ(std::memcmp(plain.lse.data(), signalled.lse.data(), plain.lse.size() * sizeof(float)), 0)
          << "lse differs with the signal";
      ExpectMatchesReference(problem, signalled, RunReference(problem));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(KvDtypes, DecodeDeterminismTest,
                         ::testing::Values(DType::kBFloat16, DType::kFloat8E4M3),
                         [](const ::testing::TestParamInfo<DType>& info) {
                           return std::string(kernel_test::ShortName(info.param));
                         });

// The tensor-core kernel (issue 14): forced over q/KV types (one 16-bit type, or an fp8 cache) x
// head dims x page sizes 1/16/64 x groups 4/8/16 (layouts, tables and split modes rotating), and
// groups 1-3, over the standard length mix (0, 1, page boundaries, lengths that are no multiple of
// its 64-key tile); then batches of 1..256 with random lengths, odd groups (padded rows), soft
// cap, sliding window, q past fp16's range or in its subnormals over fp8; and batches the planner
// itself routes to it (or keeps on CUDA cores).
class TensorCoreDecodeSweepTest : public ::testing::TestWithParam<DecodeCase> {};

TEST_P(TensorCoreDecodeSweepTest, MatchesFloat64Reference) {
  ATTND_SKIP_WITHOUT_GPU();
  DecodeProblem problem = MakeProblem(GetParam());
  DecodeOutput gpu;
  ASSERT_TRUE(RunGpuDecode(problem, &gpu));
  ExpectMatchesReference(problem, gpu, RunReference(problem));
}

// `batch` requests of lengths uniform in [1, max_length] (seeded), with 1 and a page boundary
// among them.
std::vector<int64_t> RandomLengths(int32_t batch, int64_t max_length, int32_t page_size, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int64_t> uniform(1, max_length);
  std::vector<int64_t> lengths;
  for (int32_t b = 0; b < batch; ++b) lengths.push_back(uniform(rng));
  lengths[0] = 1;
  if (batch > 1) lengths[batch - 1] = 4 * page_size;
  return lengths;
}

std::vector<DecodeCase> TensorCoreCases() {
  std::vector<DecodeCase> cases;
  uint32_t seed = 1000;
  const Split splits[] = {Split::kAuto, Split::kFixed, Split::kDisabled};
  // q / cache types: one 16-bit type, or an fp8 cache (head_dim 128 and 256).
  const std::pair<DType, DType> dtypes[] = {{DType::kBFloat16, DType::kBFloat16},
                                            {DType::kFloat16, DType::kFloat16},
                                            {DType::kBFloat16, DType::kFloat8E4M3},
                                            {DType::kFloat16, DType::kFloat8E4M3}};
  for (const auto& [q_dtype, kv_dtype] : dtypes) {
    for (int32_t head_dim : {64, 128, 256}) {
      if (kv_dtype == DType::kFloat8E4M3 && head_dim == 64) continue;
      for (int32_t page_size : {1, 16, 64}) {
        for (int32_t group : {4, 8, 16}) {
          DecodeCase c;
          c.kernel = DecodeKernelChoice::kTensorCore;
          c.q_dtype = q_dtype;
          c.kv_dtype = kv_dtype;
          c.head_dim = head_dim;
          c.page_size = page_size;
          c.group = group;
          c.layout = seed % 2 == 0 ? KvLayout::kNHD : KvLayout::kHND;
          c.separate_kv = seed % 3 == 0;
          c.split = splits[(seed / 2) % 3];
          c.seed = seed++;
          cases.push_back(c);
        }
      }
    }
  }
  // Batches of 1..256, split by the planner and not at all.
  for (int32_t batch : {1, 2, 7, 64, 256}) {
    for (Split split : {Split::kAuto, Split::kDisabled}) {
      DecodeCase c;
      c.kernel = DecodeKernelChoice::kTensorCore;
      c.group = batch == 7 ? 16 : 8;
      c.page_size = batch == 64 ? 1 : 16;
      c.split = split;
      c.lengths = RandomLengths(batch, batch >= 64 ? 700 : 3000, c.page_size, seed);
      c.seed = seed++;
      cases.push_back(c);
    }
  }
  // fp8 at head_dim 128 has two pipelines: a batch of many short requests takes the shallow one
  // (more CTAs than 2 an SM, chunks under 1024 keys), one long request the deep one.
  for (int32_t batch : {1, 256}) {
    DecodeCase c;
    c.kernel = DecodeKernelChoice::kTensorCore;
    c.kv_dtype = DType::kFloat8E4M3;
    c.group = 8;
    c.lengths = RandomLengths(batch, batch > 1 ? 700 : 3000, c.page_size, seed);
    c.seed = seed++;
    cases.push_back(c);
  }
  // Groups below 4 (MHA among them): every dtype pair and head dim, pages of 1 and 16.
  for (const auto& [q_dtype, kv_dtype] : dtypes) {
    for (int32_t head_dim : {64, 128, 256}) {
      if (kv_dtype == DType::kFloat8E4M3 && head_dim == 64) continue;
      for (int32_t group : {1, 2, 3}) {
        DecodeCase c;
        c.kernel = DecodeKernelChoice::kTensorCore;
        c.q_dtype = q_dtype;
        c.kv_dtype = kv_dtype;
        c.head_dim = head_dim;
        c.group = group;
        c.num_kv_heads = group == 1 ? 4 : 2;
        c.page_size = group == 2 ? 1 : 16;
        c.layout = seed % 2 == 0 ? KvLayout::kNHD : KvLayout::kHND;
        c.separate_kv = seed % 3 == 0;
        c.split = splits[(seed / 2) % 3];
        c.seed = seed++;
        cases.push_back(c);
      }
    }
  }
  // Odd groups: rows padded to 16 inside the kernel.
  for (int32_t group : {5, 6, 7, 12}) {
    DecodeCase c;
    c.kernel = DecodeKernelChoice::kTensorCore;
    c.group = group;
    c.num_kv_heads = 3;
    c.seed = seed++;
    cases.push_back(c);
  }
  // Options: soft cap, sliding windows (the plan cuts items to the window), fixed splits.
  for (KvLayout layout : {KvLayout::kNHD, KvLayout::kHND}) {
    DecodeCase cap;
    cap.kernel = DecodeKernelChoice::kTensorCore;
    cap.soft_cap = 5.0f;
    cap.layout = layout;
    cap.seed = seed++;
    cases.push_back(cap);
    DecodeCase window = cap;
    window.soft_cap = 0.0f;
    window.window_left = 100;
    window.q_dtype = window.kv_dtype = DType::kFloat16;
    window.seed = seed++;
    cases.push_back(window);
    DecodeCase window_fixed = window;
    window_fixed.window_left = 0;
    window_fixed.split = Split::kFixed;
    window_fixed.seed = seed++;
    cases.push_back(window_fixed);
  }
  // Long sequences beside short ones.
  for (DType kv_dtype : {DType::kBFloat16, DType::kFloat8E4M3}) {
    DecodeCase c;
    c.kernel = DecodeKernelChoice::kTensorCore;
    c.kv_dtype = kv_dtype;
    c.group = 8;
    c.lengths = {32768, 1, 32771, 4096};
    c.seed = seed++;
    cases.push_back(c);
  }
  // fp8 caches: q past fp16's range (bf16 only) and q in fp16's subnormals, which the kernel's
  // per-row power of two brings into range; a soft cap and a window over fp8; odd groups.
  for (const auto& [q_dtype, q_range] : {std::pair{DType::kBFloat16, 3.0e6f}, std::pair{DType::kBFloat16, 2.0e-6f},
                                         std::pair{DType::kFloat16, 2.0e-6f}}) {
    for (int32_t head_dim : {128, 256}) {
      DecodeCase c;
      c.kernel = DecodeKernelChoice::kTensorCore;
      c.q_dtype = q_dtype;
      c.kv_dtype = DType::kFloat8E4M3;
      c.head_dim = head_dim;
      c.q_range = q_range;
      c.seed = seed++;
      cases.push_back(c);
    }
  }
  for (int32_t group : {5, 12}) {
    DecodeCase c;
    c.kernel = DecodeKernelChoice::kTensorCore;
    c.kv_dtype = DType::kFloat8E4M3;
    c.group = group;
    c.num_kv_heads = 3;
    c.soft_cap = group == 5 ? 5.0f : 0.0f;
    c.window_left = group == 12 ? 100 : -1;
    c.layout = group == 5 ? KvLayout::kHND : KvLayout::kNHD;
    c.seed = seed++;
    cases.push_back(c);
  }
  // The planner's choice: a large batch, batch 1 of 8192 keys and a short batch (16 requests of
  // up to 64 keys; tensor cores from 1 x 512 keys up measured faster, decode_plan.h) go to tensor
  // cores, group 16 (no CUDA-core kernel) always does, and deterministic plans stay on CUDA cores.
  {
    DecodeCase large;
    large.group = 4;
    large.num_kv_heads = 8;
    large.lengths = RandomLengths(256, 700, 16, seed);
    large.expect_kernel = DecodeKernel::kTensorCore;
    large.seed = seed++;
    cases.push_back(large);
    DecodeCase single = large;
    single.lengths = {8192};
    single.expect_kernel = DecodeKernel::kTensorCore;
    single.seed = seed++;
    cases.push_back(single);
    DecodeCase short_kv = large;
    short_kv.lengths = RandomLengths(16, 64, 16, seed);
    short_kv.expect_kernel = DecodeKernel::kTensorCore;
    short_kv.seed = seed++;
    cases.push_back(short_kv);
    DecodeCase fp8 = large;  // fp8 caches take tensor cores too
    fp8.kv_dtype = DType::kFloat8E4M3;
    fp8.expect_kernel = DecodeKernel::kTensorCore;
    fp8.seed = seed++;
    cases.push_back(fp8);
    DecodeCase mha = large;  // and groups below 4, MHA among them
    mha.group = 1;
    mha.expect_kernel = DecodeKernel::kTensorCore;
    mha.seed = seed++;
    cases.push_back(mha);
    DecodeCase group16 = large;
    group16.group = 16;
    group16.num_kv_heads = 2;
    group16.lengths = {1000, 1};
    group16.expect_kernel = DecodeKernel::kTensorCore;
    group16.seed = seed++;
    cases.push_back(group16);
    DecodeCase deterministic = large;
    deterministic.split = Split::kDeterministic;
    deterministic.expect_kernel = DecodeKernel::kCudaCore;
    deterministic.seed = seed++;
    cases.push_back(deterministic);
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Sweep, TensorCoreDecodeSweepTest, ::testing::ValuesIn(TensorCoreCases()),
                         [](const ::testing::TestParamInfo<DecodeCase>& info) {
                           return CaseName(info.param) + "_" + std::to_string(info.index);
                         });

// Non-finite inputs (NaN in, NaN out): NaN/inf in one q element, one cached k element and one
// cached v element make exactly the rows that read them NaN (o in every dim, lse), as the CPU
// reference marks them; every other row is bitwise the run without the poison. Split and
// unsplit plans: a poisoned partial must make its merged row NaN, never masked.
class DecodeNonFiniteTest : public ::testing::TestWithParam<DecodeCase> {};

TEST_P(DecodeNonFiniteTest, NaNRowsAreExactlyThoseThatReadANonFiniteInput) {
  ATTND_SKIP_WITHOUT_GPU();
  const DecodeCase& c = GetParam();
  DecodeProblem clean = MakeProblem(c);
  DecodeProblem poisoned = clean;
  // Requests (MakeProblem inserts a padding slot at index 1): 0: 300 keys, 2: 1029, 3: 45, 4: 7.
  ASSERT_EQ(poisoned.qo_indptr.size(), 6u);
  const int32_t hq = poisoned.num_qo_heads;
  auto q_index = [&](int32_t request, int32_t head, int32_t d) {
    return (int64_t{poisoned.qo_indptr[request]} * hq + head) * c.head_dim + d;
  };
  const PagedKvView k = poisoned.Pool(poisoned.k_pool);
  const PagedKvView v = poisoned.Pool(poisoned.v_pool);
  auto pool_index = [&](const PagedKvView& pool, int32_t request, int64_t token, int32_t kv_head, int32_t d) {
    const int32_t slot = poisoned.table.indptr[request] + static_cast<int32_t>(token / c.page_size);
    const int32_t page = pool.data == k.data ? poisoned.table.k_indices[slot] : poisoned.table.v_indices[slot];
    return pool.Offset(page, static_cast<int32_t>(token % c.page_size), kv_head) + d;
  };
  StoreFromFloat(c.q_dtype, poisoned.q.data(), q_index(0, 3, 5), NAN);
  StoreFromFloat(c.q_dtype, poisoned.q.data(), q_index(4, hq - 2, 0), -INFINITY);
  // A key late in request 2 (its last split chunk) and an early one of request 3.
  kernel_test::StoreNonFinite(c.kv_dtype, k.data, pool_index(k, 2, 1000, 1, 7), INFINITY);
  kernel_test::StoreNonFinite(c.kv_dtype, v.data, pool_index(v, 3, 10, 0, c.head_dim - 1), -INFINITY);
  kernel_test::StoreNonFinite(c.kv_dtype, v.data, pool_index(v, 2, 3, 1, 0), NAN);  // same rows as the k
  // The padding slot's keys: no query row reads them.
  kernel_test::StoreNonFinite(c.kv_dtype, k.data, pool_index(k, 1, 3, 0, 0), NAN);

  DecodeOutput gpu_clean, gpu;
  ASSERT_TRUE(RunGpuDecode(clean, &gpu_clean));
  ASSERT_TRUE(RunGpuDecode(poisoned, &gpu));
  if (c.split == Split::kFixed) {
    ASSERT_TRUE(gpu.plan.split_kv) << gpu.plan.DebugString();
  }
  const ReferenceOutput reference = RunReference(poisoned);
  const int64_t rows = int64_t{poisoned.num_rows} * hq;
  // q: one row each; k and v: every head of the KV head's group of one request.
  kernel_test::ExpectNonFiniteRows(c.q_dtype, rows, c.head_dim, reference.lse, gpu.o, gpu.lse, gpu_clean.o,
                                   gpu_clean.lse, 2 + 2 * c.group);
}

std::vector<DecodeCase> NonFiniteCases() {
  std::vector<DecodeCase> cases;
  uint32_t seed = 1200;
  for (DType kv_dtype : {DType::kFloat16, DType::kBFloat16, DType::kFloat8E4M3}) {
    for (Split split : {Split::kFixed, Split::kDisabled}) {
      DecodeCase c;
      c.q_dtype = kv_dtype == DType::kFloat16 ? DType::kFloat16 : DType::kBFloat16;
      c.kv_dtype = kv_dtype;
      c.split = split;
      c.lengths = {300, 1029, 45, 7};
      c.seed = seed++;
      cases.push_back(c);
    }
  }
  DecodeCase capped;  // tanh(inf) is finite: the check must come before the cap
  capped.soft_cap = 30.0f;
  capped.split = Split::kFixed;
  capped.head_dim = 64;
  capped.group = 8;
  capped.lengths = {300, 1029, 45, 7};
  cases.push_back(capped);
  // The tensor-core kernel (16-bit and fp8 caches), split and not, capped.
  for (DType dtype : {DType::kFloat16, DType::kBFloat16, DType::kFloat8E4M3}) {
    for (Split split : {Split::kFixed, Split::kDisabled}) {
      DecodeCase c;
      c.kernel = DecodeKernelChoice::kTensorCore;
      c.q_dtype = dtype == DType::kFloat16 ? DType::kFloat16 : DType::kBFloat16;
      c.kv_dtype = dtype;
      c.split = split;
      c.lengths = {300, 1029, 45, 7};
      c.seed = seed++;
      cases.push_back(c);
    }
  }
  DecodeCase tc_capped = capped;
  tc_capped.kernel = DecodeKernelChoice::kTensorCore;
  cases.push_back(tc_capped);
  return cases;
}

INSTANTIATE_TEST_SUITE_P(NonFinite, DecodeNonFiniteTest, ::testing::ValuesIn(NonFiniteCases()),
                         [](const ::testing::TestParamInfo<DecodeCase>& info) {
                           return CaseName(info.param);
                         });

// A small sweep for compute-sanitizer (run with --gtest_filter='Sanitizer*').
class SanitizerDecodeTest : public ::testing::TestWithParam<DecodeCase> {};

TEST_P(SanitizerDecodeTest, MatchesReference) {
  ATTND_SKIP_WITHOUT_GPU();
  DecodeProblem problem = MakeProblem(GetParam());
  DecodeOutput gpu;
  ASSERT_TRUE(RunGpuDecode(problem, &gpu));
  ExpectMatchesReference(problem, gpu, RunReference(problem));
}

std::vector<DecodeCase> SanitizerCases() {
  std::vector<DecodeCase> cases;
  uint32_t seed = 900;
  for (DType kv_dtype : {DType::kBFloat16, DType::kFloat8E4M3}) {
    for (int32_t head_dim : {64, 256}) {
      for (int32_t page_size : {1, 16}) {
        DecodeCase c;
        c.kv_dtype = kv_dtype;
        c.head_dim = head_dim;
        c.page_size = page_size;
        c.group = page_size == 1 ? 8 : 1;
        c.layout = page_size == 1 ? KvLayout::kHND : KvLayout::kNHD;
        c.separate_kv = page_size == 1;
        c.split = page_size == 1 ? Split::kFixed : Split::kAuto;
        c.lengths = {0, 1, 17, 300};
        c.seed = seed++;
        cases.push_back(c);
      }
    }
  }
  // The tensor-core kernel: every head dim, page sizes 1 and 16, a split and an unsplit plan.
  for (int32_t head_dim : {64, 128, 256}) {
    for (int32_t page_size : {1, 16}) {
      DecodeCase c;
      c.kernel = DecodeKernelChoice::kTensorCore;
      c.q_dtype = c.kv_dtype = head_dim == 128 ? DType::kFloat16 : DType::kBFloat16;
      c.head_dim = head_dim;
      c.page_size = page_size;
      c.group = page_size == 1 ? 16 : 5;
      c.layout = page_size == 1 ? KvLayout::kHND : KvLayout::kNHD;
      c.separate_kv = page_size == 1;
      c.split = page_size == 1 ? Split::kFixed : Split::kAuto;
      c.lengths = {0, 1, 17, 300};
      c.seed = seed++;
      cases.push_back(c);
      if (head_dim >= 128) {  // the fp8 cache's kernel
        c.kv_dtype = DType::kFloat8E4M3;
        c.seed = seed++;
        cases.push_back(c);
      }
    }
  }
  // fp8's shallow pipeline (head_dim 128, more CTAs than 2 an SM of chunks under 1024 keys).
  {
    DecodeCase c;
    c.kernel = DecodeKernelChoice::kTensorCore;
    c.kv_dtype = DType::kFloat8E4M3;
    c.lengths = RandomLengths(160, 300, c.page_size, seed);
    c.seed = seed++;
    cases.push_back(c);
  }
  // MHA (group 1: 15 of the MMA's 16 rows padding), 16-bit and fp8.
  for (DType kv_dtype : {DType::kBFloat16, DType::kFloat8E4M3}) {
    DecodeCase c;
    c.kernel = DecodeKernelChoice::kTensorCore;
    c.kv_dtype = kv_dtype;
    c.group = 1;
    c.num_kv_heads = 4;
    c.lengths = {0, 1, 17, 300};
    c.seed = seed++;
    cases.push_back(c);
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Sanitizer, SanitizerDecodeTest, ::testing::ValuesIn(SanitizerCases()),
                         [](const ::testing::TestParamInfo<DecodeCase>& info) {
                           return CaseName(info.param);
                         });

TEST(DecodeArgsTest, RejectsUnsupportedConfigs) {
  EXPECT_FALSE(cuda::DecodeSupports({DType::kBFloat16, DType::kBFloat16, 96, 1}));
  EXPECT_FALSE(cuda::DecodeSupports({DType::kBFloat16, DType::kBFloat16, 128, 9}));
  EXPECT_FALSE(cuda::DecodeSupports({DType::kFloat8E4M3, DType::kBFloat16, 128, 1}));
  EXPECT_TRUE(cuda::DecodeSupports({DType::kFloat16, DType::kFloat8E4M3, 256, 7}));
  // Tensor cores: q fp16/bf16 over a cache of q's type or (head_dim 128, 256) of fp8; groups 1..16.
  EXPECT_TRUE(cuda::TensorCoreDecodeSupports({DType::kBFloat16, DType::kBFloat16, 128, 4}));
  EXPECT_TRUE(cuda::TensorCoreDecodeSupports({DType::kFloat16, DType::kFloat16, 256, 16}));
  EXPECT_TRUE(cuda::TensorCoreDecodeSupports({DType::kBFloat16, DType::kBFloat16, 64, 7}));
  EXPECT_TRUE(cuda::TensorCoreDecodeSupports({DType::kBFloat16, DType::kBFloat16, 128, 2}));
  EXPECT_TRUE(cuda::TensorCoreDecodeSupports({DType::kFloat16, DType::kFloat16, 64, 1}));
  EXPECT_FALSE(cuda::TensorCoreDecodeSupports({DType::kBFloat16, DType::kBFloat16, 128, 17}));
  EXPECT_TRUE(cuda::TensorCoreDecodeSupports({DType::kBFloat16, DType::kFloat8E4M3, 128, 8}));
  EXPECT_TRUE(cuda::TensorCoreDecodeSupports({DType::kFloat16, DType::kFloat8E4M3, 256, 16}));
  EXPECT_FALSE(cuda::TensorCoreDecodeSupports({DType::kBFloat16, DType::kFloat8E4M3, 64, 8}));
  EXPECT_TRUE(cuda::TensorCoreDecodeSupports({DType::kBFloat16, DType::kFloat8E4M3, 128, 1}));
  EXPECT_FALSE(cuda::TensorCoreDecodeSupports({DType::kFloat16, DType::kBFloat16, 128, 8}));
  EXPECT_FALSE(cuda::TensorCoreDecodeSupports({DType::kBFloat16, DType::kBFloat16, 96, 8}));
  EXPECT_EQ(cuda::BatchDecodeWorkspaceBytes(0, 32, 128), 0);
  EXPECT_GE(cuda::BatchDecodeWorkspaceBytes(10, 32, 128), 10 * 32 * 128 * 4 + 10 * 32 * 4);
}

}  // namespace
}  // namespace attnd
