// Seeded pseudo-random q/k/v for demo and bench: the same seed gives the same bytes.
#pragma once

#include <cstdint>
#include <random>
#include <vector>

#include "absl/status/statusor.h"
#include "attnd/kernels/dtype.h"
#include "attnd/v1/attnd.pb.h"

namespace attnd::attnctl {

// Elements drawn from N(0, 1), rounded to `dtype`.
absl::StatusOr<attnd::v1::Tensor> RandomTensor(std::mt19937_64& rng, DType dtype,
                                               const std::vector<int64_t>& shape);

}  // namespace attnd::attnctl
