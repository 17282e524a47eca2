// The POD planner (plan/pod_plan.h) and the POD kernel's role rule (plan/pod_schedule.h).
#include "plan/pod_plan.h"

#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "plan/pod_schedule.h"
#include "plan/prefill_plan.h"

namespace attnd {
namespace {

plan::PrefillPlanInput Input(std::span<const int32_t> qo_indptr, std::span<const int32_t> kv_lengths,
                             int32_t num_qo_heads, int32_t num_kv_heads) {
  plan::PrefillPlanInput input;
  input.qo_indptr = qo_indptr;
  input.kv_lengths = kv_lengths;
  input.num_qo_heads = num_qo_heads;
  input.num_kv_heads = num_kv_heads;
  input.head_dim = 128;
  // An H100-like device: 132 SMs, 3 CTAs of each tile per SM, Hopper available.
  input.ctas_per_wave = {396, 396, 396, 132, 264};
  return input;
}

TEST(PodPlanTest, FusesTheLargestTileWithTheDecodeTile) {
  // Group 4: a 600-token prefill (2400 rows, tile 128), a 10-token one (40 rows, tile 64),
  // three decodes (4 rows each, tile 16), a padding slot.
  const std::vector<int32_t> qo_indptr = {0, 1, 601, 602, 602, 612, 613};
  const std::vector<int32_t> kv_lengths = {50, 600, 3000, 9, 10, 70};
  auto pod = plan::PlanPod(Input(qo_indptr, kv_lengths, 32, 8));
  ASSERT_TRUE(pod.ok()) << pod.status();
  ASSERT_TRUE(pod->fused()) << pod->DebugString();
  EXPECT_EQ(pod->prefill_tile_rows(), 128);
  EXPECT_EQ(pod->prefill.launches[pod->decode_launch].tile_rows, 16);
  // Three decodes underfill the device: the 3000-key one is split, so more than 3 x 8 CTAs.
  EXPECT_GT(pod->DecodeRoleCtas(), 3 * 8);
  EXPECT_EQ(pod->num_colocated_ctas, pod->DecodeRoleCtas());
  EXPECT_EQ(pod->PrefillRoleCtas(), 19 * 8);  // ceil(2400 / 128) tiles, unsplit
  ASSERT_EQ(pod->prefill.launches.size(), 3u);  // the 64-row launch runs on its own
  for (const plan::PrefillLaunch& launch : pod->prefill.launches) {
    EXPECT_EQ(launch.kernel, plan::PrefillKernel::kMmaSync);  // POD never plans Hopper
  }
}

TEST(PodPlanTest, DoesNotFuseWithoutBothRoles) {
  const std::vector<int32_t> decode_indptr = {0, 1, 2};
  const std::vector<int32_t> decode_kv = {100, 200};
  auto pod = plan::PlanPod(Input(decode_indptr, decode_kv, 32, 8));
  ASSERT_TRUE(pod.ok());
  EXPECT_FALSE(pod->fused());
  const std::vector<int32_t> prefill_indptr = {0, 300};
  const std::vector<int32_t> prefill_kv = {300};
  pod = plan::PlanPod(Input(prefill_indptr, prefill_kv, 32, 8));
  ASSERT_TRUE(pod.ok());
  EXPECT_FALSE(pod->fused());
  EXPECT_EQ(pod->prefill.launches.size(), 1u);
}

TEST(PodPlanTest, PrefillSplitsLessWhenDecodeCtasShareTheWave) {
  // One 256-token prefill (group 4: 8 tiles of 128 x 1 KV head = 8 CTAs) over 16k keys: alone
  // it splits to fill the wave; beside decode CTAs it has less of the wave to fill.
  std::vector<int32_t> qo_indptr = {0, 256};
  std::vector<int32_t> kv_lengths = {16384};
  for (int i = 0; i < 100; ++i) {
    qo_indptr.push_back(qo_indptr.back() + 1);
    kv_lengths.push_back(500);
  }
  const plan::PrefillPlanInput input = Input(qo_indptr, kv_lengths, 4, 1);
  plan::PrefillPlanInput mma = input;
  mma.kernel = plan::PrefillKernel::kMmaSync;
  auto alone = plan::PlanPrefill(mma);
  ASSERT_TRUE(alone.ok());
  auto pod = plan::PlanPod(input);
  ASSERT_TRUE(pod.ok());
  ASSERT_TRUE(pod->fused());
  EXPECT_EQ(pod->num_colocated_ctas, 100);
  ASSERT_GT(alone->request_chunk_tokens[0], 0);
  ASSERT_GT(pod->prefill.request_chunk_tokens[0], 0);
  EXPECT_GT(pod->prefill.request_chunk_tokens[0], alone->request_chunk_tokens[0]);
  EXPECT_LE(pod->PrefillRoleCtas() + pod->DecodeRoleCtas(), 396);

  // Deterministic: the request's chunk follows from the request alone, decodes or not.
  plan::PrefillPlanInput deterministic = mma;
  deterministic.deterministic = true;
  auto alone_det = plan::PlanPrefill(deterministic);
  auto pod_det = plan::PlanPod(deterministic, plan::PodWaveSizes{132, 132});
  ASSERT_TRUE(alone_det.ok() && pod_det.ok());
  EXPECT_EQ(pod_det->prefill.request_chunk_tokens, alone_det->request_chunk_tokens);
  EXPECT_EQ(pod_det->prefill.items.size(), alone_det->items.size());

  // More decode CTAs than the wave: clamped at zero, the prefill does not split.
  plan::PrefillPlanInput crowded = input;
  crowded.num_kv_heads = 1;
  crowded.ctas_per_wave = {90, 90, 90, 132, 0};
  auto pod_crowded = plan::PlanPod(crowded);
  ASSERT_TRUE(pod_crowded.ok());
  EXPECT_EQ(pod_crowded->prefill.request_chunk_tokens[0], 0);
}

TEST(PodPlanTest, UsesTheFusedKernelsWave) {
  std::vector<int32_t> qo_indptr = {0, 256, 257};
  std::vector<int32_t> kv_lengths = {16384, 100};
  auto small_wave = plan::PlanPod(Input(qo_indptr, kv_lengths, 4, 1), plan::PodWaveSizes{132, 132});
  auto large_wave = plan::PlanPod(Input(qo_indptr, kv_lengths, 4, 1), plan::PodWaveSizes{396, 396});
  ASSERT_TRUE(small_wave.ok() && large_wave.ok());
  EXPECT_GT(small_wave->prefill.request_chunk_tokens[0], large_wave->prefill.request_chunk_tokens[0]);
}

TEST(PodPlanTest, NegativeColocatedCtasAreRejected) {
  const std::vector<int32_t> qo_indptr = {0, 4};
  const std::vector<int32_t> kv_lengths = {4};
  plan::PrefillPlanInput input = Input(qo_indptr, kv_lengths, 8, 2);
  input.num_colocated_ctas = -1;
  EXPECT_FALSE(plan::PlanPrefill(input).ok());
}

TEST(PodScheduleTest, EverySmRunsBothRolesInTheGlobalRatio) {
  for (const auto& [prefill, decode] : std::vector<std::pair<int64_t, int64_t>>{
           {1, 1}, {1, 7}, {7, 1}, {512, 1024}, {64, 1024}, {1000, 3}, {0, 5}, {5, 0}}) {
    const int64_t total = prefill + decode;
    int64_t prefill_taken = 0;
    for (int64_t n = 0; n < total; ++n) {
      prefill_taken += plan::PodTakesPrefillRole(n, prefill, decode) ? 1 : 0;
      // After n + 1 CTAs on one SM the prefill count is ceil((n + 1) P / T): never more than
      // one CTA away from the global ratio, and the first CTA is a prefill one.
      EXPECT_EQ(prefill_taken, ((n + 1) * prefill + total - 1) / total) << prefill << ":" << decode << " at " << n;
    }
    EXPECT_EQ(prefill_taken, prefill);
    if (prefill > 0) {
      EXPECT_TRUE(plan::PodTakesPrefillRole(0, prefill, decode));
    }
  }
  EXPECT_FALSE(plan::PodTakesPrefillRole(0, 0, 0));
}

}  // namespace
}  // namespace attnd
