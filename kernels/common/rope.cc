#include "attnd/kernels/rope.h"

#include <cmath>
#include <numbers>

namespace attnd {

std::vector<float> RopeInverseFrequencies(const RopeConfig& config) {
  std::vector<float> inv_freq;
  if (config.style == RopeStyle::kNone || config.rotary_dim <= 0) return inv_freq;
  const int pairs = config.rotary_dim / 2;
  inv_freq.reserve(pairs);
  for (int i = 0; i < pairs; ++i) {
    double freq = std::pow(config.theta, -2.0 * i / config.rotary_dim);
    switch (config.scaling) {
      case RopeScaling::kNone:
        break;
      case RopeScaling::kLinear:
        freq /= config.factor;
        break;
      case RopeScaling::kLlama3: {
        const double wavelength = 2.0 * std::numbers::pi / freq;
        const double original = static_cast<double>(config.original_max_position);
        const double low_freq_wavelength = original / config.low_freq_factor;
        const double high_freq_wavelength = original / config.high_freq_factor;
        if (wavelength > low_freq_wavelength) {
          freq /= config.factor;
        } else if (wavelength >= high_freq_wavelength) {
          // Between the two bands: blend the scaled and unscaled frequency.
          const double smooth = (original / wavelength - config.low_freq_factor) /
                                (config.high_freq_factor - config.low_freq_factor);
          freq = (1.0 - smooth) * freq / config.factor + smooth * freq;
        }
        break;
      }
    }
    inv_freq.push_back(static_cast<float>(freq));
  }
  return inv_freq;
}

}  // namespace attnd
