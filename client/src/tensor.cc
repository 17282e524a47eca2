#include "attnd/client/tensor.h"

#include <bit>
#include <limits>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "attnd/status_macros.h"

namespace attnd::client {
namespace {

static_assert(std::endian::native == std::endian::little,
              "attnd tensors are little-endian on the wire; this client copies host bytes");

std::string ShapeString(std::span<const int64_t> shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

// Our Abseil's string_view is not std::string_view.
std::string Name(DType dtype) { return std::string(DTypeName(dtype)); }

std::span<const int64_t> ShapeOf(const attnd::v1::Tensor& tensor) {
  return {tensor.shape().data(), static_cast<size_t>(tensor.shape().size())};
}

// A tensor of `dtype` and `shape`, data not yet filled, once `given_bytes` is the right size.
absl::StatusOr<attnd::v1::Tensor> EmptyTensor(DType dtype, std::span<const int64_t> shape,
                                              int64_t given_bytes, const std::string& given_what) {
  ASSIGN_OR_RETURN(const int64_t elements, NumElements(shape));
  const int64_t expected_bytes = elements * DTypeBytes(dtype);
  if (given_bytes != expected_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor of ", Name(dtype), " ", ShapeString(shape), " needs ",
                     expected_bytes, " bytes, got ", given_what));
  }
  attnd::v1::Tensor tensor;
  tensor.set_dtype(ToProto(dtype));
  for (int64_t dim : shape) tensor.add_shape(dim);
  return tensor;
}

}  // namespace

attnd::v1::DType ToProto(DType dtype) { return static_cast<attnd::v1::DType>(dtype); }

absl::StatusOr<DType> FromProto(attnd::v1::DType dtype) {
  switch (dtype) {
    case attnd::v1::DTYPE_FLOAT16:
      return DType::kFloat16;
    case attnd::v1::DTYPE_BFLOAT16:
      return DType::kBFloat16;
    case attnd::v1::DTYPE_FLOAT8_E4M3:
      return DType::kFloat8E4M3;
    case attnd::v1::DTYPE_FLOAT32:
      return DType::kFloat32;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("dtype: expected FLOAT16, BFLOAT16, FLOAT8_E4M3 or FLOAT32, got ",
                       attnd::v1::DType_Name(dtype).empty() ? std::to_string(dtype)
                                                            : attnd::v1::DType_Name(dtype)));
  }
}

absl::StatusOr<int64_t> NumElements(std::span<const int64_t> shape) {
  int64_t elements = 1;
  for (int64_t dim : shape) {
    if (dim < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("shape ", ShapeString(shape), " has a negative dimension"));
    }
    if (dim != 0 && elements > std::numeric_limits<int64_t>::max() / 8 / dim) {
      return absl::InvalidArgumentError(absl::StrCat("shape ", ShapeString(shape), " is too large"));
    }
    elements *= dim;
  }
  return elements;
}

absl::StatusOr<attnd::v1::Tensor> MakeTensor(DType dtype, std::span<const int64_t> shape,
                                             std::span<const uint16_t> bits) {
  if (DTypeBytes(dtype) != 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("16-bit elements given for a tensor of ", Name(dtype)));
  }
  ASSIGN_OR_RETURN(attnd::v1::Tensor tensor,
                   EmptyTensor(dtype, shape, static_cast<int64_t>(bits.size_bytes()),
                               absl::StrCat(bits.size(), " 16-bit elements")));
  tensor.set_data(reinterpret_cast<const char*>(bits.data()), bits.size_bytes());
  return tensor;
}

absl::StatusOr<attnd::v1::Tensor> MakeTensor(DType dtype, std::span<const int64_t> shape,
                                             std::span<const uint8_t> bytes) {
  ASSIGN_OR_RETURN(attnd::v1::Tensor tensor,
                   EmptyTensor(dtype, shape, static_cast<int64_t>(bytes.size()),
                               absl::StrCat(bytes.size(), " bytes")));
  tensor.set_data(reinterpret_cast<const char*>(bytes.data()), bytes.size());
  return tensor;
}

absl::StatusOr<attnd::v1::Tensor> MakeTensor(DType dtype, std::span<const int64_t> shape,
                                             std::span<const float> values) {
  const int64_t element_bytes = DTypeBytes(dtype);
  ASSIGN_OR_RETURN(attnd::v1::Tensor tensor,
                   EmptyTensor(dtype, shape, static_cast<int64_t>(values.size()) * element_bytes,
                               absl::StrCat(values.size(), " floats")));
  std::string* data = tensor.mutable_data();
  data->resize(values.size() * element_bytes);
  for (size_t i = 0; i < values.size(); ++i) {
    StoreFromFloat(dtype, data->data(), static_cast<int64_t>(i), values[i]);
  }
  return tensor;
}

absl::StatusOr<std::vector<float>> TensorToFloats(const attnd::v1::Tensor& tensor) {
  ASSIGN_OR_RETURN(const DType dtype, FromProto(tensor.dtype()));
  ASSIGN_OR_RETURN(const int64_t elements, NumElements(ShapeOf(tensor)));
  if (tensor.values_size() > 0 && tensor.data().empty()) {
    if (tensor.values_size() != elements) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor values: shape ", ShapeString(ShapeOf(tensor)), " needs ", elements,
                       " floats, got ", tensor.values_size()));
    }
    std::vector<float> out(tensor.values().begin(), tensor.values().end());
    // `values` mean "converted to dtype": apply the same rounding the server would.
    if (dtype != DType::kFloat32) {
      for (float& value : out) {
        uint8_t scratch[4];
        StoreFromFloat(dtype, scratch, 0, value);
        value = LoadAsFloat(dtype, scratch, 0);
      }
    }
    return out;
  }
  const int64_t expected_bytes = elements * DTypeBytes(dtype);
  if (static_cast<int64_t>(tensor.data().size()) != expected_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor data: ", Name(dtype), " ", ShapeString(ShapeOf(tensor)),
                     " needs ", expected_bytes, " bytes, got ", tensor.data().size()));
  }
  std::vector<float> out(static_cast<size_t>(elements));
  for (int64_t i = 0; i < elements; ++i) out[i] = LoadAsFloat(dtype, tensor.data().data(), i);
  return out;
}

}  // namespace attnd::client
