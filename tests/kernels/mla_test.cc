// MLA decode on the GPU against the float64 CPU reference (DESIGN 4.4, 4.6, 7). Sweep: 16..128
// heads, 1..4 query tokens per request (mixed in one batch, causal among them), kv_lora_rank 512
// and 256, q/cache dtypes fp16, bf16 and fp8_e4m3 (with distinct ckv and kpe scales), page sizes
// 32 and 64 (plus 1 and 16: any power of two), SHARED and SEPARATE_KV tables, every split
// scheme of the planner (auto, oversubscription, one wave, none, pinned, deterministic),
// lengths 0, 1, tile and page boundaries, long (to 131072) in one batch; kAuto runs the
// wide-tile Hopper kernel on an H100 (16-bit and fp8 caches), every case of the sweep runs again
// on the mma.sync kernel, and each case of one 16-bit type on the first Hopper kernel (kHopper). Outputs are poisoned
// (NaN) before each launch and cache slots no request owns hold NaN, so a read past a
// sequence's end or an unwritten output shows.
//
// Tolerances, normwise relative error of o against the float64 reference (o kept in float32):
// 1e-2 for 16-bit caches, 5e-2 for fp8 caches (P is rounded to the MMA type, o to its dtype;
// measured errors are printed per case). lse within 1e-3 + 1e-4 |lse|; 1e-2 + 1e-3 |lse| where q
// is rounded once more on its way to the MMA (kpe_scale / ckv_scale not a power of two, folded
// into q_pe; fp16 q over a bf16 cache, multiplied in bf16).
// Deterministic mode is checked bitwise.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <ostream>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "attnd/kernels/cuda/mla_decode.h"
#include "gtest/gtest.h"
#include "kernel_test_util.h"
#include "plan/mla_plan.h"
#include "reference/attention.h"

namespace attnd {
namespace {

using kernel_test::DeviceBuffer;
using kernel_test::DevicePageTable;
using kernel_test::HostPageTable;
using kernel_test::Upload;
using plan::MlaSplitMode;

constexpr int32_t kRopeDim = 64;

struct MlaCase {
  DType q_dtype = DType::kBFloat16;
  DType kv_dtype = DType::kBFloat16;
  int32_t rank = 512;
  int32_t num_heads = 16;
  std::vector<int32_t> q_lens = {1};  // cycled over the requests
  int32_t page_size = 64;
  bool separate_kv = false;
  MlaSplitMode mode = MlaSplitMode::kAuto;
  int32_t fixed_split_tokens = 0;  // > 0: pinned
  bool deterministic = false;
  int32_t min_tokens_per_cta = 0;  // > 0: overrides the planner default (to force splits)
  float ckv_scale = 0.75f;         // fp8 only
  float kpe_scale = 1.5f;          // fp8 only
  float soft_cap = 0.0f;
  int32_t window_left = -1;
  bool causal = true;
  std::vector<int64_t> lengths;  // empty: the standard mix
  cuda::MlaKernel kernel = cuda::MlaKernel::kAuto;  // Hopper on an H100 where it applies
  bool allow_tma = true;  // MlaDecodeArgs::allow_tma
  bool allow_cluster = true;  // MlaDecodeArgs::allow_cluster
  uint32_t seed = 1;
};

std::string CaseName(const MlaCase& c) {
  std::string name = std::string(kernel_test::ShortName(c.q_dtype)) + "_kv" +
                     kernel_test::ShortName(c.kv_dtype) + "_r" + std::to_string(c.rank) + "_h" +
                     std::to_string(c.num_heads) + "_q";
  for (int32_t q : c.q_lens) name += std::to_string(q);
  name += "_p" + std::to_string(c.page_size) + (c.separate_kv ? "_sep" : "_shared") + "_" +
          plan::MlaSplitModeName(c.mode);
  if (c.fixed_split_tokens > 0) name += "_fixed" + std::to_string(c.fixed_split_tokens);
  if (c.deterministic) name += "_det";
  if (c.soft_cap > 0) name += "_cap";
  if (c.window_left >= 0) name += "_win" + std::to_string(c.window_left);
  if (!c.causal) name += "_noncausal";
  if (c.kernel == cuda::MlaKernel::kMmaSync) name += "_mma";
  if (c.kernel == cuda::MlaKernel::kHopper) name += "_hopper";
  if (c.kernel == cuda::MlaKernel::kHopperWide) name += "_wide";
  return name;
}

// A case that forces a Hopper kernel skips on devices without it (kAuto and kMmaSync run anywhere).
bool KernelAvailable(const MlaCase& c) {
  return cuda::MlaDecodeCtasPerWave({c.q_dtype, c.kv_dtype, c.rank, kRopeDim, c.kernel}).ok();
}

std::vector<int64_t> StandardLengths() {
  // 0 (fully masked), 1, around the kernel's 32-key tiles and 64-token pages, a few thousand.
  return {0, 1, 31, 32, 33, 64, 65, 300, 1029, 2500};
}

struct MlaProblem {
  MlaCase config;
  HostPageTable table;
  std::vector<int32_t> qo_indptr;
  int32_t num_rows = 0;  // query tokens
  std::vector<uint8_t> q_nope, q_pe;
  std::vector<uint8_t> ckv_pool, kpe_pool;
  AttentionParams params;

  PagedKvView CkvPool(void* data) const {
    return PagedKvView{data, config.kv_dtype, KvLayout::kNHD, table.num_pages, config.page_size, 1, config.rank};
  }
  PagedKvView KpePool(void* data) const {
    return PagedKvView{data, config.kv_dtype, KvLayout::kNHD, table.num_pages, config.page_size, 1, kRopeDim};
  }
  int64_t QElements(int32_t dim) const { return int64_t{num_rows} * config.num_heads * dim; }
};

MlaProblem MakeProblem(const MlaCase& c) {
  std::mt19937 rng(c.seed);
  MlaProblem problem;
  problem.config = c;
  std::vector<int64_t> lengths = c.lengths.empty() ? StandardLengths() : c.lengths;
  // A padding slot with keys but no query row: it must produce nothing and break nothing.
  if (lengths.size() > 2) lengths.insert(lengths.begin() + 1, 50);
  problem.table = kernel_test::MakePageTable(lengths, c.page_size, c.separate_kv, 3, rng);
  problem.qo_indptr.push_back(0);
  for (size_t b = 0; b < lengths.size(); ++b) {
    const bool padding = lengths.size() > 2 && b == 1;
    const int32_t q_len = padding ? 0 : c.q_lens[b % c.q_lens.size()];
    problem.qo_indptr.push_back(problem.qo_indptr.back() + q_len);
  }
  problem.num_rows = problem.qo_indptr.back();
  problem.q_nope = kernel_test::RandomElements(c.q_dtype, problem.QElements(c.rank), 2.0f, rng);
  problem.q_pe = kernel_test::RandomElements(c.q_dtype, problem.QElements(kRopeDim), 2.0f, rng);

  // Every slot starts as NaN; only the slots of real tokens get values.
  const int64_t slots = problem.table.num_pages * c.page_size;
  problem.ckv_pool.assign(slots * c.rank * DTypeBytes(c.kv_dtype), 0xff);
  problem.kpe_pool.assign(slots * kRopeDim * DTypeBytes(c.kv_dtype), 0xff);
  const PagedKvView ckv = problem.CkvPool(problem.ckv_pool.data());
  const PagedKvView kpe = problem.KpePool(problem.kpe_pool.data());
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  const float range = c.kv_dtype == DType::kFloat8E4M3 ? 2.0f : 1.0f;
  for (size_t b = 0; b < lengths.size(); ++b) {
    for (int64_t t = 0; t < lengths[b]; ++t) {
      const int32_t slot = problem.table.indptr[b] + static_cast<int32_t>(t / c.page_size);
      const int32_t entry = static_cast<int32_t>(t % c.page_size);
      const int64_t ckv_base = ckv.Offset(problem.table.k_indices[slot], entry, 0);
      const int64_t kpe_base = kpe.Offset(problem.table.v_indices[slot], entry, 0);
      for (int32_t d = 0; d < c.rank; ++d) StoreFromFloat(c.kv_dtype, ckv.data, ckv_base + d, range * uniform(rng));
      for (int32_t d = 0; d < kRopeDim; ++d) StoreFromFloat(c.kv_dtype, kpe.data, kpe_base + d, range * uniform(rng));
    }
  }
  problem.params.causal = c.causal;
  problem.params.sm_scale = 1.0f / std::sqrt(192.0f);
  problem.params.logits_soft_cap = c.soft_cap;
  problem.params.window_left = c.window_left;
  if (c.kv_dtype == DType::kFloat8E4M3) {
    problem.params.k_scale = c.ckv_scale;
    problem.params.v_scale = c.kpe_scale;
  }
  return problem;
}

std::vector<int64_t> Lengths(const MlaProblem& problem) {
  std::vector<int64_t> lengths;
  for (size_t b = 0; b + 1 < problem.table.indptr.size(); ++b)
    lengths.push_back(problem.table.KvLength(static_cast<int32_t>(b)));
  return lengths;
}

struct MlaOutput {
  std::vector<uint8_t> o;  // [rows][H][rank], q dtype
  std::vector<float> lse;  // [rows][H]
  plan::MlaPlan plan;
};

absl::StatusOr<plan::MlaPlan> PlanFor(const MlaProblem& problem) {
  const MlaCase& c = problem.config;
  auto ctas = cuda::MlaDecodeCtasPerWave({c.q_dtype, c.kv_dtype, c.rank, kRopeDim, c.kernel});
  if (!ctas.ok()) return ctas.status();
  plan::MlaPlanOptions options;
  options.num_heads = c.num_heads;
  options.ctas_per_wave = *ctas;
  options.split_mode = c.mode;
  options.fixed_split_tokens = c.fixed_split_tokens;
  options.deterministic = c.deterministic;
  if (c.min_tokens_per_cta > 0) {
    options.min_tokens_per_cta = c.min_tokens_per_cta;
    options.min_chunk_tokens = c.min_tokens_per_cta;
  }
  return plan::PlanMlaDecode(problem.qo_indptr, Lengths(problem), options);
}

// Runs the CUDA decode on `problem` with `plan` (extra_units: placeholder units appended, which
// must change nothing); fails the test (and returns false) on any error.
bool RunGpu(const MlaProblem& problem, const plan::MlaPlan& plan, MlaOutput* out, int extra_units = 0) {
  const MlaCase& c = problem.config;
  out->plan = plan;
  for (int i = 0; i < extra_units; ++i) {
    out->plan.units.insert(out->plan.units.begin() + (i * 7) % (out->plan.units.size() + 1),
                           plan::MlaWorkUnit{});
  }
  DevicePageTable table(problem.table, c.separate_kv);
  DeviceBuffer q_nope = Upload(problem.q_nope);
  DeviceBuffer q_pe = Upload(problem.q_pe);
  DeviceBuffer ckv_pool = Upload(problem.ckv_pool);
  DeviceBuffer kpe_pool = Upload(problem.kpe_pool);
  DeviceBuffer packed = Upload(out->plan.Pack());
  const int64_t o_elements = problem.QElements(c.rank);
  std::vector<uint8_t> poison(o_elements * DTypeBytes(c.q_dtype), 0xff);
  DeviceBuffer o = Upload(poison);
  std::vector<float> lse_poison(int64_t{problem.num_rows} * c.num_heads, NAN);
  DeviceBuffer lse = Upload(lse_poison);
  const int64_t workspace_bytes = cuda::MlaDecodeWorkspaceBytes(plan.num_partials, c.num_heads, c.rank);
  DeviceBuffer workspace(workspace_bytes);
  if (workspace_bytes > 0) cudaMemset(workspace.get(), 0xff, workspace_bytes);

  cuda::MlaDecodeArgs args;
  args.q_nope = TokenHeadsView{q_nope.get(), c.q_dtype, problem.num_rows, c.num_heads, c.rank};
  args.q_pe = TokenHeadsView{q_pe.get(), c.q_dtype, problem.num_rows, c.num_heads, kRopeDim};
  args.pages = table.view;
  args.ckv_cache = problem.CkvPool(ckv_pool.get());
  args.kpe_cache = problem.KpePool(kpe_pool.get());
  args.params = problem.params;
  args.work = out->plan.View(packed.as<int32_t>());
  args.o = TokenHeadsView{o.get(), c.q_dtype, problem.num_rows, c.num_heads, c.rank};
  args.lse = lse.as<float>();
  args.workspace = workspace.get();
  args.workspace_bytes = workspace_bytes;
  args.kernel = c.kernel;
  args.allow_tma = c.allow_tma;
  args.allow_cluster = c.allow_cluster;
  const absl::Status status = cuda::MlaDecode(args, nullptr);
  EXPECT_TRUE(status.ok()) << status;
  if (!status.ok()) return false;
  const cudaError_t error = cudaDeviceSynchronize();
  EXPECT_EQ(error, cudaSuccess) << cudaGetErrorString(error);
  if (error != cudaSuccess) return false;
  out->o = kernel_test::Download<uint8_t>(o, poison.size());
  out->lse = kernel_test::Download<float>(lse, lse_poison.size());
  return true;
}

bool RunGpu(const MlaProblem& problem, MlaOutput* out) {
  auto plan = PlanFor(problem);
  EXPECT_TRUE(plan.ok()) << plan.status();
  if (!plan.ok()) return false;
  return RunGpu(problem, *plan, out);
}

struct ReferenceOutput {
  std::vector<uint8_t> o;  // float32
  std::vector<float> lse;
};

ReferenceOutput RunReference(MlaProblem& problem) {
  const MlaCase& c = problem.config;
  ReferenceOutput ref;
  ref.o.assign(problem.QElements(c.rank) * sizeof(float), 0);
  ref.lse.assign(int64_t{problem.num_rows} * c.num_heads, 0.0f);
  reference::MlaAttentionArgs args;
  args.q_nope = TokenHeadsView{problem.q_nope.data(), c.q_dtype, problem.num_rows, c.num_heads, c.rank};
  args.q_pe = TokenHeadsView{problem.q_pe.data(), c.q_dtype, problem.num_rows, c.num_heads, kRopeDim};
  args.qo_indptr = problem.qo_indptr.data();
  args.pages = problem.table.View();
  args.ckv_cache = problem.CkvPool(problem.ckv_pool.data());
  args.kpe_cache = problem.KpePool(problem.kpe_pool.data());
  args.params = problem.params;
  args.o = TokenHeadsView{ref.o.data(), DType::kFloat32, problem.num_rows, c.num_heads, c.rank};
  args.lse = ref.lse.data();
  args.accumulation = reference::Accumulation::kFloat64;
  reference::MlaAttention(args);
  return ref;
}

bool PowerOfTwo(float value) {
  int exponent = 0;
  return std::frexp(value, &exponent) == 0.5f;
}

void ExpectMatchesReference(const MlaProblem& problem, const MlaOutput& gpu, const ReferenceOutput& ref) {
  const MlaCase& c = problem.config;
  const int64_t rows = int64_t{problem.num_rows} * c.num_heads;
  const double error =
      kernel_test::NormwiseRelativeError(c.q_dtype, gpu.o, DType::kFloat32, ref.o, rows * c.rank);
  const double tolerance = c.kv_dtype == DType::kFloat8E4M3 ? 5e-2 : 1e-2;
  std::printf("[mla] %s: %s, o error %.2e\n", CaseName(c).c_str(), gpu.plan.DebugString().substr(0, 120).c_str(), error);
  EXPECT_LE(error, tolerance) << "normwise relative error of o; " << gpu.plan.DebugString().substr(0, 300);
  // q reaches the MMA exactly unless kpe_scale / ckv_scale (folded into q_pe) is no power of two
  // or fp16 q meets a bf16 cache (the MMA runs in bf16: q loses 3 mantissa bits).
  const bool q_exact = PowerOfTwo(problem.params.v_scale / problem.params.k_scale) &&
                       !(c.q_dtype == DType::kFloat16 && c.kv_dtype == DType::kBFloat16);
  const float lse_abs = q_exact ? 1e-3f : 1e-2f;
  const float lse_rel = q_exact ? 1e-4f : 1e-3f;
  int failures = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const float expected = ref.lse[r];
    const float actual = gpu.lse[r];
    if (std::isinf(expected)) {
      if (actual != expected && failures++ < 5) ADD_FAILURE() << "lse row " << r << ": " << actual;
      // A row that sees no key: o exactly 0.
      for (int32_t d = 0; d < c.rank; ++d) {
        const double value = kernel_test::ElementAt(c.q_dtype, gpu.o, r * c.rank + d);
        if (value != 0.0 && failures++ < 5) ADD_FAILURE() << "masked row " << r << " o=" << value;
      }
    } else if (!(std::fabs(actual - expected) <= lse_abs + lse_rel * std::fabs(expected))) {
      if (failures++ < 5) ADD_FAILURE() << "lse row " << r << ": " << actual << " vs " << expected;
    }
  }
}

class MlaSweepTest : public ::testing::TestWithParam<MlaCase> {};

TEST_P(MlaSweepTest, MatchesFloat64Reference) {
  ATTND_SKIP_WITHOUT_GPU();
  if (!KernelAvailable(GetParam())) GTEST_SKIP() << "no " << CaseName(GetParam()) << " kernel on this device";
  MlaProblem problem = MakeProblem(GetParam());
  MlaOutput gpu;
  ASSERT_TRUE(RunGpu(problem, &gpu));
  ExpectMatchesReference(problem, gpu, RunReference(problem));
}

std::vector<MlaCase> SweepCases() {
  std::vector<MlaCase> cases;
  const std::pair<DType, DType> dtypes[] = {{DType::kBFloat16, DType::kBFloat16},
                                            {DType::kFloat16, DType::kFloat16},
                                            {DType::kBFloat16, DType::kFloat8E4M3},
                                            {DType::kFloat16, DType::kFloat8E4M3}};
  const int32_t heads[] = {16, 128, 64, 24};
  const std::vector<int32_t> q_lens[] = {{1}, {1, 2}, {3, 1, 4, 2}, {4}};
  const MlaSplitMode modes[] = {MlaSplitMode::kAuto, MlaSplitMode::kOversubscribe,
                                MlaSplitMode::kOneWave, MlaSplitMode::kNone};
  uint32_t seed = 100;
  for (int d = 0; d < 4; ++d) {
    for (int i = 0; i < 4; ++i) {
      MlaCase c;
      c.q_dtype = dtypes[d].first;
      c.kv_dtype = dtypes[d].second;
      c.num_heads = heads[(i + d) % 4];
      // 128 heads x 4 tokens is 8 CTAs per chunk: keep the reference affordable.
      c.q_lens = c.num_heads == 128 ? std::vector<int32_t>{1, 2} : q_lens[i];
      c.page_size = (i + d) % 2 == 0 ? 64 : 32;
      c.separate_kv = (i + d / 2) % 2 == 1;
      c.mode = modes[(i + d) % 4];
      // Small chunks so that the standard lengths split (several chunks, partial merge).
      c.min_tokens_per_cta = c.mode == MlaSplitMode::kOversubscribe ? 96 : 0;
      c.seed = seed++;
      cases.push_back(c);
    }
  }
  // The mma.sync kernel on the same cases (kAuto runs the wide-tile Hopper kernel there on an H100).
  const size_t hopper_eligible = cases.size();
  for (size_t i = 0; i < hopper_eligible; ++i) {
    MlaCase c = cases[i];
    c.kernel = cuda::MlaKernel::kMmaSync;
    c.seed += 1000;
    cases.push_back(c);
  }
  // kv_lora_rank 256.
  for (int d = 0; d < 4; ++d) {
    MlaCase c;
    c.rank = 256;
    c.q_dtype = dtypes[d].first;
    c.kv_dtype = dtypes[d].second;
    c.num_heads = d % 2 == 0 ? 32 : 128;
    c.q_lens = d % 2 == 0 ? std::vector<int32_t>{2, 1} : std::vector<int32_t>{1};
    c.page_size = d < 2 ? 32 : 64;
    c.separate_kv = d % 2 == 1;
    c.mode = d < 2 ? MlaSplitMode::kOversubscribe : MlaSplitMode::kAuto;
    c.min_tokens_per_cta = 64;
    c.seed = seed++;
    cases.push_back(c);
  }
  // Mixed q and cache 16-bit types (q converted into the cache's type), pinned odd chunks
  // (mid-tile and mid-page ends), other page sizes, a non-power-of-two scale ratio.
  {
    MlaCase c;
    c.q_dtype = DType::kFloat16;
    c.kv_dtype = DType::kBFloat16;
    c.num_heads = 32;
    c.q_lens = {1, 3};
    c.fixed_split_tokens = 37;
    c.seed = seed++;
    cases.push_back(c);
    c.q_dtype = DType::kBFloat16;
    c.kv_dtype = DType::kFloat16;
    c.page_size = 16;
    c.separate_kv = true;
    c.fixed_split_tokens = 200;
    c.seed = seed++;
    cases.push_back(c);
    c.kv_dtype = DType::kFloat8E4M3;
    c.page_size = 1;
    c.fixed_split_tokens = 0;
    c.ckv_scale = 0.6f;
    c.kpe_scale = 1.3f;
    c.seed = seed++;
    cases.push_back(c);
  }
  // Deterministic mode, soft cap, window, non-causal multi-token.
  {
    MlaCase c;
    c.num_heads = 128;
    c.deterministic = true;
    c.lengths = {5000, 2049, 100, 0};
    c.seed = seed++;
    cases.push_back(c);
    MlaCase cap;
    cap.num_heads = 16;
    cap.q_lens = {2};
    cap.soft_cap = 5.0f;
    cap.mode = MlaSplitMode::kOversubscribe;
    cap.min_tokens_per_cta = 128;
    cap.seed = seed++;
    cases.push_back(cap);
    MlaCase window;
    window.num_heads = 16;
    window.q_lens = {3};
    window.window_left = 100;
    window.kv_dtype = DType::kFloat8E4M3;
    window.fixed_split_tokens = 64;
    window.seed = seed++;
    cases.push_back(window);
    MlaCase non_causal;
    non_causal.num_heads = 20;
    non_causal.q_lens = {4};
    non_causal.causal = false;
    non_causal.seed = seed++;
    cases.push_back(non_causal);
  }
  // kAuto runs the wide-tile Hopper kernel on an H100; the first Hopper kernel (kHopper) on
  // every case the Hopper kernels take (q and cache of one 16-bit type), then the wide-tile one
  // forced on chunk ends inside its 64-key tiles (pinned 37- and 200-key chunks), pages of 1 and
  // 16, and a window.
  const size_t all = cases.size();
  for (size_t i = 0; i < all; ++i) {
    if (cases[i].kernel != cuda::MlaKernel::kAuto || cases[i].q_dtype != cases[i].kv_dtype) continue;
    MlaCase c = cases[i];
    c.kernel = cuda::MlaKernel::kHopper;
    c.seed += 2000;
    cases.push_back(c);
  }
  {
    MlaCase c;
    c.kernel = cuda::MlaKernel::kHopperWide;
    c.num_heads = 32;
    c.q_lens = {1, 3};
    c.fixed_split_tokens = 37;
    c.seed = seed++;
    cases.push_back(c);
    c.q_dtype = DType::kFloat16;
    c.kv_dtype = DType::kFloat16;
    c.num_heads = 128;
    c.q_lens = {1};
    c.page_size = 16;
    c.separate_kv = true;
    c.fixed_split_tokens = 200;
    c.seed = seed++;
    cases.push_back(c);
    c.rank = 256;
    c.page_size = 1;
    c.fixed_split_tokens = 0;
    c.seed = seed++;
    cases.push_back(c);
    // fp8 caches on the wide-tile kernel: pinned odd chunks, pages of 16 and 1, a scale ratio
    // that is not a power of two (q_pe times it, rounded), rank 256.
    MlaCase fp8;
    fp8.kernel = cuda::MlaKernel::kHopperWide;
    fp8.kv_dtype = DType::kFloat8E4M3;
    fp8.num_heads = 128;
    fp8.q_lens = {1, 2};
    fp8.page_size = 16;
    fp8.separate_kv = true;
    fp8.fixed_split_tokens = 37;
    fp8.ckv_scale = 0.6f;
    fp8.kpe_scale = 1.3f;
    fp8.seed = seed++;
    cases.push_back(fp8);
    fp8.q_dtype = DType::kFloat16;
    fp8.rank = 256;
    fp8.num_heads = 32;
    fp8.page_size = 1;
    fp8.fixed_split_tokens = 200;
    fp8.seed = seed++;
    cases.push_back(fp8);
    MlaCase window;
    window.kernel = cuda::MlaKernel::kHopperWide;
    window.num_heads = 16;
    window.q_lens = {3};
    window.window_left = 100;
    window.fixed_split_tokens = 64;
    window.seed = seed++;
    cases.push_back(window);
  }
  return cases;
}

// Non-finite inputs (NaN in, NaN out): NaN/inf in q_nope, q_pe, ckv (which is also V) and kpe
// make exactly the rows that read them NaN (o in every dim, lse), as the CPU reference marks
// them; every other row equals the run without the poison exactly. Four query tokens per
// request, causal: a NaN ckv of a key the request's first tokens do not see must not reach
// them through P V (0 * NaN).
class MlaNonFiniteTest : public ::testing::TestWithParam<MlaCase> {};

TEST_P(MlaNonFiniteTest, NaNRowsAreExactlyThoseThatReadANonFiniteInput) {
  ATTND_SKIP_WITHOUT_GPU();
  const MlaCase& c = GetParam();
  if (!KernelAvailable(c)) GTEST_SKIP() << "no " << CaseName(c) << " kernel on this device";
  MlaProblem clean = MakeProblem(c);
  MlaProblem poisoned = clean;
  // Requests (a padding slot sits at index 1): 0: 300 keys, 2: 1029, 3: 45, 4: 7; 4 tokens each.
  ASSERT_EQ(poisoned.qo_indptr.size(), 6u);
  auto q_len = [&](int32_t request) { return poisoned.qo_indptr[request + 1] - poisoned.qo_indptr[request]; };
  std::vector<bool> marked(int64_t{poisoned.num_rows} * c.num_heads, false);
  auto sees = [&](int32_t request, int32_t i, int64_t key) {
    const int64_t position = poisoned.table.KvLength(request) - q_len(request) + i;
    return !c.causal || key <= position;
  };
  auto poison_q = [&](std::vector<uint8_t>& q, int32_t dim, int32_t request, int32_t i, int32_t head, int32_t d,
                      float value) {
    const int64_t row = int64_t{poisoned.qo_indptr[request] + i} * c.num_heads + head;
    StoreFromFloat(c.q_dtype, q.data(), row * dim + d, value);
    marked[row] = true;  // every poisoned row here sees keys
  };
  auto poison_key = [&](bool ckv, int32_t request, int64_t token, int32_t d, float value) {
    const int32_t slot = poisoned.table.indptr[request] + static_cast<int32_t>(token / c.page_size);
    const int32_t entry = static_cast<int32_t>(token % c.page_size);
    const PagedKvView pool = ckv ? poisoned.CkvPool(poisoned.ckv_pool.data()) : poisoned.KpePool(poisoned.kpe_pool.data());
    const int32_t page = ckv ? poisoned.table.k_indices[slot] : poisoned.table.v_indices[slot];
    kernel_test::StoreNonFinite(c.kv_dtype, pool.data, pool.Offset(page, entry, 0) + d, value);
    for (int32_t i = 0; i < q_len(request); ++i) {
      if (!sees(request, i, token)) continue;
      for (int32_t h = 0; h < c.num_heads; ++h) marked[int64_t{poisoned.qo_indptr[request] + i} * c.num_heads + h] = true;
    }
  };
  poison_key(true, 2, 1027, 11, NAN);           // seen by tokens 2 and 3 only
  poison_key(true, 0, 100, c.rank - 1, -INFINITY);
  poison_key(false, 3, 44, 5, INFINITY);        // kpe: the score only; seen by token 3 only
  poison_q(poisoned.q_nope, c.rank, 3, 0, 5, 7, NAN);
  poison_q(poisoned.q_pe, kRopeDim, 4, 0, c.num_heads - 1, 0, -INFINITY);
  poison_key(true, 1, 3, 0, NAN);               // the padding slot: no row reads it

  auto plan = PlanFor(clean);
  ASSERT_TRUE(plan.ok()) << plan.status();
  if (c.fixed_split_tokens > 0) {
    ASSERT_GT(plan->num_partials, 0) << "expected a split";
  }
  MlaOutput gpu_clean, gpu;
  ASSERT_TRUE(RunGpu(clean, *plan, &gpu_clean));
  ASSERT_TRUE(RunGpu(poisoned, *plan, &gpu));
  const ReferenceOutput reference = RunReference(poisoned);
  kernel_test::ExpectNonFiniteRows(c.q_dtype, int64_t{poisoned.num_rows} * c.num_heads, c.rank, reference.lse, gpu.o,
                                   gpu.lse, gpu_clean.o, gpu_clean.lse,
                                   std::count(marked.begin(), marked.end(), true));
}

std::vector<MlaCase> NonFiniteCases() {
  std::vector<MlaCase> cases;
  uint32_t seed = 1700;
  for (cuda::MlaKernel kernel : {cuda::MlaKernel::kMmaSync, cuda::MlaKernel::kHopper, cuda::MlaKernel::kHopperWide}) {
    for (int32_t rank : {512, 256}) {
      for (int32_t fixed_split : {0, 64}) {
        MlaCase c;
        c.kernel = kernel;
        c.rank = rank;
        c.q_lens = {4};
        c.lengths = {300, 1029, 45, 7};
        c.mode = fixed_split > 0 ? MlaSplitMode::kAuto : MlaSplitMode::kNone;
        c.fixed_split_tokens = fixed_split;
        c.seed = seed++;
        cases.push_back(c);
      }
    }
    MlaCase capped;  // tanh(inf) is finite: the check comes before the cap
    capped.kernel = kernel;
    capped.q_lens = {4};
    capped.lengths = {300, 1029, 45, 7};
    capped.soft_cap = 5.0f;
    capped.seed = seed++;
    cases.push_back(capped);
    MlaCase non_causal = capped;
    non_causal.soft_cap = 0.0f;
    non_causal.causal = false;
    cases.push_back(non_causal);
  }
  MlaCase fp8;
  fp8.kernel = cuda::MlaKernel::kMmaSync;
  fp8.kv_dtype = DType::kFloat8E4M3;
  fp8.q_dtype = DType::kFloat16;
  fp8.q_lens = {4};
  fp8.lengths = {300, 1029, 45, 7};
  fp8.fixed_split_tokens = 64;
  fp8.seed = seed++;
  cases.push_back(fp8);
  fp8.kernel = cuda::MlaKernel::kHopperWide;
  fp8.seed = seed++;
  cases.push_back(fp8);
  fp8.q_dtype = DType::kBFloat16;
  fp8.fixed_split_tokens = 0;
  fp8.mode = MlaSplitMode::kNone;
  fp8.seed = seed++;
  cases.push_back(fp8);
  return cases;
}

INSTANTIATE_TEST_SUITE_P(NonFinite, MlaNonFiniteTest, ::testing::ValuesIn(NonFiniteCases()),
                         [](const ::testing::TestParamInfo<MlaCase>& info) { return CaseName(info.param); });

// gtest prints a parameter in test listings and failures; without this, as raw bytes
// (padding included), which change from build to build.
void PrintTo(const MlaCase& c, std::ostream* os) { *os << CaseName(c); }

INSTANTIATE_TEST_SUITE_P(Sweep, MlaSweepTest, ::testing::ValuesIn(SweepCases()),
                         [](const ::testing::TestParamInfo<MlaCase>& info) {
                           return CaseName(info.param) + "_" + std::to_string(info.index);
                         });

// Lengths 0..131072 mixed in one batch (16 heads so the float64 reference stays affordable).
class MlaLongTest : public ::testing::TestWithParam<MlaCase> {};

TEST_P(MlaLongTest, MatchesFloat64Reference) {
  ATTND_SKIP_WITHOUT_GPU();
  if (!KernelAvailable(GetParam())) GTEST_SKIP() << "no " << CaseName(GetParam()) << " kernel on this device";
  MlaProblem problem = MakeProblem(GetParam());
  MlaOutput gpu;
  ASSERT_TRUE(RunGpu(problem, &gpu));
  ExpectMatchesReference(problem, gpu, RunReference(problem));
}

std::vector<MlaCase> LongCases() {
  MlaCase over;
  over.num_heads = 16;
  over.page_size = 64;
  over.mode = MlaSplitMode::kOversubscribe;
  over.lengths = {131072, 0, 3, 40000, 4096, 65};
  over.seed = 500;
  MlaCase wave = over;
  wave.kv_dtype = DType::kFloat8E4M3;
  wave.page_size = 32;
  wave.separate_kv = true;
  wave.mode = MlaSplitMode::kOneWave;
  wave.lengths = {1, 131072, 20000};
  wave.seed = 501;
  MlaCase mma = over;
  mma.kernel = cuda::MlaKernel::kMmaSync;
  mma.mode = MlaSplitMode::kAuto;
  mma.seed = 502;
  MlaCase wide = over;
  wide.kernel = cuda::MlaKernel::kHopperWide;
  wide.seed = 503;
  MlaCase wide_unsplit = wide;
  wide_unsplit.mode = MlaSplitMode::kNone;
  wide_unsplit.lengths = {131072, 1, 8191, 0, 64, 65};
  wide_unsplit.seed = 504;
  return {over, wave, mma, wide, wide_unsplit};
}

INSTANTIATE_TEST_SUITE_P(Long, MlaLongTest, ::testing::ValuesIn(LongCases()),
                         [](const ::testing::TestParamInfo<MlaCase>& info) {
                           return CaseName(info.param);
                         });

// The request at index 0 of batch A is request 3 of batch B (same pools, same page ids, its q
// rows copied): in deterministic mode its o and lse must be bitwise identical, whatever the
// other requests and wherever it sits.
class MlaDeterminismTest : public ::testing::TestWithParam<std::pair<DType, cuda::MlaKernel>> {};

TEST_P(MlaDeterminismTest, RequestResultIsBitwiseBatchInvariant) {
  ATTND_SKIP_WITHOUT_GPU();
  MlaCase base;
  base.kv_dtype = GetParam().first;
  base.kernel = GetParam().second;
  if (!KernelAvailable(base)) GTEST_SKIP() << "no " << CaseName(base) << " kernel on this device";
  base.num_heads = 64;
  base.q_lens = {3, 1, 2};
  base.deterministic = true;
  base.separate_kv = true;
  base.lengths = {700, 20000, 9001, 1, 64};
  base.seed = 7;
  MlaProblem b = MakeProblem(base);
  const int32_t request_b = 3;  // index 1 is the inserted padding slot; lengths[2] = 9001
  ASSERT_EQ(b.table.KvLength(request_b), 9001);
  const int32_t q_len = b.qo_indptr[request_b + 1] - b.qo_indptr[request_b];
  ASSERT_EQ(q_len, 3);

  MlaProblem a = b;
  a.table.indptr = {0, b.table.indptr[request_b + 1] - b.table.indptr[request_b]};
  a.table.k_indices.assign(b.table.k_indices.begin() + b.table.indptr[request_b],
                           b.table.k_indices.begin() + b.table.indptr[request_b + 1]);
  a.table.v_indices.assign(b.table.v_indices.begin() + b.table.indptr[request_b],
                           b.table.v_indices.begin() + b.table.indptr[request_b + 1]);
  a.table.last_page_len = {b.table.last_page_len[request_b]};
  a.qo_indptr = {0, q_len};
  a.num_rows = q_len;
  const int64_t nope_row = int64_t{base.num_heads} * base.rank * DTypeBytes(base.q_dtype);
  const int64_t pe_row = int64_t{base.num_heads} * kRopeDim * DTypeBytes(base.q_dtype);
  const int32_t row_b = b.qo_indptr[request_b];
  a.q_nope.assign(b.q_nope.begin() + row_b * nope_row, b.q_nope.begin() + (row_b + q_len) * nope_row);
  a.q_pe.assign(b.q_pe.begin() + row_b * pe_row, b.q_pe.begin() + (row_b + q_len) * pe_row);

  MlaOutput out_a, out_b;
  ASSERT_TRUE(RunGpu(a, &out_a));
  ASSERT_TRUE(RunGpu(b, &out_b));
  ASSERT_GT(out_a.plan.num_partials, 0) << "the request should be split: " << out_a.plan.DebugString();
  const int64_t o_row = int64_t{base.num_heads} * base.rank * DTypeBytes(base.q_dtype);
  EXPECT_EQ(std::memcmp(out_a.o.data(), out_b.o.data() + row_b * o_row, q_len * o_row), 0)
      << "o differs between batches";
  EXPECT_EQ(std::memcmp(out_a.lse.data(), out_b.lse.data() + int64_t{row_b} * base.num_heads,
                        q_len * base.num_heads * sizeof(float)),
            0)
      << "lse differs between batches";
  // Placeholder units (request -1, as a padded grid launches) change nothing.
  MlaOutput padded;
  ASSERT_TRUE(RunGpu(b, out_b.plan, &padded, 5));
  EXPECT_EQ(padded.o, out_b.o);
  EXPECT_EQ(std::memcmp(padded.lse.data(), out_b.lse.data(), out_b.lse.size() * sizeof(float)), 0);
  // And the answer is right.
  ExpectMatchesReference(a, out_a, RunReference(a));
}

INSTANTIATE_TEST_SUITE_P(KvDtypes, MlaDeterminismTest,
                         ::testing::Values(std::pair{DType::kBFloat16, cuda::MlaKernel::kAuto},
                                           std::pair{DType::kBFloat16, cuda::MlaKernel::kMmaSync},
                                           std::pair{DType::kBFloat16, cuda::MlaKernel::kHopperWide},
                                           std::pair{DType::kFloat8E4M3, cuda::MlaKernel::kMmaSync},
                                           std::pair{DType::kFloat8E4M3, cuda::MlaKernel::kHopperWide}),
                         [](const ::testing::TestParamInfo<std::pair<DType, cuda::MlaKernel>>& info) {
                           const cuda::MlaKernel kernel = info.param.second;
                           return std::string(kernel_test::ShortName(info.param.first)) +
                                  (kernel == cuda::MlaKernel::kMmaSync      ? "_mma"
                                   : kernel == cuda::MlaKernel::kHopperWide ? "_wide"
                                                                            : "_auto");
                         });

// The wide-tile kernel's TMA loads (whole tiles in one page, pages of 64+ keys) against its
// cp.async loads: o and lse bitwise equal, and right. Chunks pinned mid-tile and a window make
// tiles of both kinds in one launch (a window moves a chunk's first key off the tile grid).
class MlaTmaTest : public ::testing::TestWithParam<MlaCase> {};

// Runs `c` with its plan as it is, then with `turn_off` applied to the case (the same plan, with
// `extra_units` placeholders): o and lse bitwise equal between the two, and the first right
// against the float64 reference. `what` names the two ways in a failure.
template <typename TurnOff>
void ExpectSameBitsWithout(const MlaCase& c, int extra_units, TurnOff turn_off, const char* what) {
  if (!KernelAvailable(c)) GTEST_SKIP() << "no " << CaseName(c) << " kernel on this device";
  MlaProblem problem = MakeProblem(c);
  auto plan = PlanFor(problem);
  ASSERT_TRUE(plan.ok()) << plan.status();
  MlaOutput on, off;
  ASSERT_TRUE(RunGpu(problem, *plan, &on, extra_units));
  turn_off(problem.config);
  ASSERT_TRUE(RunGpu(problem, *plan, &off, extra_units));
  EXPECT_EQ(on.o, off.o) << "o differs between " << what;
  EXPECT_EQ(std::memcmp(on.lse.data(), off.lse.data(), on.lse.size() * sizeof(float)), 0)
      << "lse differs between " << what;
  ExpectMatchesReference(problem, on, RunReference(problem));
}

TEST_P(MlaTmaTest, TmaLoadsMatchCopiesBitwise) {
  ATTND_SKIP_WITHOUT_GPU();
  ExpectSameBitsWithout(GetParam(), 0, [](MlaCase& c) { c.allow_tma = false; }, "TMA and cp.async loads");
}

std::vector<MlaCase> TmaCases() {
  std::vector<MlaCase> cases;
  MlaCase c;
  c.kernel = cuda::MlaKernel::kHopperWide;
  c.num_heads = 128;
  c.q_lens = {1, 2};
  c.lengths = {0, 1, 63, 64, 65, 300, 4100};
  c.seed = 1900;
  cases.push_back(c);  // page 64, auto split
  c.page_size = 128;
  c.separate_kv = true;
  c.fixed_split_tokens = 37;
  c.seed = 1901;
  cases.push_back(c);  // tiles across pages and past chunk ends
  c.q_dtype = DType::kFloat16;
  c.kv_dtype = DType::kFloat16;
  c.rank = 256;
  c.num_heads = 32;
  c.q_lens = {3};
  c.fixed_split_tokens = 0;
  c.window_left = 100;
  c.seed = 1902;
  cases.push_back(c);
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Tma, MlaTmaTest, ::testing::ValuesIn(TmaCases()),
                         [](const ::testing::TestParamInfo<MlaCase>& info) { return CaseName(info.param); });

// The wide-tile kernel in clusters of two (128+ heads: the CTA pairs of a token's heads fetch each
// TMA tile once, into both) against each CTA loading its own tiles: o and lse bitwise equal, and
// right. Chunks pinned mid-tile give pairs tiles of both kinds, a window moves their first key,
// and placeholder units slipped into the plan leave pairs whose units differ (which must not
// share) next to pairs that do.
struct ClusterCase {
  MlaCase mla;
  int extra_units = 0;  // placeholder units inserted into the plan (an even count keeps clusters)
};

void PrintTo(const ClusterCase& c, std::ostream* os) {
  *os << CaseName(c.mla) << " + " << c.extra_units << " placeholder units";
}

class MlaClusterTest : public ::testing::TestWithParam<ClusterCase> {};

TEST_P(MlaClusterTest, SharedTilesMatchOwnLoadsBitwise) {
  ATTND_SKIP_WITHOUT_GPU();
  ExpectSameBitsWithout(GetParam().mla, GetParam().extra_units, [](MlaCase& c) { c.allow_cluster = false; },
                        "shared and own tiles");
}

std::vector<ClusterCase> ClusterCases() {
  std::vector<ClusterCase> cases;
  MlaCase c;
  c.kernel = cuda::MlaKernel::kHopperWide;
  c.num_heads = 128;
  c.q_lens = {1, 2};
  c.lengths = {0, 1, 63, 64, 65, 300, 4100, 9000};
  c.seed = 2100;
  cases.push_back({c});  // page 64, auto split
  c.page_size = 128;
  c.separate_kv = true;
  c.fixed_split_tokens = 37;
  c.seed = 2101;
  cases.push_back({c, 2});  // tiles across pages and past chunk ends; two placeholders
  c.q_dtype = DType::kFloat16;
  c.kv_dtype = DType::kFloat16;
  c.rank = 256;
  c.num_heads = 256;
  c.q_lens = {1, 3};
  c.fixed_split_tokens = 0;
  c.window_left = 100;
  c.seed = 2102;
  cases.push_back({c});
  c.rank = 512;
  c.num_heads = 128;
  c.q_dtype = DType::kBFloat16;
  c.kv_dtype = DType::kBFloat16;
  c.window_left = -1;
  c.soft_cap = 30.0f;
  c.page_size = 64;
  c.separate_kv = false;
  c.min_tokens_per_cta = 256;  // many chunks
  c.seed = 2103;
  cases.push_back({c, 4});
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Cluster, MlaClusterTest, ::testing::ValuesIn(ClusterCases()),
                         [](const ::testing::TestParamInfo<ClusterCase>& info) {
                           return CaseName(info.param.mla) + "_extra" + std::to_string(info.param.extra_units);
                         });

// A small sweep for compute-sanitizer (run with --gtest_filter='SanitizerMla*').
class SanitizerMlaTest : public ::testing::TestWithParam<MlaCase> {};

TEST_P(SanitizerMlaTest, MatchesReference) {
  ATTND_SKIP_WITHOUT_GPU();
  if (!KernelAvailable(GetParam())) GTEST_SKIP() << "no " << CaseName(GetParam()) << " kernel on this device";
  MlaProblem problem = MakeProblem(GetParam());
  MlaOutput gpu;
  ASSERT_TRUE(RunGpu(problem, &gpu));
  ExpectMatchesReference(problem, gpu, RunReference(problem));
}

std::vector<MlaCase> SanitizerCases() {
  std::vector<MlaCase> cases;
  uint32_t seed = 900;
  for (DType kv_dtype : {DType::kBFloat16, DType::kFloat8E4M3}) {
    for (int32_t rank : {512, 256}) {
      MlaCase c;
      c.kv_dtype = kv_dtype;
      c.rank = rank;
      c.num_heads = rank == 512 ? 128 : 16;
      c.q_lens = rank == 512 ? std::vector<int32_t>{1} : std::vector<int32_t>{2, 4};
      c.page_size = rank == 512 ? 64 : 32;
      c.separate_kv = rank == 256;
      c.mode = MlaSplitMode::kOversubscribe;
      c.min_tokens_per_cta = 64;
      c.lengths = {0, 1, 33, 100, 190};
      c.seed = seed++;
      cases.push_back(c);
      c.kernel = cuda::MlaKernel::kMmaSync;
      cases.push_back(c);
      c.kernel = cuda::MlaKernel::kHopperWide;
      cases.push_back(c);
    }
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Sanitizer, SanitizerMlaTest, ::testing::ValuesIn(SanitizerCases()),
                         [](const ::testing::TestParamInfo<MlaCase>& info) {
                           return CaseName(info.param);
                         });

TEST(MlaArgsTest, RejectsUnsupportedConfigs) {
  EXPECT_TRUE(cuda::MlaDecodeSupports({DType::kBFloat16, DType::kBFloat16, 512, 64}));
  EXPECT_TRUE(cuda::MlaDecodeSupports({DType::kFloat16, DType::kFloat8E4M3, 256, 64}));
  EXPECT_FALSE(cuda::MlaDecodeSupports({DType::kBFloat16, DType::kBFloat16, 384, 64}));
  EXPECT_FALSE(cuda::MlaDecodeSupports({DType::kBFloat16, DType::kBFloat16, 512, 32}));
  EXPECT_FALSE(cuda::MlaDecodeSupports({DType::kFloat8E4M3, DType::kBFloat16, 512, 64}));
  EXPECT_EQ(cuda::MlaDecodeWorkspaceBytes(0, 128, 512), 0);
  EXPECT_GE(cuda::MlaDecodeWorkspaceBytes(10, 128, 512), 10 * 128 * 512 * 4 + 10 * 128 * 4);
}

}  // namespace
}  // namespace attnd
