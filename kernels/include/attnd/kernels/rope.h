// Rotary position embedding: the frequency table is computed once on the host (in double) and
// shared by the reference and the GPU kernels, so both rotate by the same angles.
#pragma once

#include <cstdint>
#include <vector>

namespace attnd {

enum class RopeStyle : int32_t {
  kNone = 1,
  kNeox = 2,         // pairs (i, i + rotary_dim / 2)
  kInterleaved = 3,  // pairs (2i, 2i + 1)
};

enum class RopeScaling : int32_t {
  kNone = 1,
  kLinear = 2,
  kLlama3 = 3,
};

struct RopeConfig {
  RopeStyle style = RopeStyle::kNone;
  double theta = 10000.0;
  int32_t rotary_dim = 0;  // resolved: even, > 0 when style != kNone
  RopeScaling scaling = RopeScaling::kNone;
  double factor = 1.0;
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  int64_t original_max_position = 8192;
};

// Inverse frequencies of the rotary_dim / 2 pairs, scaling applied. Empty for kNone.
std::vector<float> RopeInverseFrequencies(const RopeConfig& config);

}  // namespace attnd
