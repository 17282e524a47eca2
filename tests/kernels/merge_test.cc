// MergeStates on the GPU against a float64 merge on the host (DESIGN 4.4): rows with several
// partials, one partial, none, partials that saw no key (lse -inf), all of them masked, output
// rows out of order; fp32 and bf16 outputs. fp32 o within 1e-5 normwise of float64, bf16 within
// 4e-3; lse within 1e-5 absolute.
#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "attnd/kernels/cuda/merge.h"
#include "gtest/gtest.h"
#include "kernel_test_util.h"

namespace attnd {
namespace {

using kernel_test::DeviceBuffer;
using kernel_test::Upload;

class MergeStatesTest : public ::testing::TestWithParam<DType> {};

TEST_P(MergeStatesTest, MatchesFloat64Merge) {
  ATTND_SKIP_WITHOUT_GPU();
  const DType o_dtype = GetParam();
  constexpr int32_t kHeads = 6, kDim = 128;
  std::mt19937 rng(5);
  // Partials per row; row 2 has none, row 4 has all partials masked.
  const std::vector<int32_t> counts = {3, 1, 0, 17, 2, 5};
  std::vector<int32_t> indptr = {0};
  for (int32_t count : counts) indptr.push_back(indptr.back() + count);
  const int32_t rows = static_cast<int32_t>(counts.size());
  const int32_t partials = indptr.back();
  std::vector<int32_t> out_rows = {5, 0, 3, 1, 4, 2};
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> partial_o(int64_t{partials} * kHeads * kDim);
  std::vector<float> partial_lse(int64_t{partials} * kHeads);
  for (float& value : partial_o) value = normal(rng);
  for (float& value : partial_lse) value = 3.0f * normal(rng);
  for (int32_t p = indptr[4]; p < indptr[5]; ++p) {
    for (int32_t h = 0; h < kHeads; ++h) {
      partial_lse[p * kHeads + h] = -std::numeric_limits<float>::infinity();
      for (int32_t d = 0; d < kDim; ++d) partial_o[(int64_t{p} * kHeads + h) * kDim + d] = 0.0f;
    }
  }
  partial_lse[indptr[3] * kHeads + 2] = -std::numeric_limits<float>::infinity();  // one masked chunk
  for (int32_t d = 0; d < kDim; ++d) partial_o[(int64_t{indptr[3]} * kHeads + 2) * kDim + d] = 0.0f;

  // Host float64 merge.
  std::vector<double> expected_o(int64_t{rows} * kHeads * kDim, 0.0);
  std::vector<double> expected_lse(int64_t{rows} * kHeads, -INFINITY);
  for (int32_t r = 0; r < rows; ++r) {
    for (int32_t h = 0; h < kHeads; ++h) {
      double max_lse = -INFINITY;
      for (int32_t p = indptr[r]; p < indptr[r + 1]; ++p) max_lse = std::max<double>(max_lse, partial_lse[p * kHeads + h]);
      if (std::isinf(max_lse)) continue;
      double denominator = 0.0;
      std::vector<double> sum(kDim, 0.0);
      for (int32_t p = indptr[r]; p < indptr[r + 1]; ++p) {
        const double weight = std::exp(partial_lse[p * kHeads + h] - max_lse);
        denominator += weight;
        for (int32_t d = 0; d < kDim; ++d) sum[d] += weight * partial_o[(int64_t{p} * kHeads + h) * kDim + d];
      }
      const int32_t out = out_rows[r];
      for (int32_t d = 0; d < kDim; ++d) expected_o[(int64_t{out} * kHeads + h) * kDim + d] = sum[d] / denominator;
      expected_lse[out * kHeads + h] = max_lse + std::log(denominator);
    }
  }

  DeviceBuffer o_device = Upload(std::vector<uint8_t>(expected_o.size() * DTypeBytes(o_dtype), 0xff));
  DeviceBuffer lse_device = Upload(std::vector<float>(expected_lse.size(), NAN));
  DeviceBuffer partial_o_device = Upload(partial_o), partial_lse_device = Upload(partial_lse);
  DeviceBuffer indptr_device = Upload(indptr), out_rows_device = Upload(out_rows);
  cuda::MergeStatesArgs args;
  args.partial_o = partial_o_device.as<float>();
  args.partial_lse = partial_lse_device.as<float>();
  args.indptr = indptr_device.as<int32_t>();
  args.out_rows = out_rows_device.as<int32_t>();
  args.num_rows = rows;
  args.num_heads = kHeads;
  args.head_dim = kDim;
  args.o = TokenHeadsView{o_device.get(), o_dtype, rows, kHeads, kDim};
  args.lse = lse_device.as<float>();
  const absl::Status status = cuda::MergeStates(args, nullptr);
  ASSERT_TRUE(status.ok()) << status;
  ATTND_ASSERT_CUDA(cudaDeviceSynchronize());
  const auto o = kernel_test::Download<uint8_t>(o_device, expected_o.size() * DTypeBytes(o_dtype));
  const auto lse = kernel_test::Download<float>(lse_device, expected_lse.size());

  double diff = 0.0, norm = 0.0;
  for (size_t i = 0; i < expected_o.size(); ++i) {
    const double value = kernel_test::ElementAt(o_dtype, o, static_cast<int64_t>(i));
    diff += (value - expected_o[i]) * (value - expected_o[i]);
    norm += expected_o[i] * expected_o[i];
  }
  EXPECT_LE(std::sqrt(diff / norm), o_dtype == DType::kFloat32 ? 1e-5 : 4e-3);
  for (size_t i = 0; i < expected_lse.size(); ++i) {
    if (std::isinf(expected_lse[i])) {
      EXPECT_EQ(lse[i], -INFINITY) << i;
    } else {
      EXPECT_NEAR(lse[i], expected_lse[i], 1e-5) << i;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, MergeStatesTest,
                         ::testing::Values(DType::kFloat32, DType::kBFloat16, DType::kFloat16),
                         [](const ::testing::TestParamInfo<DType>& info) {
                           return std::string(kernel_test::ShortName(info.param));
                         });

// Non-finite inputs (NaN in, NaN out): a partial with lse NaN and o NaN (its chunk read a
// non-finite input) makes its row NaN in every dim and in lse, whether the other partials are
// finite, masked (lse -inf) or NaN too; rows without one are unchanged.
TEST(MergeStatesNonFiniteTest, ANaNPartialMakesItsRowNaN) {
  ATTND_SKIP_WITHOUT_GPU();
  constexpr int32_t kHeads = 2, kDim = 64;
  // Row 0: finite, NaN, finite. Row 1: masked, NaN. Row 2: NaN only. Row 3: finite only.
  const std::vector<int32_t> indptr = {0, 3, 5, 6, 8};
  const int32_t rows = 4, partials = indptr.back();
  std::vector<float> partial_o(int64_t{partials} * kHeads * kDim, 0.5f);
  std::vector<float> partial_lse(int64_t{partials} * kHeads, 1.25f);
  auto set_partial = [&](int32_t p, int32_t h, float lse, float o) {
    partial_lse[p * kHeads + h] = lse;
    for (int32_t d = 0; d < kDim; ++d) partial_o[(int64_t{p} * kHeads + h) * kDim + d] = o;
  };
  for (int32_t h = 0; h < kHeads; ++h) {
    set_partial(3, h, -INFINITY, 0.0f);
    set_partial(5, h, NAN, NAN);
  }
  set_partial(1, 0, NAN, NAN);  // row 0, head 0 only
  set_partial(4, 1, NAN, NAN);  // row 1, head 1 only; head 0 of row 1 is masked + finite

  DeviceBuffer o_device = Upload(std::vector<float>(int64_t{rows} * kHeads * kDim, 7.0f));
  DeviceBuffer lse_device = Upload(std::vector<float>(int64_t{rows} * kHeads, 7.0f));
  DeviceBuffer partial_o_device = Upload(partial_o), partial_lse_device = Upload(partial_lse);
  DeviceBuffer indptr_device = Upload(indptr);
  cuda::MergeStatesArgs args;
  args.partial_o = partial_o_device.as<float>();
  args.partial_lse = partial_lse_device.as<float>();
  args.indptr = indptr_device.as<int32_t>();
  args.num_rows = rows;
  args.num_heads = kHeads;
  args.head_dim = kDim;
  args.o = TokenHeadsView{o_device.get(), DType::kFloat32, rows, kHeads, kDim};
  args.lse = lse_device.as<float>();
  ASSERT_TRUE(cuda::MergeStates(args, nullptr).ok());
  ATTND_ASSERT_CUDA(cudaDeviceSynchronize());
  const auto o = kernel_test::Download<float>(o_device, int64_t{rows} * kHeads * kDim);
  const auto lse = kernel_test::Download<float>(lse_device, int64_t{rows} * kHeads);
  const bool expect_nan[rows][kHeads] = {{true, false}, {false, true}, {true, true}, {false, false}};
  for (int32_t r = 0; r < rows; ++r) {
    for (int32_t h = 0; h < kHeads; ++h) {
      SCOPED_TRACE(testing::Message() << "row " << r << " head " << h);
      const int64_t row = int64_t{r} * kHeads + h;
      if (expect_nan[r][h]) {
        EXPECT_TRUE(std::isnan(lse[row])) << lse[row];
        for (int32_t d = 0; d < kDim; ++d) ASSERT_TRUE(std::isnan(o[row * kDim + d])) << d << ": " << o[row * kDim + d];
      } else {
        // Every finite partial of a row has o 0.5: the merge of any of them is 0.5 (masked ones add 0).
        EXPECT_TRUE(std::isfinite(lse[row])) << lse[row];
        for (int32_t d = 0; d < kDim; ++d) ASSERT_NEAR(o[row * kDim + d], 0.5f, 1e-6f) << d;
      }
    }
  }
}

// Same cases under compute-sanitizer.
INSTANTIATE_TEST_SUITE_P(SanitizerMerge, MergeStatesTest, ::testing::Values(DType::kBFloat16),
                         [](const ::testing::TestParamInfo<DType>& info) {
                           return std::string(kernel_test::ShortName(info.param));
                         });

}  // namespace
}  // namespace attnd
