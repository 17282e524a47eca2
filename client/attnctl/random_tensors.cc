#include "random_tensors.h"

#include "attnd/client/tensor.h"

namespace attnd::attnctl {

absl::StatusOr<attnd::v1::Tensor> RandomTensor(std::mt19937_64& rng, DType dtype,
                                               const std::vector<int64_t>& shape) {
  auto elements = client::NumElements(shape);
  if (!elements.ok()) return elements.status();
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> values(static_cast<size_t>(*elements));
  for (float& value : values) value = normal(rng);
  return client::MakeTensor(dtype, shape, std::span<const float>(values));
}

}  // namespace attnd::attnctl
