// The append kernel's cos/sin (kernels/cuda/rope_angles.h, compiled here for the CPU with the
// same explicit fma sequence) against float64 cos/sin of the same float angle, over every
// position up to 2^18 for the usual rotary tables and single pairs out to 2^21 (issue 15).
#include "rope_angles.h"

#include <cmath>
#include <vector>

#include "attnd/kernels/rope.h"
#include "gtest/gtest.h"

namespace attnd {
namespace {

constexpr double kBound = 0x1p-23;

double Error(float angle) {
  const rope::CosSin value = rope::RopeCosSin(angle);
  const double exact_cos = std::cos(static_cast<double>(angle));
  const double exact_sin = std::sin(static_cast<double>(angle));
  return std::max(std::fabs(value.cos - exact_cos), std::fabs(value.sin - exact_sin));
}

TEST(RopeAnglesTest, WithinBoundOfFloat64ForEveryPositionUpTo2To18) {
  for (double theta : {10000.0, 500000.0}) {
    for (int32_t rotary_dim : {64, 128}) {
      RopeConfig config;
      config.style = RopeStyle::kNeox;
      config.rotary_dim = rotary_dim;
      config.theta = theta;
      const std::vector<float> inv_freq = RopeInverseFrequencies(config);
      double worst = 0;
      float worst_angle = 0;
      for (int32_t position = 0; position <= (1 << 18); ++position) {
        for (float frequency : inv_freq) {
          const float angle = static_cast<float>(position) * frequency;
          const double error = Error(angle);
          if (error > worst) {
            worst = error;
            worst_angle = angle;
          }
        }
      }
      EXPECT_LE(worst, kBound) << "theta " << theta << " rotary_dim " << rotary_dim << ": angle " << worst_angle;
    }
  }
}

TEST(RopeAnglesTest, WithinBoundForLongPositionsAndSpecialAngles) {
  for (int32_t position = (1 << 18); position <= (1 << 21); position += 7) {
    ASSERT_LE(Error(static_cast<float>(position)), kBound) << position;
    ASSERT_LE(Error(static_cast<float>(position) * 0.8659643f), kBound) << position;
  }
  for (float angle : {0.0f, -0.0f, 1e-30f, 0.785398f, 1.5707964f, 3.1415927f, 4.712389f, 6.2831855f, -1.5707964f}) {
    EXPECT_LE(Error(angle), kBound) << angle;
  }
  const rope::CosSin zero = rope::RopeCosSin(0.0f);
  EXPECT_EQ(zero.cos, 1.0f);
  EXPECT_EQ(zero.sin, 0.0f);
}

}  // namespace
}  // namespace attnd
