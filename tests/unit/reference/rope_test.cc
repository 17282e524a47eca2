// RoPE: RopeInverseFrequencies (attnd/kernels/rope.h) against the published formulas, and
// reference::RotateHead against hand-computed rotations.
#include "attnd/kernels/rope.h"

#include <gtest/gtest.h>

#include <cmath>
#include <numbers>
#include <vector>

#include "reference/append.h"

namespace attnd {
namespace {

using reference::RotateHead;

// cos/sin of 1 and 0.01 rad, and the rotated heads below, from a calculator (Python math).
TEST(RotateHead, NeoxRotatesHalvesPairwise) {
  std::vector<float> head = {1, 2, 3, 4};  // pairs (0, 2) at 1 rad, (1, 3) at 0.01 rad
  const std::vector<float> inv_freq = {1.0f, 0.01f};
  RotateHead(RopeStyle::kNeox, inv_freq, 1, head);
  EXPECT_NEAR(head[0], -1.9841106485555495, 1e-6);
  EXPECT_NEAR(head[2], 2.4623779024123156, 1e-6);
  EXPECT_NEAR(head[1], 1.959900667496664, 1e-6);
  EXPECT_NEAR(head[3], 4.019799668334994, 1e-6);
}

TEST(RotateHead, InterleavedRotatesAdjacentPairs) {
  std::vector<float> head = {1, 2, 3, 4};  // pairs (0, 1) at 1 rad, (2, 3) at 0.01 rad
  const std::vector<float> inv_freq = {1.0f, 0.01f};
  RotateHead(RopeStyle::kInterleaved, inv_freq, 1, head);
  EXPECT_NEAR(head[0], -1.1426396637476532, 1e-6);
  EXPECT_NEAR(head[1], 1.922075596544176, 1e-6);
  EXPECT_NEAR(head[2], 2.9598506679133294, 1e-6);
  EXPECT_NEAR(head[3], 4.029799501669161, 1e-6);
}

TEST(RotateHead, PartialRotaryLeavesTheTailUnchanged) {
  for (const RopeStyle style : {RopeStyle::kNeox, RopeStyle::kInterleaved}) {
    std::vector<float> head = {1, 2, 3, 4, 5.5f, -6.25f};  // rotary_dim 4 of 6
    const std::vector<float> inv_freq = {1.0f, 0.01f};
    RotateHead(style, inv_freq, 1, head);
    EXPECT_EQ(head[4], 5.5f);
    EXPECT_EQ(head[5], -6.25f);
    EXPECT_NEAR(head[0], style == RopeStyle::kNeox ? -1.9841106485555495 : -1.1426396637476532,
                1e-6);
  }
}

TEST(RotateHead, PositionZeroAndStyleNoneAreIdentity) {
  const std::vector<float> original = {0.5f, -1, 2, 3};
  const std::vector<float> inv_freq = {1.0f, 0.5f};
  std::vector<float> head = original;
  RotateHead(RopeStyle::kNeox, inv_freq, 0, head);
  EXPECT_EQ(head, original);
  RotateHead(RopeStyle::kNone, inv_freq, 123, head);
  EXPECT_EQ(head, original);
}

TEST(RotateHead, RotationPreservesPairNorms) {
  std::vector<float> head = {3, 4, -1, 7};
  const std::vector<float> inv_freq = {0.3f, 0.002f};
  RotateHead(RopeStyle::kInterleaved, inv_freq, 4321, head);
  EXPECT_NEAR(std::hypot(head[0], head[1]), 5.0, 1e-5);
  EXPECT_NEAR(std::hypot(head[2], head[3]), std::hypot(-1.0, 7.0), 1e-5);
}

// The GPU forms the angle as a float32 product; at large positions that product's rounding
// moves the angle by far more than the test tolerance, so this pins the float32 semantics.
TEST(RotateHead, AngleIsTheFloat32ProductOfPositionAndFrequency) {
  const int32_t position = 1000003;
  const float inv_freq_value = 0.37f;
  const float float_angle = static_cast<float>(position) * inv_freq_value;
  const double double_angle = double{position} * double{inv_freq_value};
  ASSERT_GT(std::fabs(std::cos(double{float_angle}) - std::cos(double_angle)), 1e-4)
      << "pick a position where the two differ";
  std::vector<float> head = {1, 0};
  const std::vector<float> inv_freq = {inv_freq_value};
  RotateHead(RopeStyle::kNeox, inv_freq, position, head);
  EXPECT_NEAR(head[0], std::cos(double{float_angle}), 1e-5);
  EXPECT_NEAR(head[1], std::sin(double{float_angle}), 1e-5);
}

// ---- RopeInverseFrequencies ------------------------------------------------------------------

RopeConfig Config(RopeScaling scaling, double theta, int rotary_dim) {
  RopeConfig config;
  config.style = RopeStyle::kNeox;
  config.theta = theta;
  config.rotary_dim = rotary_dim;
  config.scaling = scaling;
  return config;
}

TEST(RopeInverseFrequencies, NoneIsThetaToTheMinusTwoIOverD) {
  const RopeConfig config = Config(RopeScaling::kNone, 10000.0, 128);
  const std::vector<float> inv_freq = RopeInverseFrequencies(config);
  ASSERT_EQ(inv_freq.size(), 64u);
  for (int i = 0; i < 64; ++i) {
    const double want = 1.0 / std::pow(10000.0, (2.0 * i) / 128.0);
    EXPECT_NEAR(inv_freq[i], want, want * 2e-7) << i;
  }
  EXPECT_EQ(inv_freq[0], 1.0f);
}

TEST(RopeInverseFrequencies, StyleNoneGivesNoFrequencies) {
  RopeConfig config = Config(RopeScaling::kNone, 10000.0, 64);
  config.style = RopeStyle::kNone;
  EXPECT_TRUE(RopeInverseFrequencies(config).empty());
}

TEST(RopeInverseFrequencies, LinearDividesEveryFrequencyByTheFactor) {
  RopeConfig config = Config(RopeScaling::kLinear, 10000.0, 64);
  config.factor = 4.0;
  const std::vector<float> inv_freq = RopeInverseFrequencies(config);
  ASSERT_EQ(inv_freq.size(), 32u);
  for (int i = 0; i < 32; ++i) {
    const double want = 1.0 / std::pow(10000.0, (2.0 * i) / 64.0) / 4.0;
    EXPECT_NEAR(inv_freq[i], want, want * 2e-7) << i;
  }
}

// Llama 3.1 (rope_type "llama3"): wavelengths shorter than original/high_freq_factor keep their
// frequency, longer than original/low_freq_factor are divided by factor, and the band between
// interpolates linearly in original/wavelength.
TEST(RopeInverseFrequencies, Llama3ScalesLowFrequenciesAndBlendsTheMiddleBand) {
  RopeConfig config = Config(RopeScaling::kLlama3, 500000.0, 128);
  config.factor = 8.0;
  config.low_freq_factor = 1.0;
  config.high_freq_factor = 4.0;
  config.original_max_position = 8192;
  const std::vector<float> inv_freq = RopeInverseFrequencies(config);
  ASSERT_EQ(inv_freq.size(), 64u);
  int kept = 0, divided = 0, blended = 0;
  for (int i = 0; i < 64; ++i) {
    const double base = std::pow(500000.0, -(2.0 * i) / 128.0);
    const double wavelength = 2 * std::numbers::pi / base;
    double want;
    if (wavelength < 8192.0 / 4.0) {
      want = base;
      ++kept;
    } else if (wavelength > 8192.0 / 1.0) {
      want = base / 8.0;
      ++divided;
    } else {
      const double t = (8192.0 / wavelength - 1.0) / (4.0 - 1.0);
      want = (1 - t) * base / 8.0 + t * base;
      ++blended;
    }
    EXPECT_NEAR(inv_freq[i], want, want * 2e-7) << i;
  }
  // Each band is exercised by these parameters.
  EXPECT_GT(kept, 0);
  EXPECT_GT(divided, 0);
  EXPECT_GT(blended, 0);
  EXPECT_EQ(inv_freq[0], 1.0f);
}

}  // namespace
}  // namespace attnd
