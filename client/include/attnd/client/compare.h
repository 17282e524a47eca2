// How close a server's output is to the reference's, and how close it has to be.
#pragma once

#include <cstdint>
#include <span>

#include "attnd/kernels/dtype.h"

namespace attnd::client {

struct ErrorStats {
  // ||actual - expected||_2 / ||expected||_2 (the absolute norm when expected is all zero).
  double normwise_relative = 0.0;
  double max_abs = 0.0;
  // Elements where exactly one side is not finite, or they disagree on an infinity's sign.
  int64_t mismatched_non_finite = 0;
};

// Element counts must match; a count mismatch is reported as an infinite error.
ErrorStats CompareOutputs(std::span<const float> actual, std::span<const float> expected);

// Largest acceptable normwise relative error of o for outputs in `dtype`, against a float64
// reference over the same stored K/V: a few units of the dtype's rounding (bf16 2^-8, fp16
// 2^-11) to cover rounding of o and of the rotated q and probabilities in the kernels.
double OutputTolerance(DType dtype);
// Largest acceptable absolute error of lse (natural log) for inputs in `dtype`.
double LseTolerance(DType dtype);

}  // namespace attnd::client
