// Host-side helpers shared by the kernel benchmarks (attnd_bench, mla_bench, prefill_bench,
// pod_bench): fail-fast checks, owned device memory, uploads, medians and timing loops.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "attnd/kernels/dtype.h"
#include "device_fill.h"

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

// Seconds of warm-up before each timed measurement (--warm_ms=N; 0, the default, keeps the
// short warm-up). The timed runs then start once the card has run the measured work for that
// long, so every case meets it in the same state. An H100 at its 700 W limit runs compute-heavy
// kernels about 10% slower than right after an idle stretch (the CPU reference check before
// each case is one), docs/benchmarks.md, MLA section.
inline double g_warm_seconds = 0.0;

// Takes "--warm_ms=N" into g_warm_seconds; false for any other argument.
inline bool ParseWarmFlag(const char* arg) {
  if (std::strncmp(arg, "--warm_ms=", 10) != 0) return false;
  g_warm_seconds = std::max(0.0, std::atof(arg + 10) * 1e-3);
  return true;
}

// The attention shape of a benchmark run: PERFORMANCE.md's standard one unless --qo_heads,
// --kv_heads, --head_dim or --page_size say otherwise (prefill_bench, attnd_bench).
struct Shape {
  int32_t qo_heads = 32;
  int32_t kv_heads = 8;
  int32_t head_dim = 128;
  int32_t page_size = 16;
};

// Reads one of the shape's flags into `shape`; false when `arg` is none of them.
inline bool ParseShapeFlag(const char* arg, Shape& shape) {
  for (const auto& [name, value] : {std::pair{"--qo_heads=", &shape.qo_heads}, std::pair{"--kv_heads=", &shape.kv_heads},
                                    std::pair{"--head_dim=", &shape.head_dim}, std::pair{"--page_size=", &shape.page_size}}) {
    const size_t length = std::strlen(name);
    if (std::strncmp(arg, name, length) == 0) {
      *value = std::atoi(arg + length);
      return true;
    }
  }
  return false;
}

// Whether the kernels take `shape`; says why not on stderr, naming `program`.
inline bool CheckShape(const Shape& shape, const char* program) {
  if (shape.qo_heads > 0 && shape.kv_heads > 0 && shape.qo_heads % shape.kv_heads == 0 && shape.page_size > 0 &&
      (shape.head_dim == 64 || shape.head_dim == 128 || shape.head_dim == 256)) {
    return true;
  }
  std::fprintf(stderr, "%s: qo_heads must be a positive multiple of kv_heads, page_size positive, head_dim 64, 128 or 256\n",
               program);
  return false;
}

// The items of a comma-separated list ("a,b,c"; empty items kept).
inline std::vector<std::string> SplitList(const std::string& list) {
  std::vector<std::string> items;
  for (size_t start = 0; start <= list.size();) {
    const size_t end = std::min(list.find(',', start), list.size());
    items.push_back(list.substr(start, end - start));
    start = end + 1;
  }
  return items;
}

// Says so in the output when --warm_ms was given.
inline void PrintWarmUp() {
  if (g_warm_seconds > 0) std::printf("warm-up: %.0f ms of the measured work before each timing\n", g_warm_seconds * 1e3);
}

// Repeats `run_once` (work enqueued on `stream`) until g_warm_seconds of wall time have passed.
inline void WarmUp(cudaStream_t stream, const std::function<void()>& run_once) {
  if (g_warm_seconds <= 0) return;
  const auto start = std::chrono::steady_clock::now();
  do {
    run_once();
    CHECK_CUDA(cudaStreamSynchronize(stream));
  } while (std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() < g_warm_seconds);
}

// Seconds per call of enqueue(i): a CUDA graph of `launches` calls (i = 0..launches-1), median
// of `replays` replays after two warm-up replays (and WarmUp). With `spread`, also max / min of
// the replays.
inline double TimeGraph(cudaStream_t stream, int launches,
                        const std::function<void(int)>& enqueue, int replays,
                        double* spread = nullptr) {
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CHECK_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  for (int i = 0; i < launches; ++i) enqueue(i);
  CHECK_CUDA(cudaStreamEndCapture(stream, &graph));
  CHECK_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  cudaEvent_t start, stop;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));
  for (int i = 0; i < 2; ++i) CHECK_CUDA(cudaGraphLaunch(exec, stream));
  WarmUp(stream, [&] { CHECK_CUDA(cudaGraphLaunch(exec, stream)); });
  std::vector<double> seconds;
  for (int r = 0; r < replays; ++r) {
    CHECK_CUDA(cudaEventRecord(start, stream));
    CHECK_CUDA(cudaGraphLaunch(exec, stream));
    CHECK_CUDA(cudaEventRecord(stop, stream));
    CHECK_CUDA(cudaEventSynchronize(stop));
    float ms = 0;
    CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
    seconds.push_back(ms * 1e-3 / launches);
  }
  if (spread != nullptr) {
    *spread = *std::max_element(seconds.begin(), seconds.end()) /
              *std::min_element(seconds.begin(), seconds.end());
  }
  CHECK_CUDA(cudaEventDestroy(start));
  CHECK_CUDA(cudaEventDestroy(stop));
  CHECK_CUDA(cudaGraphExecDestroy(exec));
  CHECK_CUDA(cudaGraphDestroy(graph));
  return Median(seconds);
}

// Milliseconds per call of launch(i) without a graph: `reps` timed groups of `inner` calls
// (i counts every call), the median group's time / inner; after WarmUp over the first group.
template <typename F>
float MedianMs(int reps, int inner, F&& launch, cudaStream_t stream) {
  WarmUp(stream, [&] {
    for (int i = 0; i < inner; ++i) launch(i);
  });
  cudaEvent_t start, stop;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));
  std::vector<float> times;
  for (int r = 0; r < reps; ++r) {
    CHECK_CUDA(cudaEventRecord(start, stream));
    for (int i = 0; i < inner; ++i) launch(r * inner + i);
    CHECK_CUDA(cudaEventRecord(stop, stream));
    CHECK_CUDA(cudaEventSynchronize(stop));
    float ms = 0;
    CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
    times.push_back(ms / inner);
  }
  CHECK_CUDA(cudaEventDestroy(start));
  CHECK_CUDA(cudaEventDestroy(stop));
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

// The copy bandwidth a kernel is measured against, in the same run: bytes read + bytes written
// per second of a 1 GiB device-to-device copy, by cudaMemcpyAsync and by CopyWithKernel.
struct CopyBandwidths {
  double memcpy = 0;
  double kernel = 0;
  double reference() const { return std::max(memcpy, kernel); }
};

inline CopyBandwidths MeasureCopy(cudaStream_t stream, int replays = 15) {
  const size_t bytes = size_t{1} << 30;
  DeviceMemory source(bytes), target(bytes);
  CHECK_CUDA(FillRandom(source.get(), DType::kFloat32, bytes / 4, 1, 1.0f, stream));
  CopyBandwidths result;
  result.memcpy = 2.0 * bytes / TimeGraph(stream, 4, [&](int) {
    CHECK_CUDA(cudaMemcpyAsync(target.get(), source.get(), bytes, cudaMemcpyDeviceToDevice, stream));
  }, replays);
  result.kernel = 2.0 * bytes / TimeGraph(stream, 4, [&](int) {
    CHECK_CUDA(CopyWithKernel(target.get(), source.get(), bytes, stream));
  }, replays);
  return result;
}

}  // namespace attnd::bench
