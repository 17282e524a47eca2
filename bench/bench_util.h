// Host-side helpers shared by the kernel benchmarks (attnd_bench, mla_bench, prefill_bench,
// pod_bench): fail-fast checks, owned device memory, uploads and medians.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "absl/status/status.h"

// A benchmark cannot go on after a failed CUDA call or kernel launcher: print where, and exit 1.
#define CHECK_CUDA(expr)                                                                \
  do {                                                                                  \
    const cudaError_t bench_error_ = (expr);                                            \
    if (bench_error_ != cudaSuccess) {                                                  \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #expr,                \
                   cudaGetErrorString(bench_error_));                                   \
      std::exit(1);                                                                     \
    }                                                                                   \
  } while (false)

#define CHECK_OK(expr)                                                                  \
  do {                                                                                  \
    const absl::Status bench_status_ = (expr);                                          \
    if (!bench_status_.ok()) {                                                          \
      std::fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__,                           \
                   bench_status_.ToString().c_str());                                   \
      std::exit(1);                                                                     \
    }                                                                                   \
  } while (false)

namespace attnd::bench {

// cudaMalloc'd bytes, freed on scope exit.
class DeviceMemory {
 public:
  explicit DeviceMemory(size_t bytes) : bytes_(bytes) {
    if (bytes > 0) CHECK_CUDA(cudaMalloc(&data_, bytes));
  }
  DeviceMemory(const DeviceMemory&) = delete;
  DeviceMemory& operator=(const DeviceMemory&) = delete;
  ~DeviceMemory() {
    if (data_ != nullptr) cudaFree(data_);
  }
  template <typename T = void>
  T* get() const {
    return static_cast<T*>(data_);
  }
  size_t bytes() const { return bytes_; }

 private:
  void* data_ = nullptr;
  size_t bytes_ = 0;
};

template <typename T>
void CopyToDevice(void* device, const std::vector<T>& host) {
  if (!host.empty()) {
    CHECK_CUDA(cudaMemcpy(device, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
  }
}

inline double Median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  const size_t n = values.size();
  return n % 2 ? values[n / 2] : 0.5 * (values[n / 2 - 1] + values[n / 2]);
}

}  // namespace attnd::bench
