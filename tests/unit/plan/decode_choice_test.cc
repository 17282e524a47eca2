#include "plan/decode_choice.h"

#include "gtest/gtest.h"

namespace attnd::plan {
namespace {

TEST(DecodeChoiceTest, ParsesTheThreeNamesAndRefusesOthersByName) {
  EXPECT_EQ(*ParseDecodeKernelChoice("auto"), DecodeKernelChoice::kAuto);
  EXPECT_EQ(*ParseDecodeKernelChoice("cuda_core"), DecodeKernelChoice::kCudaCore);
  EXPECT_EQ(*ParseDecodeKernelChoice("tensor_core"), DecodeKernelChoice::kTensorCore);
  const auto bad = ParseDecodeKernelChoice("tc");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(bad.status().message()).find("'tc'"), std::string::npos);
}

TEST(DecodeChoiceTest, AForcedKernelTheCacheLacksFallsBackToThePlannersChoice) {
  EXPECT_EQ(EffectiveDecodeKernelChoice(DecodeKernelChoice::kTensorCore, true, true),
            DecodeKernelChoice::kTensorCore);
  EXPECT_EQ(EffectiveDecodeKernelChoice(DecodeKernelChoice::kTensorCore, true, false),
            DecodeKernelChoice::kAuto);
  EXPECT_EQ(EffectiveDecodeKernelChoice(DecodeKernelChoice::kCudaCore, false, true),
            DecodeKernelChoice::kAuto);
  EXPECT_EQ(EffectiveDecodeKernelChoice(DecodeKernelChoice::kCudaCore, true, false),
            DecodeKernelChoice::kCudaCore);
  EXPECT_EQ(EffectiveDecodeKernelChoice(DecodeKernelChoice::kAuto, true, true),
            DecodeKernelChoice::kAuto);
}

}  // namespace
}  // namespace attnd::plan
