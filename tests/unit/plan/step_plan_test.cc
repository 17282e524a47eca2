// The CUDA backend's step-level kernel choice (plan/step_plan.h): which kernels run which rows
// of a step, and the uploaded arrays. Plain C++: runs without a GPU.
#include "plan/step_plan.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <map>
#include <memory>
#include <set>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "step_batch_test_util.h"

namespace attnd {
namespace {

using testing::MlaCacheConfig;
using testing::MlaGeometryOf;
using testing::MlaOptions;
using testing::SequenceBook;

// ---- MLA caches ----

struct MlaPlanCheck {
  int64_t units = 0;
  int64_t split_requests = 0;
};

// Checks the plan of an MLA step against the batch: every (token, head) row of every request
// is computed over every key exactly once, units name the step's rows, requests of more than
// kMlaSplitMaxQueryTokens rows are never split, and each split row merges exactly its chunks'
// partials, into its own row.
MlaPlanCheck CheckMlaPlan(const StepBatch& batch, const CacheGeometry& g,
                          const plan::StepPlan& step) {
  MlaPlanCheck check;
  const plan::MlaPlan& mla = step.mla;
  const int32_t heads = g.num_qo_heads;
  // [request] -> per row tile -> covered key ranges.
  std::map<std::pair<int32_t, int32_t>, std::vector<std::pair<int32_t, int32_t>>> ranges;
  std::map<int32_t, int32_t> row_of_slot;  // partial slot -> step row
  for (const plan::MlaWorkUnit& unit : mla.units) {
    ++check.units;
    EXPECT_GE(unit.request, 0);
    const int32_t b = unit.request;
    const int32_t rows = batch.qo_indptr[b + 1] - batch.qo_indptr[b];
    EXPECT_EQ(unit.q_row, batch.qo_indptr[b]);
    EXPECT_EQ(unit.q_len, rows);
    EXPECT_EQ(unit.kv_len, batch.KvLength(b, g.page_size));
    EXPECT_EQ(unit.row_begin % plan::kMlaRowsPerCta, 0);
    EXPECT_LT(unit.row_begin, rows * heads);
    ranges[{b, unit.row_begin}].push_back({unit.kv_begin, unit.kv_end});
    if (rows > plan::kMlaSplitMaxQueryTokens) {
      EXPECT_EQ(unit.partial_first, -1) << "a prefill request was split";
    }
    if (unit.partial_first >= 0) {
      const int32_t row_end = std::min(unit.row_begin + plan::kMlaRowsPerCta, rows * heads);
      for (int32_t t = unit.row_begin / heads; t <= (row_end - 1) / heads; ++t) {
        const int32_t slot = unit.partial_first + t * unit.partial_stride;
        EXPECT_LT(slot, mla.num_partials);
        const auto [it, inserted] = row_of_slot.emplace(slot, unit.q_row + t);
        if (!inserted) {
          EXPECT_EQ(it->second, unit.q_row + t) << "slot " << slot;
        }
      }
    }
  }
  for (int32_t b = 0; b < batch.batch_size; ++b) {
    const int32_t rows = batch.qo_indptr[b + 1] - batch.qo_indptr[b];
    const int32_t kv_len = static_cast<int32_t>(batch.KvLength(b, g.page_size));
    for (int32_t row = 0; row < rows * heads; row += plan::kMlaRowsPerCta) {
      auto covered = ranges[{b, row}];
      ranges.erase({b, row});
      std::sort(covered.begin(), covered.end());
      EXPECT_FALSE(covered.empty()) << "request " << b << " row tile " << row << " has no unit";
      int32_t next = 0;
      for (const auto& [begin, end] : covered) {
        EXPECT_EQ(begin, next) << "request " << b << " row tile " << row;
        next = end;
      }
      EXPECT_EQ(next, kv_len) << "request " << b;
      if (row == 0 && covered.size() > 1) ++check.split_requests;
    }
  }
  EXPECT_TRUE(ranges.empty()) << "units outside the requests' rows";
  EXPECT_EQ(mla.merge_indptr.size(), mla.merge_q_row.size() + 1);
  if (mla.merge_indptr.size() != mla.merge_q_row.size() + 1) return check;
  std::set<int32_t> merged_rows;
  for (size_t r = 0; r < mla.merge_q_row.size(); ++r) {
    EXPECT_TRUE(merged_rows.insert(mla.merge_q_row[r]).second) << "row merged twice";
    EXPECT_GT(mla.merge_indptr[r + 1] - mla.merge_indptr[r], 1);
    for (int32_t slot = mla.merge_indptr[r]; slot < mla.merge_indptr[r + 1]; ++slot) {
      EXPECT_EQ(row_of_slot[slot], mla.merge_q_row[r]) << "slot " << slot;
    }
  }
  EXPECT_EQ(static_cast<int32_t>(row_of_slot.size()), mla.num_partials);
  return check;
}

plan::StepPlanContext MlaContext(const CacheGeometry& g) {
  plan::StepPlanContext context;
  context.geometry = &g;
  context.mla_ctas_per_wave = 132;  // an H100's SMs, one CTA each
  return context;
}

TEST(MlaStepPlanTest, CoversEveryRowOnceAndNeverSplitsPrefillRows) {
  MlaCacheConfig config;
  config.num_heads = 24;  // row tiles that cut tokens
  config.page_size = 32;
  const CacheGeometry g = MlaGeometryOf(config);
  const plan::StepPlanContext context = MlaContext(g);
  SequenceBook book(g, /*separate_kv=*/true, /*seed=*/3);
  StepOptions options = MlaOptions(g);
  const std::vector<std::vector<std::pair<int, int32_t>>> steps = {
      {{0, 300}, {1, 7}, {2, 64}, {3, 5}},
      {{0, 1}, {9, 0}, {1, 3}, {2, 40}, {3, 4}, {4, 2}, {9, 0}},
  };
  for (const auto& entries : steps) book.Plan(entries, options);
  options.fixed_split_tokens = 8;
  const auto batch = book.Plan({{0, 1}, {9, 0}, {1, 4}, {2, 33}, {3, 2}, {4, 6}, {5, 1}}, options);
  auto step = plan::PlanStep(*batch, context);
  ASSERT_TRUE(step.ok()) << step.status();
  EXPECT_TRUE(step->run_mla);
  EXPECT_FALSE(step->run_decode || step->run_prefill);
  EXPECT_EQ(step->KernelName(), "mla_prefill");
  const MlaPlanCheck check = CheckMlaPlan(*batch, g, *step);
  EXPECT_GE(check.split_requests, 3) << step->mla.DebugString();
  EXPECT_GT(step->mla.num_merge_rows(), 0);

  // The arrays: the packed plan at a 16-byte aligned offset inside the uploaded buffer.
  EXPECT_EQ(step->offsets.mla_work % 16, 0);
  std::vector<uint8_t> buffer(step->offsets.total_bytes);
  step->Fill(*batch, buffer.data());
  const std::vector<int32_t> packed = step->mla.Pack();
  ASSERT_LE(step->offsets.mla_work + static_cast<int64_t>(packed.size() * sizeof(int32_t)),
            step->offsets.total_bytes);
  EXPECT_EQ(std::memcmp(buffer.data() + step->offsets.mla_work, packed.data(),
                        packed.size() * sizeof(int32_t)),
            0);

  // Decode-only and automatic split; all padding.
  options = MlaOptions(g);
  const auto decode = book.Plan({{0, 1}, {1, 1}, {9, 0}, {2, 1}}, options);
  step = plan::PlanStep(*decode, context);
  ASSERT_TRUE(step.ok()) << step.status();
  EXPECT_EQ(step->KernelName(), "mla_decode");
  CheckMlaPlan(*decode, g, *step);
  const auto padding = book.Plan({{9, 0}}, options);
  step = plan::PlanStep(*padding, context);
  ASSERT_TRUE(step.ok()) << step.status();
  EXPECT_FALSE(step->run_mla);
  EXPECT_EQ(step->KernelName(), "none");
}

// Deterministic mode: a request's units (its chunking) are the same whatever else is in the
// batch, so its reduction order is too.
TEST(MlaStepPlanTest, DeterministicChunkingDependsOnTheRequestAlone) {
  MlaCacheConfig config;
  config.num_heads = 128;
  CacheGeometry g = MlaGeometryOf(config);
  g.num_pages = 256;  // sequences of 5000 and 3000 keys: 127 pages of 64 tokens
  const plan::StepPlanContext context = MlaContext(g);
  StepOptions options = MlaOptions(g);
  options.deterministic = true;
  auto units_of = [&](const StepBatch& batch, const plan::StepPlan& step, int32_t b) {
    std::vector<std::array<int32_t, 5>> units;
    for (const plan::MlaWorkUnit& u : step.mla.units) {
      if (u.request != b) continue;
      units.push_back({u.row_begin, u.kv_begin, u.kv_end, u.partial_stride,
                       u.partial_first >= 0 ? 1 : 0});
    }
    std::sort(units.begin(), units.end());
    (void)batch;
    return units;
  };
  // Sequence 0 reaches 5000 keys (three 2048-token chunks) in both books.
  SequenceBook alone(g, false, 5);
  SequenceBook crowded(g, false, 6);
  alone.Plan({{0, 4999}}, options);
  crowded.Plan({{1, 3000}, {0, 4999}, {2, 9}}, options);
  const auto a = alone.Plan({{0, 1}}, options);
  const auto b = crowded.Plan({{1, 1}, {9, 0}, {2, 30}, {0, 1}}, options);
  auto step_a = plan::PlanStep(*a, context);
  auto step_b = plan::PlanStep(*b, context);
  ASSERT_TRUE(step_a.ok() && step_b.ok());
  CheckMlaPlan(*a, g, *step_a);
  CheckMlaPlan(*b, g, *step_b);
  const auto units_a = units_of(*a, *step_a, 0);
  EXPECT_EQ(units_a.size(), 3u * 2u) << "three chunks of two row tiles";
  EXPECT_EQ(units_a, units_of(*b, *step_b, 3));
}

// ---- POD and side by side ----

// PERFORMANCE.md's standard shape (Hq 32, Hkv 8, D 128, page 16), one layer.
CacheGeometry StandardGeometry(int64_t num_pages) {
  CacheGeometry g;
  g.num_layers = 1;
  g.num_qo_heads = 32;
  g.num_kv_heads = 8;
  g.k_head_dim = g.v_head_dim = 128;
  g.page_size = 16;
  g.num_pages = num_pages;
  return g;
}

TEST(PodStepPlanTest, MixedStepsRunPodOnlyWhenTheModeAndOptionsSaySo) {
  const CacheGeometry g = StandardGeometry(4096);
  SequenceBook book(g, /*separate_kv=*/false, /*seed=*/3);
  StepOptions options;
  options.params.sm_scale = 0.1f;
  book.Plan({{0, 10}, {1, 10}, {2, 10}}, options);
  const std::shared_ptr<StepBatch> mixed = book.Plan({{0, 1}, {5, 0}, {1, 1}, {3, 600}, {2, 1}}, options);
  plan::StepPlanContext context;
  context.geometry = &g;
  context.decode_supported = true;
  context.decode_ctas_per_wave = 528;
  context.prefill_ctas_per_wave = {396, 396, 396, 132, 264};
  context.pod_ctas_per_wave = {396, 396};

  context.pod_mode = plan::PodMode::kOn;
  auto on = plan::PlanStep(*mixed, context);
  ASSERT_TRUE(on.ok()) << on.status();
  EXPECT_TRUE(on->run_pod);
  EXPECT_FALSE(on->run_decode || on->run_prefill);
  EXPECT_EQ(on->KernelName(), "pod");
  ASSERT_TRUE(on->pod.fused());
  EXPECT_EQ(on->pod.DecodeRoleCtas(), 3 * 8);  // 3 decodes x 8 KV heads: 11 keys are never split

  context.pod_mode = plan::PodMode::kOff;
  auto off = plan::PlanStep(*mixed, context);
  ASSERT_TRUE(off.ok());
  EXPECT_FALSE(off->run_pod);
  EXPECT_TRUE(off->run_decode && off->run_prefill);

  context.pod_mode = plan::PodMode::kOn;
  StepOptions deterministic = options;
  deterministic.deterministic = true;
  StepBatch deterministic_batch = *mixed;
  deterministic_batch.options = deterministic;
  auto kept = plan::PlanStep(deterministic_batch, context);
  ASSERT_TRUE(kept.ok());
  EXPECT_FALSE(kept->run_pod);

  const std::shared_ptr<StepBatch> decode_only = book.Plan({{0, 1}, {1, 1}}, options);
  auto decode = plan::PlanStep(*decode_only, context);
  ASSERT_TRUE(decode.ok());
  EXPECT_FALSE(decode->run_pod);
  EXPECT_EQ(decode->KernelName(), "decode");
}

// A mixed step whose prefill runs the Hopper kernel: side by side with its decode when the
// prefill is small beside the decode's KV (kSideBySideMaxFlopsPerByte), over ~42.5% of the Hopper
// wave where the prefill is under a fifth of the estimated time and ~55% above; one after the
// other when the prefill dominates, and never without a Hopper launch.
TEST(SideBySideStepPlanTest, MixedHopperStepsRunSideBySideWhenTheDecodeDominates) {
  const CacheGeometry g = StandardGeometry(1 << 16);
  SequenceBook book(g, /*separate_kv=*/false, /*seed=*/5);
  StepOptions options;
  options.params.sm_scale = 0.1f;
  options.params.causal = true;
  std::vector<std::pair<int, int32_t>> prompts;
  for (int s = 0; s < 64; ++s) prompts.push_back({s, 2048});
  book.Plan(prompts, options);
  plan::StepPlanContext context;
  context.geometry = &g;
  context.decode_supported = true;
  context.decode_ctas_per_wave = 528;
  context.prefill_ctas_per_wave = {396, 396, 264, 132, 132};  // hopper_tile128 = 132
  context.pod_mode = plan::PodMode::kAuto;

  // 64 decodes of 2049 keys (537 MB of KV) beside a 1024-token prompt (8.6 GFLOP, ~7% of the
  // estimated time): side by side, the prefill over 0.425 x 132 CTAs.
  std::vector<std::pair<int, int32_t>> entries;
  for (int s = 0; s < 64; ++s) entries.push_back({s, 1});
  entries.push_back({100, 1024});
  const std::shared_ptr<StepBatch> mixed = book.Plan(entries, options);
  auto side = plan::PlanStep(*mixed, context);
  ASSERT_TRUE(side.ok()) << side.status();
  EXPECT_FALSE(side->run_pod);  // auto: the Hopper prefill runs beside the decode instead
  EXPECT_TRUE(side->run_decode && side->run_prefill);
  EXPECT_EQ(side->side_by_side_prefill_ctas, 56);  // 0.425 x 132, rounded
  EXPECT_EQ(side->side_by_side_tail_ctas, 132 - 56);  // the rest of the wave, after the decode

  // 11 decodes of 2049 keys (92 MB) beside the 1024-token prompt (~30%): 0.55 x 132.
  std::vector<std::pair<int, int32_t>> larger;
  for (int s = 0; s < 11; ++s) larger.push_back({s, 1});
  larger.push_back({103, 1024});
  auto larger_side = plan::PlanStep(*book.Plan(larger, options), context);
  ASSERT_TRUE(larger_side.ok()) << larger_side.status();
  EXPECT_EQ(larger_side->side_by_side_prefill_ctas, 73);
  // The prefill is planned for its share: its items laid out for 56 CTAs.
  bool hopper_launch = false;
  for (const plan::PrefillLaunch& launch : side->prefill.launches) {
    if (launch.kernel == plan::PrefillKernel::kHopper) {
      hopper_launch = true;
      EXPECT_EQ(launch.grid_ctas, 56);
      EXPECT_EQ(launch.balanced_grid, std::min<int64_t>(56, launch.NumCtas(side->prefill.num_kv_heads)));
    }
  }
  EXPECT_TRUE(hopper_launch);

  // One decode beside an 8192-token prompt: the prefill dominates, one after the other.
  const std::shared_ptr<StepBatch> heavy = book.Plan({{0, 1}, {101, 8192}}, options);
  auto sequential = plan::PlanStep(*heavy, context);
  ASSERT_TRUE(sequential.ok());
  EXPECT_TRUE(sequential->run_decode && sequential->run_prefill);
  EXPECT_EQ(sequential->side_by_side_prefill_ctas, 0);
  EXPECT_EQ(sequential->side_by_side_tail_ctas, 0);

  // Without the Hopper kernel (no Hopper wave), POD takes the mixed step instead.
  context.prefill_ctas_per_wave.hopper_tile128 = 0;
  context.pod_ctas_per_wave = {396, 396};
  auto pod = plan::PlanStep(*book.Plan({{1, 1}, {102, 600}}, options), context);
  ASSERT_TRUE(pod.ok());
  EXPECT_EQ(pod->side_by_side_prefill_ctas, 0);

  // The estimate itself: no prefill rows, or no Hopper wave, gives 0.
  EXPECT_EQ(plan::SideBySidePrefillCtas(*book.Plan({{2, 1}}, options), g, 132), 0);
  EXPECT_EQ(plan::SideBySidePrefillCtas(*mixed, g, 0), 0);
}

}  // namespace
}  // namespace attnd
