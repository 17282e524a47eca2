// The CUDA backend's POD choice (server/backend/pod_choice.h): which steps run one fused launch.
#include "backend/pod_choice.h"

#include <cstdlib>

#include "gtest/gtest.h"

namespace attnd::cuda_backend {
namespace {

PodStepShape Mixed(int32_t prefills, int32_t decodes) {
  PodStepShape shape;
  shape.num_prefill_requests = prefills;
  shape.num_decode_requests = decodes;
  shape.num_prefill_rows = int64_t{prefills} * 2048;
  return shape;
}

TEST(PodChoiceTest, OnlyMixedStepsRunPod) {
  EXPECT_TRUE(ChoosePod(PodMode::kOn, Mixed(1, 1)));
  EXPECT_TRUE(ChoosePod(PodMode::kOn, Mixed(8, 256)));
  EXPECT_FALSE(ChoosePod(PodMode::kOn, Mixed(0, 128)));  // decode only
  EXPECT_FALSE(ChoosePod(PodMode::kOn, Mixed(2, 0)));    // prefill only
  EXPECT_FALSE(ChoosePod(PodMode::kOn, Mixed(0, 0)));
}

TEST(PodChoiceTest, OffNeverAndDeterministicNeverRunPod) {
  EXPECT_FALSE(ChoosePod(PodMode::kOff, Mixed(1, 128)));
  PodStepShape deterministic = Mixed(1, 128);
  deterministic.deterministic = true;
  EXPECT_FALSE(ChoosePod(PodMode::kOn, deterministic));
  EXPECT_FALSE(ChoosePod(PodMode::kAuto, deterministic));
}

TEST(PodChoiceTest, AutoFollowsTheRule) {
  // The placeholder keeps POD off until the measured rule replaces it; whatever the rule, auto
  // agrees with it on mixed steps and never picks POD for unmixed ones.
  for (const PodStepShape& shape : {Mixed(1, 128), Mixed(2, 128), Mixed(8, 1), Mixed(1, 256)}) {
    EXPECT_EQ(ChoosePod(PodMode::kAuto, shape), PodAutoPicks(shape));
  }
  EXPECT_FALSE(ChoosePod(PodMode::kAuto, Mixed(0, 128)));
  EXPECT_FALSE(PodAutoPicks(Mixed(1, 128)));  // placeholder: off until measured
}

TEST(PodChoiceTest, AutoRuleWantsEnoughDecodesAndABoundedPrefill) {
  EXPECT_TRUE(PodAutoRule(Mixed(1, 128), 64, 8192));
  EXPECT_TRUE(PodAutoRule(Mixed(4, 64), 64, 8192));     // 4 x 2048 rows: at the bound
  EXPECT_FALSE(PodAutoRule(Mixed(1, 63), 64, 8192));    // too few decodes to hide
  EXPECT_FALSE(PodAutoRule(Mixed(5, 128), 64, 8192));   // the prefill dominates
  EXPECT_FALSE(PodAutoRule(Mixed(1, 128), 0, 8192));    // disabled
}

TEST(PodChoiceTest, ParsesTheModeAndTheEnvironment) {
  EXPECT_EQ(*ParsePodMode("auto"), PodMode::kAuto);
  EXPECT_EQ(*ParsePodMode("on"), PodMode::kOn);
  EXPECT_EQ(*ParsePodMode("off"), PodMode::kOff);
  EXPECT_EQ(ParsePodMode("yes").status().code(), absl::StatusCode::kInvalidArgument);
  ::unsetenv("ATTND_POD");
  EXPECT_EQ(*PodModeFromEnvironment(), PodMode::kAuto);
  ::setenv("ATTND_POD", "on", 1);
  EXPECT_EQ(*PodModeFromEnvironment(), PodMode::kOn);
  ::setenv("ATTND_POD", "sometimes", 1);
  EXPECT_FALSE(PodModeFromEnvironment().ok());
  ::unsetenv("ATTND_POD");
}

}  // namespace
}  // namespace attnd::cuda_backend
