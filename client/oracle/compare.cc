#include "attnd/client/compare.h"

#include <cmath>
#include <limits>

namespace attnd::client {

ErrorStats CompareOutputs(std::span<const float> actual, std::span<const float> expected) {
  ErrorStats stats;
  if (actual.size() != expected.size()) {
    stats.normwise_relative = std::numeric_limits<double>::infinity();
    stats.max_abs = std::numeric_limits<double>::infinity();
    return stats;
  }
  double diff_norm = 0.0;
  double expected_norm = 0.0;
  for (size_t i = 0; i < actual.size(); ++i) {
    const double a = actual[i];
    const double e = expected[i];
    if (!std::isfinite(a) || !std::isfinite(e)) {
      // Both -inf (a fully masked lse row) is agreement; anything else is not.
      if (!(std::isinf(a) && std::isinf(e) && std::signbit(a) == std::signbit(e))) {
        ++stats.mismatched_non_finite;
      }
      continue;
    }
    const double diff = std::abs(a - e);
    diff_norm += diff * diff;
    expected_norm += e * e;
    if (diff > stats.max_abs) stats.max_abs = diff;
  }
  diff_norm = std::sqrt(diff_norm);
  expected_norm = std::sqrt(expected_norm);
  stats.normwise_relative = expected_norm > 0.0 ? diff_norm / expected_norm : diff_norm;
  return stats;
}

double OutputTolerance(DType dtype) {
  switch (dtype) {
    case DType::kFloat16:
      return 4e-3;  // 8 units of 2^-11
    case DType::kBFloat16:
      return 2e-2;  // 5 units of 2^-8
    case DType::kFloat8E4M3:
      return 1.25e-1;
    case DType::kFloat32:
      return 1e-5;
  }
  return 0.0;
}

double LseTolerance(DType dtype) {
  switch (dtype) {
    case DType::kFloat16:
      return 5e-3;
    case DType::kBFloat16:
      return 3e-2;
    case DType::kFloat8E4M3:
      return 2e-1;
    case DType::kFloat32:
      return 1e-5;
  }
  return 0.0;
}

}  // namespace attnd::client
