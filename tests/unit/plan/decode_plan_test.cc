#include "plan/decode_plan.h"

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace attnd::plan {
namespace {

using ::testing::ElementsAre;

std::vector<int32_t> DecodeRows(int32_t batch_size) {
  std::vector<int32_t> indptr(batch_size + 1);
  std::iota(indptr.begin(), indptr.end(), 0);
  return indptr;
}

DecodePlanOptions Options(int32_t num_kv_heads, int32_t ctas_per_wave) {
  DecodePlanOptions options;
  options.num_kv_heads = num_kv_heads;
  options.ctas_per_wave = ctas_per_wave;
  return options;
}

int64_t Ctas(const DecodePlan& plan, int32_t num_kv_heads) {
  return int64_t{plan.num_items()} * num_kv_heads;
}

// Every request's items tile its key range exactly, in order.
void ExpectCovers(const DecodePlan& plan, const std::vector<int64_t>& begins,
                  const std::vector<int64_t>& ends) {
  std::vector<int64_t> next = begins;
  for (int32_t i = 0; i < plan.num_items(); ++i) {
    const int32_t b = plan.item_request[i];
    EXPECT_EQ(plan.item_kv_begin[i], next[b]) << "item " << i;
    EXPECT_LE(plan.item_kv_begin[i], plan.item_kv_end[i]);
    next[b] = plan.item_kv_end[i];
  }
  EXPECT_EQ(next, ends);
}

TEST(PlanBatchDecodeTest, SplitsLongSequenceWhenBatchUnderfillsGpu) {
  const std::vector<int64_t> lengths = {32768};
  auto plan = PlanBatchDecode(DecodeRows(1), lengths, Options(8, 528));
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_TRUE(plan->split_kv);
  EXPECT_LE(Ctas(*plan, 8), 528);
  // The smallest chunk that fits: one granule less would need more CTAs than a wave.
  EXPECT_EQ(plan->kv_chunk_tokens % kChunkGranularityTokens, 0);
  const int64_t smaller = plan->kv_chunk_tokens - kChunkGranularityTokens;
  EXPECT_GT((32768 + smaller - 1) / smaller * 8, 528);
  EXPECT_EQ(plan->num_merge_rows(), 1);
  EXPECT_EQ(plan->num_partials, plan->num_items());
  ExpectCovers(*plan, {0}, {32768});
}

TEST(PlanBatchDecodeTest, DoesNotSplitWhenBatchFillsGpu) {
  const std::vector<int64_t> lengths(256, 1000);
  auto plan = PlanBatchDecode(DecodeRows(256), lengths, Options(8, 528));
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_FALSE(plan->split_kv);
  EXPECT_EQ(plan->num_items(), 256);
  EXPECT_EQ(plan->num_partials, 0);
  EXPECT_EQ(plan->num_merge_rows(), 0);
  for (int32_t p : plan->item_partial) EXPECT_EQ(p, -1);
}

TEST(PlanBatchDecodeTest, ChunkNeverBelowFloor) {
  const std::vector<int64_t> lengths = {1024};
  DecodePlanOptions options = Options(8, 100000);
  options.min_chunk_tokens = 128;
  auto plan = PlanBatchDecode(DecodeRows(1), lengths, options);
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->kv_chunk_tokens, 128);
  EXPECT_EQ(plan->num_items(), 8);
  auto default_floor = PlanBatchDecode(DecodeRows(1), lengths, Options(8, 100000));
  ASSERT_TRUE(default_floor.ok());
  EXPECT_EQ(default_floor->kv_chunk_tokens, DecodePlanOptions{}.min_chunk_tokens);
}

TEST(PlanBatchDecodeTest, SequenceShorterThanFloorIsOneChunk) {
  const std::vector<int64_t> lengths = {60, 1};
  auto plan = PlanBatchDecode(DecodeRows(2), lengths, Options(8, 100000));
  ASSERT_TRUE(plan.ok());
  EXPECT_FALSE(plan->split_kv);
  EXPECT_EQ(plan->num_items(), 2);
}

TEST(PlanBatchDecodeTest, FixedSplitPinsChunkInTokens) {
  DecodePlanOptions options = Options(8, 528);
  options.fixed_split_tokens = 1000;
  const std::vector<int64_t> lengths = {2500, 1000, 10};
  auto plan = PlanBatchDecode(DecodeRows(3), lengths, options);
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->kv_chunk_tokens, 1000);
  EXPECT_THAT(plan->item_kv_begin, ElementsAre(0, 1000, 2000, 0, 0));
  EXPECT_THAT(plan->item_kv_end, ElementsAre(1000, 2000, 2500, 1000, 10));
  EXPECT_THAT(plan->item_partial, ElementsAre(0, 1, 2, -1, -1));
  EXPECT_THAT(plan->merge_indptr, ElementsAre(0, 3));
  EXPECT_THAT(plan->merge_q_row, ElementsAre(0));
}

TEST(PlanBatchDecodeTest, DisableSplitKvGivesOneChunkPerRequest) {
  DecodePlanOptions options = Options(8, 528);
  options.disable_split_kv = true;
  const std::vector<int64_t> lengths = {32768, 7};
  auto plan = PlanBatchDecode(DecodeRows(2), lengths, options);
  ASSERT_TRUE(plan.ok());
  EXPECT_FALSE(plan->split_kv);
  EXPECT_THAT(plan->item_kv_end, ElementsAre(32768, 7));
}

TEST(PlanBatchDecodeTest, DeterministicChunkingDependsOnTheRequestAlone) {
  DecodePlanOptions options = Options(8, 528);
  options.deterministic = true;
  // The same 3000-token request alone, and at another position among other requests.
  auto alone = PlanBatchDecode(DecodeRows(1), std::vector<int64_t>{3000}, options);
  const std::vector<int64_t> crowd = {5, 100000, 3000, 64};
  auto crowded = PlanBatchDecode(DecodeRows(4), crowd, options);
  ASSERT_TRUE(alone.ok() && crowded.ok());
  std::vector<std::pair<int32_t, int32_t>> alone_chunks, crowded_chunks;
  for (int32_t i = 0; i < alone->num_items(); ++i)
    alone_chunks.emplace_back(alone->item_kv_begin[i], alone->item_kv_end[i]);
  for (int32_t i = 0; i < crowded->num_items(); ++i) {
    if (crowded->item_request[i] == 2)
      crowded_chunks.emplace_back(crowded->item_kv_begin[i], crowded->item_kv_end[i]);
  }
  EXPECT_EQ(alone_chunks, crowded_chunks);
  EXPECT_EQ(alone->kv_chunk_tokens, kDeterministicChunkTokens);
}

TEST(PlanBatchDecodeTest, PaddingSlotsGetNoWork) {
  const std::vector<int32_t> qo_indptr = {0, 1, 1, 2};  // request 1 is padding
  const std::vector<int64_t> lengths = {10, 0, 20};
  auto plan = PlanBatchDecode(qo_indptr, lengths, Options(2, 100));
  ASSERT_TRUE(plan.ok());
  EXPECT_THAT(plan->item_request, ElementsAre(0, 2));
  EXPECT_THAT(plan->item_q_row, ElementsAre(0, 1));
}

TEST(PlanBatchDecodeTest, EmptyRequestStillWritesItsRow) {
  const std::vector<int64_t> lengths = {0};
  auto plan = PlanBatchDecode(DecodeRows(1), lengths, Options(8, 528));
  ASSERT_TRUE(plan.ok());
  ASSERT_EQ(plan->num_items(), 1);
  EXPECT_EQ(plan->item_kv_begin[0], plan->item_kv_end[0]);
  EXPECT_EQ(plan->item_partial[0], -1);
}

TEST(PlanBatchDecodeTest, SlidingWindowReadsOnlyTheWindow) {
  DecodePlanOptions options = Options(8, 528);
  options.window_left = 255;
  const std::vector<int64_t> lengths = {10000, 100};
  auto plan = PlanBatchDecode(DecodeRows(2), lengths, options);
  ASSERT_TRUE(plan.ok());
  ExpectCovers(*plan, {10000 - 256, 0}, {10000, 100});
  EXPECT_EQ(plan->window_left, 255);
}

TEST(PlanBatchDecodeTest, BalancesMixedLengthsOverSeveralWaves) {
  // 64 requests of 1..8192 keys: one CTA per request already nearly fills a wave, but the
  // longest requests would then set the time. Chunks near the mean length balance the waves.
  std::vector<int64_t> lengths;
  for (int i = 0; i < 64; ++i) lengths.push_back(1 + (int64_t{i} * 7919) % 8192);
  auto plan = PlanBatchDecode(DecodeRows(64), lengths, Options(8, 660));
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->kv_chunk_tokens, 1024) << plan->DebugString();
  EXPECT_GT(Ctas(*plan, 8), 660);
  std::vector<int64_t> zeros(64, 0);
  ExpectCovers(*plan, zeros, lengths);
  // Partial slots are numbered in item order and merge rows list each split request once.
  int32_t next_slot = 0;
  for (int32_t p : plan->item_partial) {
    if (p >= 0) {
      EXPECT_EQ(p, next_slot++);
    }
  }
  EXPECT_EQ(next_slot, plan->num_partials);
  EXPECT_EQ(plan->merge_indptr.back(), plan->num_partials);
}

TEST(PlanBatchDecodeTest, CapsChunkForLongRequestsInFullBatches) {
  const std::vector<int64_t> lengths(256, 8192);
  auto plan = PlanBatchDecode(DecodeRows(256), lengths, Options(8, 528));
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->kv_chunk_tokens, 1024);
  EXPECT_EQ(plan->num_items(), 256 * 8);
  DecodePlanOptions uncapped = Options(8, 528);
  uncapped.max_chunk_tokens = 0;
  auto whole = PlanBatchDecode(DecodeRows(256), lengths, uncapped);
  ASSERT_TRUE(whole.ok());
  EXPECT_FALSE(whole->split_kv);
}

TEST(PlanBatchDecodeTest, SmallBatchStaysInOneWave) {
  const std::vector<int64_t> lengths(16, 4096);
  auto plan = PlanBatchDecode(DecodeRows(16), lengths, Options(8, 660));
  ASSERT_TRUE(plan.ok());
  EXPECT_TRUE(plan->split_kv);
  EXPECT_LE(Ctas(*plan, 8), 660);
  EXPECT_GT(Ctas(*plan, 8), 330);
}

TEST(PlanBatchDecodeTest, RejectsPrefillRowsAndBadOptions) {
  const std::vector<int32_t> prefill = {0, 3};
  EXPECT_EQ(PlanBatchDecode(prefill, std::vector<int64_t>{10}, Options(8, 528)).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(PlanBatchDecode(DecodeRows(1), std::vector<int64_t>{-1}, Options(8, 528))
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(PlanBatchDecode(DecodeRows(1), std::vector<int64_t>{10}, Options(8, 0)).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(PlanBatchDecode(DecodeRows(1), std::vector<int64_t>{10}, Options(0, 528)).status().code(),
            absl::StatusCode::kInvalidArgument);
}

DecodePlanOptions BothKernels(int32_t num_kv_heads) {
  DecodePlanOptions options = Options(num_kv_heads, 660);
  options.tensor_core_supported = true;
  options.tensor_core_ctas_per_wave = 264;
  return options;
}

TEST(PlanBatchDecodeTest, TensorCoresWhereTheCacheHasThemCudaCoresBelowAGivenFloor) {
  DecodePlanOptions options = BothKernels(8);
  auto large = PlanBatchDecode(DecodeRows(64), std::vector<int64_t>(64, 4096), options);
  ASSERT_TRUE(large.ok()) << large.status();
  EXPECT_EQ(large->kernel, DecodeKernel::kTensorCore);
  EXPECT_EQ(large->View(large->Pack().data()).kernel, DecodeKernel::kTensorCore);
  // Batch 1 of 4096 keys and batch 16 of 1024 (measured faster on tensor cores, issue 14).
  auto single = PlanBatchDecode(DecodeRows(1), std::vector<int64_t>{4096}, options);
  ASSERT_TRUE(single.ok());
  EXPECT_EQ(single->kernel, DecodeKernel::kTensorCore);
  auto short_kv = PlanBatchDecode(DecodeRows(16), std::vector<int64_t>(16, 1024), options);
  ASSERT_TRUE(short_kv.ok());
  EXPECT_EQ(short_kv->kernel, DecodeKernel::kTensorCore);
  // Short contexts too (measured faster on tensor cores from 1 x 512 keys up).
  auto tiny = PlanBatchDecode(DecodeRows(2), std::vector<int64_t>{100, 20}, options);
  ASSERT_TRUE(tiny.ok());
  EXPECT_EQ(tiny->kernel, DecodeKernel::kTensorCore);
  // A floor keeps batches with fewer keys in all on the CUDA-core kernel.
  options.tensor_core_min_total_kv_tokens = 4096;
  auto below = PlanBatchDecode(DecodeRows(2), std::vector<int64_t>{1000, 2000}, options);
  ASSERT_TRUE(below.ok());
  EXPECT_EQ(below->kernel, DecodeKernel::kCudaCore);
}

TEST(PlanBatchDecodeTest, ChunksBySizeOfTheChosenKernelsWave) {
  // One request of 8192 keys, 8 KV heads: the smallest chunk whose CTAs fit the wave.
  DecodePlanOptions options = BothKernels(8);
  options.kernel_choice = DecodeKernelChoice::kTensorCore;
  auto tensor = PlanBatchDecode(DecodeRows(1), std::vector<int64_t>{8192}, options);
  ASSERT_TRUE(tensor.ok()) << tensor.status();
  EXPECT_EQ(tensor->kernel, DecodeKernel::kTensorCore);
  EXPECT_LE(Ctas(*tensor, 8), 264);
  options.kernel_choice = DecodeKernelChoice::kCudaCore;
  auto cuda_core = PlanBatchDecode(DecodeRows(1), std::vector<int64_t>{8192}, options);
  ASSERT_TRUE(cuda_core.ok());
  EXPECT_EQ(cuda_core->kernel, DecodeKernel::kCudaCore);
  EXPECT_LE(Ctas(*cuda_core, 8), 660);
  EXPECT_GT(Ctas(*cuda_core, 8), 264);
  EXPECT_LT(cuda_core->kv_chunk_tokens, tensor->kv_chunk_tokens);
}

// The tensor-core kernel's chunks fill half its wave, at most 2048 keys; equal lengths that fill
// more than half of it unsplit take the chunk the wave model picks, at most 8192 (measured on an
// H100 and an H200, docs/benchmarks.md).
TEST(PlanBatchDecodeTest, TensorCoreChunksFillHalfItsWaveUpToTheirCap) {
  const DecodePlanOptions options = BothKernels(8);
  auto plan_of = [&](int32_t batch, int64_t keys) {
    auto plan = PlanBatchDecode(DecodeRows(batch), std::vector<int64_t>(batch, keys), options);
    EXPECT_TRUE(plan.ok()) << plan.status();
    EXPECT_EQ(plan->kernel, DecodeKernel::kTensorCore);
    return *plan;
  };
  const DecodePlan one_4096 = plan_of(1, 4096);
  EXPECT_EQ(one_4096.kv_chunk_tokens, 256);  // 16 chunks x 8 heads = 128 CTAs <= 264 / 2
  EXPECT_EQ(Ctas(one_4096, 8), 128);
  EXPECT_EQ(plan_of(1, 8192).kv_chunk_tokens, 512);
  EXPECT_EQ(plan_of(16, 1024).kv_chunk_tokens, 1024);  // no split: 128 CTAs already
  EXPECT_EQ(plan_of(16, 4096).kv_chunk_tokens, 2048);  // the cap (no split would fit)
  // Equal lengths filling more than half the wave unsplit: as few pieces as the wave's
  // quantisation allows, at most the uniform cap (8192). 64 x 4096: 512 CTAs, 1.94 waves.
  EXPECT_EQ(plan_of(64, 4096).kv_chunk_tokens, 4096);
  EXPECT_EQ(plan_of(256, 32768).kv_chunk_tokens, 8192);
  EXPECT_EQ(plan_of(128, 4096).kv_chunk_tokens, 4096);  // 3.88 waves
  // 48 x 4096: 384 CTAs would leave the second wave 45% full; halves make 2.9 waves.
  EXPECT_EQ(plan_of(48, 4096).kv_chunk_tokens, 2048);
  // 40 x 4096: 320 CTAs (1.21 waves); quarters make 4.85.
  EXPECT_EQ(plan_of(40, 4096).kv_chunk_tokens, 1024);
  // Short keys are not cut below the floor (64): 128 x 65 stays whole.
  EXPECT_EQ(plan_of(128, 65).kv_chunk_tokens, 65);
  // A wider wave (the fp8 kernel's 396 CTAs): 64 x 4096 is 1.29 waves unsplit, 2.59 in halves;
  // 48 x 4096 fits one wave whole.
  DecodePlanOptions wide = options;
  wide.tensor_core_ctas_per_wave = 396;
  auto wide_plan = [&](int32_t batch) {
    auto plan = PlanBatchDecode(DecodeRows(batch), std::vector<int64_t>(batch, 4096), wide);
    EXPECT_TRUE(plan.ok()) << plan.status();
    return plan->kv_chunk_tokens;
  };
  EXPECT_EQ(wide_plan(64), 2048);
  EXPECT_EQ(wide_plan(48), 4096);
  // Smaller batches of long equal lengths fill the wave in pieces of 1024+ keys: 8 x 4096 in 256
  // CTAs of 1024, not 128 of 2048 (the search's half wave); with 4 KV heads 16 x 4096 the same.
  EXPECT_EQ(plan_of(8, 4096).kv_chunk_tokens, 1024);
  DecodePlanOptions four_heads = BothKernels(4);
  auto four = PlanBatchDecode(DecodeRows(16), std::vector<int64_t>(16, 4096), four_heads);
  ASSERT_TRUE(four.ok());
  EXPECT_EQ(four->kv_chunk_tokens, 1024);
  // ... and where no piece of 1024+ helps, the search's choice stands (16 x 1024 whole, above;
  // 8 x 256 in chunks of 128).
  EXPECT_EQ(plan_of(8, 256).kv_chunk_tokens, 128);
  // Mixed lengths keep 2048, for balance.
  std::vector<int64_t> mixed;
  for (int b = 0; b < 64; ++b) mixed.push_back(1 + (b * 127) % 8192);
  auto mixed_plan = PlanBatchDecode(DecodeRows(64), mixed, options);
  ASSERT_TRUE(mixed_plan.ok());
  EXPECT_EQ(mixed_plan->kv_chunk_tokens, 2048);
  // The CUDA-core kernel keeps its own cap.
  DecodePlanOptions cuda_core = options;
  cuda_core.kernel_choice = DecodeKernelChoice::kCudaCore;
  auto long_cc = PlanBatchDecode(DecodeRows(64), std::vector<int64_t>(64, 4096), cuda_core);
  ASSERT_TRUE(long_cc.ok());
  EXPECT_EQ(long_cc->kv_chunk_tokens, 1024);
}

TEST(PlanBatchDecodeTest, KernelChoiceFollowsWhatTheCacheHas) {
  DecodePlanOptions options = BothKernels(2);
  // Deterministic plans keep one kernel whatever the batch: the CUDA-core one.
  options.deterministic = true;
  auto deterministic = PlanBatchDecode(DecodeRows(64), std::vector<int64_t>(64, 4096), options);
  ASSERT_TRUE(deterministic.ok());
  EXPECT_EQ(deterministic->kernel, DecodeKernel::kCudaCore);
  // Only tensor cores (group 16): every batch, deterministic or not, goes there.
  options.cuda_core_supported = false;
  options.ctas_per_wave = 0;
  auto only_tensor = PlanBatchDecode(DecodeRows(1), std::vector<int64_t>{100}, options);
  ASSERT_TRUE(only_tensor.ok()) << only_tensor.status();
  EXPECT_EQ(only_tensor->kernel, DecodeKernel::kTensorCore);
  // A forced kernel the cache lacks, or no kernel at all, is refused.
  options.kernel_choice = DecodeKernelChoice::kCudaCore;
  EXPECT_EQ(PlanBatchDecode(DecodeRows(1), std::vector<int64_t>{100}, options).status().code(),
            absl::StatusCode::kInvalidArgument);
  DecodePlanOptions cuda_only = Options(2, 100);
  cuda_only.kernel_choice = DecodeKernelChoice::kTensorCore;
  EXPECT_EQ(PlanBatchDecode(DecodeRows(1), std::vector<int64_t>{100}, cuda_only).status().code(),
            absl::StatusCode::kInvalidArgument);
  cuda_only.kernel_choice = DecodeKernelChoice::kAuto;
  cuda_only.cuda_core_supported = false;
  EXPECT_FALSE(PlanBatchDecode(DecodeRows(1), std::vector<int64_t>{100}, cuda_only).ok());
  // The chosen kernel's wave must be known unless the chunk is pinned.
  DecodePlanOptions no_wave = BothKernels(2);
  no_wave.tensor_core_ctas_per_wave = 0;
  no_wave.kernel_choice = DecodeKernelChoice::kTensorCore;
  EXPECT_FALSE(PlanBatchDecode(DecodeRows(1), std::vector<int64_t>{100}, no_wave).ok());
  no_wave.disable_split_kv = true;
  EXPECT_TRUE(PlanBatchDecode(DecodeRows(1), std::vector<int64_t>{100}, no_wave).ok());
}

TEST(PlanBatchDecodeTest, PackAndViewAgree) {
  DecodePlanOptions options = Options(8, 528);
  options.fixed_split_tokens = 100;
  auto plan = PlanBatchDecode(DecodeRows(2), std::vector<int64_t>{250, 50}, options);
  ASSERT_TRUE(plan.ok());
  const std::vector<int32_t> packed = plan->Pack();
  const DecodeWorkView view = plan->View(packed.data());
  ASSERT_EQ(view.num_items, plan->num_items());
  for (int32_t i = 0; i < view.num_items; ++i) {
    EXPECT_EQ(view.item_request[i], plan->item_request[i]);
    EXPECT_EQ(view.item_q_row[i], plan->item_q_row[i]);
    EXPECT_EQ(view.item_kv_begin[i], plan->item_kv_begin[i]);
    EXPECT_EQ(view.item_kv_end[i], plan->item_kv_end[i]);
    EXPECT_EQ(view.item_partial[i], plan->item_partial[i]);
  }
  ASSERT_EQ(view.num_merge_rows, 1);
  EXPECT_EQ(view.merge_indptr[0], 0);
  EXPECT_EQ(view.merge_indptr[1], 3);
  EXPECT_EQ(view.merge_q_row[0], 0);
  EXPECT_EQ(view.num_partials, 3);
  EXPECT_EQ(static_cast<size_t>(view.merge_q_row + 1 - packed.data()), packed.size());
}

// Parts cover the rows, items and merge rows exactly once, in order, and each part's items and
// merges are those of its rows (split requests' partials merge inside their own part).
TEST(SplitDecodePlanByRowsTest, PartsTileRowsItemsAndMerges) {
  DecodePlanOptions options = Options(8, 528);
  options.fixed_split_tokens = 100;
  const std::vector<int32_t> qo_indptr = {0, 1, 2, 2, 3, 4, 5};  // request 2 is padding
  const std::vector<int64_t> lengths = {250, 50, 0, 420, 10, 130};
  auto plan = PlanBatchDecode(qo_indptr, lengths, options);
  ASSERT_TRUE(plan.ok()) << plan.status();
  for (int32_t parts : {1, 2, 3, 5, 9}) {
    const std::vector<DecodePlanPart> split = SplitDecodePlanByRows(*plan, 5, parts);
    ASSERT_EQ(split.size(), static_cast<size_t>(std::min(parts, 5))) << parts;
    int64_t row = 0;
    int32_t item = 0;
    int32_t merge = 0;
    for (const DecodePlanPart& part : split) {
      EXPECT_EQ(part.row_begin, row);
      EXPECT_EQ(part.item_begin, item);
      EXPECT_EQ(part.merge_begin, merge);
      EXPECT_LT(part.row_begin, part.row_end) << "no empty part";
      for (int32_t i = part.item_begin; i < part.item_end; ++i) {
        EXPECT_GE(plan->item_q_row[i], part.row_begin);
        EXPECT_LT(plan->item_q_row[i], part.row_end);
      }
      for (int32_t m = part.merge_begin; m < part.merge_end; ++m) {
        EXPECT_GE(plan->merge_q_row[m], part.row_begin);
        EXPECT_LT(plan->merge_q_row[m], part.row_end);
        // The merged slots are written by this part's items.
        for (int32_t slot = plan->merge_indptr[m]; slot < plan->merge_indptr[m + 1]; ++slot) {
          const auto writer = std::find(plan->item_partial.begin(), plan->item_partial.end(), slot);
          ASSERT_NE(writer, plan->item_partial.end());
          const int32_t index = static_cast<int32_t>(writer - plan->item_partial.begin());
          EXPECT_GE(index, part.item_begin);
          EXPECT_LT(index, part.item_end);
        }
      }
      row = part.row_end;
      item = part.item_end;
      merge = part.merge_end;
    }
    EXPECT_EQ(row, 5);
    EXPECT_EQ(item, plan->num_items());
    EXPECT_EQ(merge, plan->num_merge_rows());
  }
  EXPECT_EQ(SplitDecodePlanByRows(*plan, 5, 0).size(), 1u);
}

TEST(SplitDecodePlanByRowsTest, SlicedViewsPointAtTheirItems) {
  DecodePlanOptions options = Options(8, 528);
  options.fixed_split_tokens = 100;
  auto plan = PlanBatchDecode(DecodeRows(3), std::vector<int64_t>{250, 50, 330}, options);
  ASSERT_TRUE(plan.ok());
  const std::vector<int32_t> packed = plan->Pack();
  const DecodeWorkView view = plan->View(packed.data());
  const std::vector<DecodePlanPart> split = SplitDecodePlanByRows(*plan, 3, 2);
  ASSERT_EQ(split.size(), 2u);
  const DecodePlanPart& second = split[1];
  const DecodeWorkView slice = SliceDecodeWork(view, second.item_begin, second.item_end,
                                               second.merge_begin, second.merge_end);
  ASSERT_EQ(slice.num_items, second.item_end - second.item_begin);
  for (int32_t i = 0; i < slice.num_items; ++i) {
    EXPECT_EQ(slice.item_q_row[i], plan->item_q_row[second.item_begin + i]);
    EXPECT_EQ(slice.item_kv_end[i], plan->item_kv_end[second.item_begin + i]);
    EXPECT_EQ(slice.item_partial[i], plan->item_partial[second.item_begin + i]);
  }
  ASSERT_EQ(slice.num_merge_rows, second.merge_end - second.merge_begin);
  EXPECT_EQ(slice.merge_q_row[slice.num_merge_rows - 1], 2);
  EXPECT_EQ(slice.merge_indptr[slice.num_merge_rows], plan->num_partials);
  EXPECT_EQ(slice.num_partials, plan->num_partials);
}

}  // namespace
}  // namespace attnd::plan
