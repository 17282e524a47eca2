// Helpers of the append/decode/merge GPU tests: device buffers, random data in every dtype,
// paged caches with shuffled page ids, and error norms. GPU tests skip without a device.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <utility>
#include <vector>

#include "attnd/kernels/dtype.h"
#include "attnd/kernels/views.h"
#include "gtest/gtest.h"

namespace attnd::kernel_test {

inline bool HaveGpu() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

#define ATTND_SKIP_WITHOUT_GPU() \
  if (!::attnd::kernel_test::HaveGpu()) GTEST_SKIP() << "no CUDA device"

#define ATTND_ASSERT_CUDA(expr) ASSERT_EQ((expr), cudaSuccess) << #expr

// Device memory of exactly the requested size (so compute-sanitizer sees any overrun), freed
// on scope exit.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t bytes) : bytes_(bytes) {
    if (bytes > 0 && cudaMalloc(&data_, bytes) != cudaSuccess) data_ = nullptr;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& other) noexcept { *this = std::move(other); }
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept {
    std::swap(data_, other.data_);
    std::swap(bytes_, other.bytes_);
    return *this;
  }
  ~DeviceBuffer() {
    if (data_ != nullptr) cudaFree(data_);
  }
  void* get() const { return data_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(data_);
  }
  size_t bytes() const { return bytes_; }

 private:
  void* data_ = nullptr;
  size_t bytes_ = 0;
};

template <typename T>
DeviceBuffer Upload(const std::vector<T>& host) {
  DeviceBuffer buffer(host.size() * sizeof(T));
  if (!host.empty()) {
    cudaMemcpy(buffer.get(), host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice);
  }
  return buffer;
}

template <typename T>
std::vector<T> Download(const DeviceBuffer& buffer, size_t count) {
  std::vector<T> host(count);
  if (count > 0) cudaMemcpy(host.data(), buffer.get(), count * sizeof(T), cudaMemcpyDeviceToHost);
  return host;
}

// `count` elements of `dtype`, uniform in [-range, range), as raw bytes.
inline std::vector<uint8_t> RandomElements(DType dtype, int64_t count, float range,
                                           std::mt19937& rng) {
  std::vector<uint8_t> bytes(static_cast<size_t>(count) * DTypeBytes(dtype));
  std::uniform_real_distribution<float> uniform(-range, range);
  for (int64_t i = 0; i < count; ++i) StoreFromFloat(dtype, bytes.data(), i, uniform(rng));
  return bytes;
}

// A pattern no kernel writes by accident: NaN in fp16/bf16/fp32 (0xff bytes) and in E4M3.
inline void Poison(std::vector<uint8_t>& bytes) { std::fill(bytes.begin(), bytes.end(), 0xff); }

// Element i of a raw array as double.
inline double ElementAt(DType dtype, const std::vector<uint8_t>& bytes, int64_t i) {
  return LoadAsFloat(dtype, bytes.data(), i);
}

// ||gpu - ref|| / ||ref|| over `count` elements (ref in any dtype, gpu in another), in double.
// NaN anywhere gives NaN, which fails every bound.
inline double NormwiseRelativeError(DType gpu_dtype, const std::vector<uint8_t>& gpu,
                                    DType ref_dtype, const std::vector<uint8_t>& ref,
                                    int64_t count) {
  double diff = 0.0;
  double norm = 0.0;
  for (int64_t i = 0; i < count; ++i) {
    const double a = ElementAt(gpu_dtype, gpu, i);
    const double b = ElementAt(ref_dtype, ref, i);
    diff += (a - b) * (a - b);
    norm += b * b;
  }
  if (std::isnan(diff)) return NAN;
  return norm > 0 ? std::sqrt(diff / norm) : std::sqrt(diff);
}

// A batch's page table with every request's pages drawn from a shuffled pool, so consecutive
// pages of a request are rarely adjacent (and V pages differ from K pages for SEPARATE_KV).
struct HostPageTable {
  int32_t page_size = 0;
  int64_t num_pages = 0;
  std::vector<int32_t> indptr{0};
  std::vector<int32_t> k_indices;
  std::vector<int32_t> v_indices;
  std::vector<int32_t> last_page_len;

  int64_t KvLength(int32_t b) const {
    const int32_t pages = indptr[b + 1] - indptr[b];
    return pages == 0 ? 0 : int64_t{pages - 1} * page_size + last_page_len[b];
  }
  PageTableView View() const {
    return PageTableView{static_cast<int32_t>(last_page_len.size()), page_size, indptr.data(),
                         k_indices.data(), v_indices.data(), last_page_len.data()};
  }
};

// extra_pages > 0 leaves pages no request owns (their bytes must never change or be read).
inline HostPageTable MakePageTable(const std::vector<int64_t>& lengths, int32_t page_size,
                                   bool separate_kv, int64_t extra_pages, std::mt19937& rng) {
  HostPageTable table;
  table.page_size = page_size;
  int64_t total = 0;
  for (int64_t length : lengths) total += (length + page_size - 1) / page_size;
  table.num_pages = total + extra_pages;
  std::vector<int32_t> k_pool(table.num_pages), v_pool(table.num_pages);
  std::iota(k_pool.begin(), k_pool.end(), 0);
  std::iota(v_pool.begin(), v_pool.end(), 0);
  std::shuffle(k_pool.begin(), k_pool.end(), rng);
  std::shuffle(v_pool.begin(), v_pool.end(), rng);
  int64_t next = 0;
  for (int64_t length : lengths) {
    const int64_t pages = (length + page_size - 1) / page_size;
    for (int64_t p = 0; p < pages; ++p, ++next) {
      table.k_indices.push_back(k_pool[next]);
      table.v_indices.push_back(separate_kv ? v_pool[next] : k_pool[next]);
    }
    table.indptr.push_back(static_cast<int32_t>(table.k_indices.size()));
    table.last_page_len.push_back(
        pages == 0 ? 0 : static_cast<int32_t>(length - (pages - 1) * page_size));
  }
  return table;
}

// Device copies of a HostPageTable.
struct DevicePageTable {
  DeviceBuffer indptr, k_indices, v_indices, last_page_len;
  PageTableView view;

  explicit DevicePageTable(const HostPageTable& host, bool separate_kv)
      : indptr(Upload(host.indptr)),
        k_indices(Upload(host.k_indices)),
        v_indices(separate_kv ? Upload(host.v_indices) : DeviceBuffer()),
        last_page_len(Upload(host.last_page_len)) {
    view.batch_size = static_cast<int32_t>(host.last_page_len.size());
    view.page_size = host.page_size;
    view.indptr = indptr.as<int32_t>();
    view.k_indices = k_indices.as<int32_t>();
    // SHARED tables pass the same array twice, as the engine does.
    view.v_indices = separate_kv ? v_indices.as<int32_t>() : k_indices.as<int32_t>();
    view.last_page_len = last_page_len.as<int32_t>();
  }
};

// Non-finite inputs (NaN in, NaN out; ForwardResponse.o in the proto). `value` as stored in
// `dtype`: E4M3 has no infinity (an inf would saturate to 448), so fp8 gets NaN.
inline void StoreNonFinite(DType dtype, void* base, int64_t index, float value) {
  StoreFromFloat(dtype, base, index, dtype == DType::kFloat8E4M3 ? NAN : value);
}

// Checks a run on poisoned inputs against the reference on the same inputs and against the
// kernel's own run without the poison: the rows the reference marks (lse NaN) are NaN in lse
// and in every one of their `dim` o values; every other row equals the clean run exactly (o and
// lse). `expected_nan_rows`: how many rows the poison must mark, so the test cannot pass empty.
inline void ExpectNonFiniteRows(DType o_dtype, int64_t rows, int32_t dim, const std::vector<float>& reference_lse,
                                const std::vector<uint8_t>& o, const std::vector<float>& lse,
                                const std::vector<uint8_t>& clean_o, const std::vector<float>& clean_lse,
                                int64_t expected_nan_rows) {
  const int64_t nan_rows = std::count_if(reference_lse.begin(), reference_lse.begin() + rows,
                                         [](float value) { return std::isnan(value); });
  int failures = 0;
  for (int64_t r = 0; r < rows && failures < 10; ++r) {
    if (std::isnan(reference_lse[r])) {
      if (!std::isnan(lse[r])) {
        ++failures;
        ADD_FAILURE() << "row " << r << ": lse " << lse[r] << ", expected NaN";
      }
      for (int32_t d = 0; d < dim; ++d) {
        const double value = ElementAt(o_dtype, o, r * dim + d);
        if (!std::isnan(value)) {
          ++failures;
          ADD_FAILURE() << "row " << r << " dim " << d << ": o " << value << ", expected NaN";
          break;
        }
      }
      continue;
    }
    // Exact equality (NaN never equals, +0 equals -0): the poison must not move other rows.
    if (!(lse[r] == clean_lse[r])) {
      ++failures;
      ADD_FAILURE() << "row " << r << ": lse " << lse[r] << ", without the poison " << clean_lse[r];
    }
    for (int32_t d = 0; d < dim; ++d) {
      const double value = ElementAt(o_dtype, o, r * dim + d);
      const double clean = ElementAt(o_dtype, clean_o, r * dim + d);
      if (!(value == clean)) {
        ++failures;
        ADD_FAILURE() << "row " << r << " dim " << d << ": o " << value << ", without the poison " << clean;
        break;
      }
    }
  }
  EXPECT_EQ(nan_rows, expected_nan_rows) << "rows the reference marks NaN";
}

inline const char* ShortName(DType dtype) {
  switch (dtype) {
    case DType::kFloat16:
      return "f16";
    case DType::kBFloat16:
      return "bf16";
    case DType::kFloat8E4M3:
      return "fp8";
    case DType::kFloat32:
      return "f32";
  }
  return "?";
}

}  // namespace attnd::kernel_test
