// Fixtures of cuda_backend_test: steps built the way the engine builds them, random inputs,
// and the error measures the CUDA backend is held to against the CPU backend.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <memory>
#include <numeric>
#include <random>
#include <utility>
#include <vector>

#include "attnd/kernels/dtype.h"
#include "absl/status/statusor.h"
#include "backend/backend.h"
#include "backend/cpu_backend.h"
#include "backend/cuda_backend.h"
#include "step_batch_test_util.h"  // SequenceBook (tests/unit/plan)

namespace attnd::testing {

inline std::vector<uint8_t> RandomTensor(DType dtype, int64_t elements, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<uint8_t> bytes(elements * DTypeBytes(dtype));
  for (int64_t i = 0; i < elements; ++i) StoreFromFloat(dtype, bytes.data(), i, normal(rng));
  return bytes;
}

// ||a - b|| / ||b|| over every element, and whether `a` holds a NaN (an unwritten element).
struct Error {
  double relative = 0.0;
  bool nan = false;
};

inline Error NormwiseError(DType dtype, const std::vector<uint8_t>& a, const std::vector<uint8_t>& b) {
  Error error;
  double diff = 0.0;
  double norm = 0.0;
  const int64_t elements = static_cast<int64_t>(a.size()) / DTypeBytes(dtype);
  for (int64_t i = 0; i < elements; ++i) {
    const double x = LoadAsFloat(dtype, a.data(), i);
    const double y = LoadAsFloat(dtype, b.data(), i);
    if (std::isnan(x)) error.nan = true;
    diff += (x - y) * (x - y);
    norm += y * y;
  }
  error.relative = norm > 0.0 ? std::sqrt(diff / norm) : std::sqrt(diff);
  return error;
}

inline double MaxLseDifference(const std::vector<float>& a, const std::vector<float>& b) {
  double worst = 0.0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::isinf(a[i]) || std::isinf(b[i])) {
      if (a[i] != b[i]) return INFINITY;
      continue;
    }
    if (std::isnan(a[i]) || std::isnan(b[i])) return NAN;
    worst = std::max(worst, std::fabs(static_cast<double>(a[i]) - b[i]));
  }
  return worst;
}

// Distance in units in the last place between two codes of a sign-magnitude format.
inline int64_t UlpDistance(uint32_t a, uint32_t b, int bits) {
  const uint32_t sign = 1u << (bits - 1);
  auto ordered = [sign](uint32_t code) {
    return (code & sign) ? -static_cast<int64_t>(code & (sign - 1)) : static_cast<int64_t>(code);
  };
  return std::llabs(ordered(a) - ordered(b));
}

// A cache of `geometry` on a CUDA backend and on a CPU backend of `budget_bytes` each; the CUDA
// backend reports to `observer` (may be null). Members go in reverse order: caches before their
// backends.
struct BackendPair {
  std::unique_ptr<Backend> gpu_backend;
  std::unique_ptr<Backend> cpu_backend;
  std::unique_ptr<BackendCache> gpu;
  std::unique_ptr<BackendCache> cpu;
};

inline absl::StatusOr<BackendPair> MakeBackendPair(const CacheGeometry& geometry,
                                                   int64_t budget_bytes,
                                                   BackendObserver* observer) {
  BackendPair pair;
  CudaBackendOptions cuda_options;
  cuda_options.kv_budget_bytes = budget_bytes;
  cuda_options.observer = observer;
  // ATTND_POD picks the POD mode of the GPU tests' backends (attnd itself takes --pod).
  absl::StatusOr<plan::PodMode> pod_mode = plan::PodModeFromEnvironment();
  if (!pod_mode.ok()) return pod_mode.status();
  cuda_options.pod_mode = *pod_mode;
  // ATTND_DECODE_KERNEL likewise forces their decode kernel (attnd takes --decode_kernel).
  absl::StatusOr<plan::DecodeKernelChoice> decode_kernel = plan::DecodeKernelChoiceFromEnvironment();
  if (!decode_kernel.ok()) return decode_kernel.status();
  cuda_options.decode_kernel = *decode_kernel;
  absl::StatusOr<std::unique_ptr<Backend>> gpu_backend = MakeCudaBackend(cuda_options);
  if (!gpu_backend.ok()) return gpu_backend.status();
  pair.gpu_backend = *std::move(gpu_backend);
  CpuBackendOptions cpu_options;
  cpu_options.kv_budget_bytes = budget_bytes;
  pair.cpu_backend = MakeCpuBackend(cpu_options);
  absl::StatusOr<std::unique_ptr<BackendCache>> gpu = pair.gpu_backend->CreateCache(geometry);
  if (!gpu.ok()) return gpu.status();
  pair.gpu = *std::move(gpu);
  absl::StatusOr<std::unique_ptr<BackendCache>> cpu = pair.cpu_backend->CreateCache(geometry);
  if (!cpu.ok()) return cpu.status();
  pair.cpu = *std::move(cpu);
  return pair;
}

}  // namespace attnd::testing
