// Typed tensors to and from attnd.v1.Tensor: raw little-endian, row-major, no padding.
//
// MakeTensor copies the caller's elements into the proto; TensorToFloats reads either `data` or
// `values` back into floats. Conversions round to nearest even (attnd/kernels/dtype.h), exactly
// as the server does, so a client can predict the bytes the server stores.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/statusor.h"
#include "attnd/kernels/dtype.h"
#include "attnd/v1/attnd.pb.h"

namespace attnd::client {

attnd::v1::DType ToProto(DType dtype);
// INVALID_ARGUMENT for DTYPE_UNSPECIFIED or an unknown value.
absl::StatusOr<DType> FromProto(attnd::v1::DType dtype);

// Product of the dimensions; INVALID_ARGUMENT for a negative dimension or an overflow.
absl::StatusOr<int64_t> NumElements(std::span<const int64_t> shape);

// 16-bit elements given as their bit patterns (FLOAT16 or BFLOAT16).
absl::StatusOr<attnd::v1::Tensor> MakeTensor(DType dtype, std::span<const int64_t> shape,
                                             std::span<const uint16_t> bits);
// Raw bytes of any dtype (e.g. FLOAT8_E4M3 elements): product(shape) * DTypeBytes(dtype) bytes.
absl::StatusOr<attnd::v1::Tensor> MakeTensor(DType dtype, std::span<const int64_t> shape,
                                             std::span<const uint8_t> bytes);
// Floats converted to `dtype` (copied as they are for FLOAT32).
absl::StatusOr<attnd::v1::Tensor> MakeTensor(DType dtype, std::span<const int64_t> shape,
                                             std::span<const float> values);

// The elements as floats. Accepts `data` (checked against dtype and shape) or `values`; an
// empty tensor (no elements) gives an empty vector.
absl::StatusOr<std::vector<float>> TensorToFloats(const attnd::v1::Tensor& tensor);

}  // namespace attnd::client
