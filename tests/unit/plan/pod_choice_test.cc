// The CUDA backend's POD choice (plan/pod_choice.h): which steps run one fused launch.
#include "plan/pod_choice.h"

#include <cstdlib>

#include "gtest/gtest.h"

namespace attnd::plan {
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

TEST(PodChoiceTest, AutoPicksPodWhereTheSeparatePrefillIsNotTheHopperKernel) {
  // Measured on an H100 (pod_choice.h): against the tensor-core decode and the Hopper prefill
  // POD loses at every page size; against the mma.sync prefill it wins.
  auto shape = [](int32_t page_size, bool hopper) {
    PodStepShape mixed = Mixed(1, 128);
    mixed.page_size = page_size;
    mixed.hopper_prefill = hopper;
    return mixed;
  };
  EXPECT_FALSE(ChoosePod(PodMode::kAuto, shape(1, true)));
  EXPECT_FALSE(ChoosePod(PodMode::kAuto, shape(16, true)));
  EXPECT_FALSE(ChoosePod(PodMode::kAuto, shape(4, true)));
  EXPECT_TRUE(ChoosePod(PodMode::kAuto, shape(16, false)));
  EXPECT_TRUE(ChoosePod(PodMode::kAuto, shape(1, false)));
  // Never for unmixed or deterministic steps, whatever the rule says.
  PodStepShape decode_only = shape(1, false);
  decode_only.num_prefill_requests = 0;
  decode_only.num_prefill_rows = 0;
  EXPECT_FALSE(ChoosePod(PodMode::kAuto, decode_only));
  PodStepShape deterministic = shape(1, false);
  deterministic.deterministic = true;
  EXPECT_FALSE(ChoosePod(PodMode::kAuto, deterministic));
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
}  // namespace attnd::plan
