// Prefill benchmark (PERFORMANCE.md, case "prefill"): causal batch prefill at the standard shape
// (Hq 32, Hkv 8, D 128, bf16 q and KV, NHD, page 16) for one request of q = kv = 512, 2048,
// 8192 and a batch of 8 x 2048, plus the same shapes without the causal mask. Reports the
// median time, TFLOP/s (4 * q * kv * D per query head, halved for causal) and the fraction of a
// cuBLAS bf16 matrix product's rate measured in the same run.
//
// Each case is checked against the float64 CPU reference first (on its last 64 query tokens:
// with the bottom-right causal alignment they are a chunked prefill over the whole KV), and
// timed over enough input copies that the working set exceeds L2.
//
// --kernel=auto|mma|hopper picks the kernel (auto: what the planner picks on this device; the
// Hopper kernel on sm_90 for these shapes). Output: a human table on stdout and, with
// --csv=PATH, one line per case for tests/bench/torch_prefill_baseline.py to join with the torch
// times. --warm_ms=N runs N ms of each case's launches before timing it (bench_util.h, WarmUp).
// --qo_heads=N --kv_heads=N --head_dim=N --page_size=N change the shape (every case);
// --cases=c1x2048,n8x512,... replaces the case list (c causal, n not; batch x length).
// --on_demand: the Hopper kernel's CTAs take works from a counter (BatchPrefillArgs::
// works_on_demand) instead of each from its fixed place in the plan's layout.
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "attnd/kernels/cuda/prefill.h"
#include "bench_util.h"
#include "plan/prefill_plan.h"
#include "reference/attention.h"

namespace attnd {
namespace {

using bench::MedianMs;

bench::Shape g_shape;  // --qo_heads, --kv_heads, --head_dim, --page_size
bool g_on_demand = false;  // --on_demand
constexpr int64_t kL2RotationBytes = 200ll << 20;  // 4x the H100's 50 MB L2
constexpr int32_t kCheckedTokens = 64;

void FillRandomBf16(std::vector<uint16_t>& host, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (uint16_t& value : host) value = FloatToBFloat16(normal(rng));
}

// Measured bf16 tensor-core rate: an 8192^3 cuBLAS product on random data, median of 20.
double MatmulPeakTflops(cudaStream_t stream) {
  constexpr int n = 8192;
  std::vector<uint16_t> host(static_cast<size_t>(n) * n);
  std::mt19937 rng(3);
  FillRandomBf16(host, rng);
  void *a, *b, *c;
  CHECK_CUDA(cudaMalloc(&a, host.size() * 2));
  CHECK_CUDA(cudaMalloc(&b, host.size() * 2));
  CHECK_CUDA(cudaMalloc(&c, host.size() * 2));
  CHECK_CUDA(cudaMemcpy(a, host.data(), host.size() * 2, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(b, host.data(), host.size() * 2, cudaMemcpyHostToDevice));
  cublasHandle_t handle;
  if (cublasCreate(&handle) != CUBLAS_STATUS_SUCCESS) std::exit(1);
  cublasSetStream(handle, stream);
  const float alpha = 1.0f, beta = 0.0f;
  auto gemm = [&](int) {
    if (cublasGemmEx(handle, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &alpha, a, CUDA_R_16BF, n, b, CUDA_R_16BF, n,
                     &beta, c, CUDA_R_16BF, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT) != CUBLAS_STATUS_SUCCESS) {
      std::fprintf(stderr, "cublasGemmEx failed\n");
      std::exit(1);
    }
  };
  for (int i = 0; i < 3; ++i) gemm(0);
  const float ms = MedianMs(20, 1, gemm, stream);
  cublasDestroy(handle);
  CHECK_CUDA(cudaFree(a));
  CHECK_CUDA(cudaFree(b));
  CHECK_CUDA(cudaFree(c));
  return 2.0 * n * n * static_cast<double>(n) / (ms * 1e-3) / 1e12;
}

struct Case {
  std::string name;
  int32_t batch;
  int32_t length;  // q = kv
  bool causal;
};

struct Result {
  Case shape;
  float ms;
  double tflops;
  double relative_error;
};

// One input set: q, K and V pools, o, on the device. Pages are handed out in a shuffled order.
struct DeviceSet {
  void* q;
  void* k_pool;
  void* v_pool;
  void* o;
};

Result RunCase(const Case& shape, plan::PrefillKernel kernel, cudaStream_t stream) {
  const int32_t batch = shape.batch, length = shape.length;
  const int64_t rows = int64_t{batch} * length;
  const int32_t pages_per_request = (length + g_shape.page_size - 1) / g_shape.page_size;
  const int64_t num_pages = int64_t{batch} * pages_per_request;
  const int64_t q_elements = rows * g_shape.qo_heads * g_shape.head_dim;
  const int64_t pool_elements = num_pages * g_shape.page_size * g_shape.kv_heads * g_shape.head_dim;
  const int64_t set_bytes = (2 * q_elements + 2 * pool_elements) * 2;
  const int num_sets = static_cast<int>(std::max<int64_t>(1, (kL2RotationBytes + set_bytes - 1) / set_bytes));

  std::mt19937 rng(static_cast<uint32_t>(length * 131 + batch));
  std::vector<int32_t> qo_indptr(batch + 1), kv_lengths(batch, length), page_indptr(batch + 1),
      last_page_len(batch, length - (pages_per_request - 1) * g_shape.page_size), page_ids(num_pages);
  for (int32_t b = 0; b <= batch; ++b) {
    qo_indptr[b] = b * length;
    page_indptr[b] = b * pages_per_request;
  }
  std::iota(page_ids.begin(), page_ids.end(), 0);
  std::shuffle(page_ids.begin(), page_ids.end(), rng);

  std::vector<uint16_t> q_host(q_elements), k_host(pool_elements), v_host(pool_elements);
  FillRandomBf16(q_host, rng);
  FillRandomBf16(k_host, rng);
  FillRandomBf16(v_host, rng);
  std::vector<DeviceSet> sets(num_sets);
  for (DeviceSet& set : sets) {
    CHECK_CUDA(cudaMalloc(&set.q, q_elements * 2));
    CHECK_CUDA(cudaMalloc(&set.k_pool, pool_elements * 2));
    CHECK_CUDA(cudaMalloc(&set.v_pool, pool_elements * 2));
    CHECK_CUDA(cudaMalloc(&set.o, q_elements * 2));
    CHECK_CUDA(cudaMemcpy(set.q, q_host.data(), q_elements * 2, cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemcpy(set.k_pool, k_host.data(), pool_elements * 2, cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemcpy(set.v_pool, v_host.data(), pool_elements * 2, cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemset(set.o, 0xff, q_elements * 2));
  }
  auto upload = [](const std::vector<int32_t>& host) {
    void* device;
    CHECK_CUDA(cudaMalloc(&device, host.size() * sizeof(int32_t)));
    CHECK_CUDA(cudaMemcpy(device, host.data(), host.size() * sizeof(int32_t), cudaMemcpyHostToDevice));
    return static_cast<const int32_t*>(device);
  };
  const int32_t* d_qo_indptr = upload(qo_indptr);
  const int32_t* d_page_indptr = upload(page_indptr);
  const int32_t* d_page_ids = upload(page_ids);
  const int32_t* d_last = upload(last_page_len);

  auto waves = cuda::BatchPrefillCtasPerWave(g_shape.head_dim, DType::kBFloat16, DType::kBFloat16);
  CHECK_OK(waves.status());
  plan::PrefillPlanInput input;
  input.qo_indptr = qo_indptr;
  input.kv_lengths = kv_lengths;
  input.num_qo_heads = g_shape.qo_heads;
  input.num_kv_heads = g_shape.kv_heads;
  input.head_dim = g_shape.head_dim;
  input.causal = shape.causal;
  input.ctas_per_wave = *waves;
  input.kernel = kernel;
  auto plan = plan::PlanPrefill(input);
  CHECK_OK(plan.status());
  std::printf("  plan: %s", plan->DebugString().c_str());
  const int64_t workspace_bytes = cuda::BatchPrefillWorkspaceBytes(*plan);
  void* workspace;
  CHECK_CUDA(cudaMalloc(&workspace, std::max<int64_t>(workspace_bytes, 16)));
  CHECK_OK(cuda::UploadBatchPrefillPlan(*plan, workspace, workspace_bytes, stream));

  cuda::BatchPrefillArgs args;
  args.qo_indptr = d_qo_indptr;
  args.pages = {batch, g_shape.page_size, d_page_indptr, d_page_ids, d_page_ids, d_last};
  args.params.causal = shape.causal;
  args.works_on_demand = g_on_demand;
  args.params.sm_scale = 1.0f / std::sqrt(static_cast<float>(g_shape.head_dim));
  auto set_views = [&](const DeviceSet& set) {
    args.q = {set.q, DType::kBFloat16, rows, g_shape.qo_heads, g_shape.head_dim};
    args.o = {set.o, DType::kBFloat16, rows, g_shape.qo_heads, g_shape.head_dim};
    args.k_cache = {set.k_pool, DType::kBFloat16, KvLayout::kNHD, num_pages, g_shape.page_size, g_shape.kv_heads, g_shape.head_dim};
    args.v_cache = {set.v_pool, DType::kBFloat16, KvLayout::kNHD, num_pages, g_shape.page_size, g_shape.kv_heads, g_shape.head_dim};
  };

  // Check: the last kCheckedTokens tokens of every request against the float64 reference.
  set_views(sets[0]);
  CHECK_OK(cuda::BatchPrefill(*plan, args, workspace, workspace_bytes, stream));
  CHECK_CUDA(cudaStreamSynchronize(stream));
  std::vector<uint16_t> o_host(q_elements);
  CHECK_CUDA(cudaMemcpy(o_host.data(), sets[0].o, q_elements * 2, cudaMemcpyDeviceToHost));
  const int32_t checked = std::min(kCheckedTokens, length);
  std::vector<int32_t> check_indptr(batch + 1);
  std::vector<uint16_t> check_q(int64_t{batch} * checked * g_shape.qo_heads * g_shape.head_dim);
  const int64_t row_elements = int64_t{g_shape.qo_heads} * g_shape.head_dim;
  for (int32_t b = 0; b < batch; ++b) {
    check_indptr[b + 1] = (b + 1) * checked;
    std::memcpy(check_q.data() + int64_t{b} * checked * row_elements,
                q_host.data() + (int64_t{qo_indptr[b + 1]} - checked) * row_elements,
                checked * row_elements * 2);
  }
  std::vector<float> want(check_q.size());
  reference::BatchAttentionArgs ref;
  ref.q = {check_q.data(), DType::kBFloat16, int64_t{batch} * checked, g_shape.qo_heads, g_shape.head_dim};
  ref.qo_indptr = check_indptr.data();
  ref.pages = {batch, g_shape.page_size, page_indptr.data(), page_ids.data(), page_ids.data(), last_page_len.data()};
  ref.k_cache = {k_host.data(), DType::kBFloat16, KvLayout::kNHD, num_pages, g_shape.page_size, g_shape.kv_heads, g_shape.head_dim};
  ref.v_cache = {v_host.data(), DType::kBFloat16, KvLayout::kNHD, num_pages, g_shape.page_size, g_shape.kv_heads, g_shape.head_dim};
  ref.params = args.params;
  ref.o = {want.data(), DType::kFloat32, int64_t{batch} * checked, g_shape.qo_heads, g_shape.head_dim};
  ref.accumulation = reference::Accumulation::kFloat64;
  reference::BatchAttention(ref);
  double error_sq = 0, norm_sq = 0;
  for (int32_t b = 0; b < batch; ++b) {
    for (int64_t i = 0; i < checked * row_elements; ++i) {
      const double got = BFloat16ToFloat(o_host[(int64_t{qo_indptr[b + 1]} - checked) * row_elements + i]);
      const double expected = want[int64_t{b} * checked * row_elements + i];
      error_sq += std::isnan(got) ? 1e30 : (got - expected) * (got - expected);
      norm_sq += expected * expected;
    }
  }
  const double relative_error = std::sqrt(error_sq / norm_sq);
  if (!(relative_error <= 1e-2)) {
    std::fprintf(stderr, "%s: relative error %.3g against the reference: not timing a wrong kernel\n",
                 shape.name.c_str(), relative_error);
    std::exit(1);
  }

  auto launch = [&](int i) {
    set_views(sets[i % num_sets]);
    CHECK_OK(cuda::BatchPrefill(*plan, args, workspace, workspace_bytes, stream));
  };
  for (int i = 0; i < 3; ++i) launch(i);
  CHECK_CUDA(cudaStreamSynchronize(stream));
  // Launches per timed group: enough for ~2 ms so event resolution and launch gaps stay small.
  const float first_ms = MedianMs(3, 1, launch, stream);
  const int inner = std::max(1, static_cast<int>(2.0f / std::max(first_ms, 1e-3f)));
  const float ms = MedianMs(15, inner, launch, stream);
  CHECK_CUDA(cudaGetLastError());

  const double flops = 4.0 * rows * static_cast<double>(length) * g_shape.head_dim * g_shape.qo_heads * (shape.causal ? 0.5 : 1.0);
  Result result{shape, ms, flops / (ms * 1e-3) / 1e12, relative_error};

  for (DeviceSet& set : sets) {
    CHECK_CUDA(cudaFree(set.q));
    CHECK_CUDA(cudaFree(set.k_pool));
    CHECK_CUDA(cudaFree(set.v_pool));
    CHECK_CUDA(cudaFree(set.o));
  }
  for (const int32_t* p : {d_qo_indptr, d_page_indptr, d_page_ids, d_last}) CHECK_CUDA(cudaFree(const_cast<int32_t*>(p)));
  CHECK_CUDA(cudaFree(workspace));
  return result;
}

}  // namespace
}  // namespace attnd

int main(int argc, char** argv) {
  using namespace attnd;
  std::string csv_path;
  std::string only;
  std::string case_list;
  plan::PrefillKernel kernel = plan::PrefillKernel::kAuto;
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], "--csv=", 6) == 0) csv_path = argv[i] + 6;
    if (std::strncmp(argv[i], "--only=", 7) == 0) only = argv[i] + 7;
    if (std::strcmp(argv[i], "--kernel=mma") == 0) kernel = plan::PrefillKernel::kMmaSync;
    if (std::strcmp(argv[i], "--kernel=hopper") == 0) kernel = plan::PrefillKernel::kHopper;
    if (std::strncmp(argv[i], "--cases=", 8) == 0) case_list = argv[i] + 8;
    if (std::strcmp(argv[i], "--on_demand") == 0) g_on_demand = true;
    bench::ParseShapeFlag(argv[i], g_shape);
    bench::ParseWarmFlag(argv[i]);
  }
  if (!bench::CheckShape(g_shape, "prefill_bench")) return 2;
  int device = 0;
  CHECK_CUDA(cudaGetDevice(&device));
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, device));
  int driver = 0;
  CHECK_CUDA(cudaDriverGetVersion(&driver));
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreate(&stream));
  std::printf("device: %s, %d SMs, L2 %d MB, driver %d\n", prop.name, prop.multiProcessorCount,
              prop.l2CacheSize >> 20, driver);
  bench::PrintWarmUp();

  const double peak = MatmulPeakTflops(stream);
  std::printf("cuBLAS bf16 8192^3: %.1f TFLOP/s (the peak below); kernel: %s%s; Hq %d, Hkv %d, D %d, page %d\n",
              peak, plan::PrefillKernelName(kernel), g_on_demand ? " (works on demand)" : "", g_shape.qo_heads, g_shape.kv_heads, g_shape.head_dim, g_shape.page_size);
  std::vector<Case> cases = {
      {"causal 1x512", 1, 512, true},       {"causal 1x2048", 1, 2048, true},
      {"causal 1x8192", 1, 8192, true},     {"causal 8x2048", 8, 2048, true},
      {"noncausal 1x2048", 1, 2048, false}, {"noncausal 1x8192", 1, 8192, false},
  };
  if (!case_list.empty()) {
    cases.clear();
    for (const std::string& item : bench::SplitList(case_list)) {
      int batch = 0, length = 0;
      if (item.size() < 4 || (item[0] != 'c' && item[0] != 'n') ||
          std::sscanf(item.c_str() + 1, "%dx%d", &batch, &length) != 2 || batch <= 0 || length <= 0) {
        std::fprintf(stderr, "prefill_bench: --cases item '%s' is not c|n BATCHxLENGTH\n", item.c_str());
        return 2;
      }
      const bool causal = item[0] == 'c';
      cases.push_back({std::string(causal ? "causal " : "noncausal ") + std::to_string(batch) + "x" +
                           std::to_string(length),
                       batch, length, causal});
    }
  }
  std::FILE* csv = csv_path.empty() ? nullptr : std::fopen(csv_path.c_str(), "w");
  if (csv != nullptr) {
    std::fprintf(csv, "case,batch,length,causal,ms,tflops,peak_tflops,relative_error,qo_heads,kv_heads,head_dim\n");
  }
  std::printf("%-18s %10s %10s %8s %10s\n", "case", "ms", "TFLOP/s", "%peak", "rel.err");
  for (const Case& shape : cases) {
    if (!only.empty() && shape.name.find(only) == std::string::npos) continue;
    const Result result = RunCase(shape, kernel, stream);
    std::printf("%-18s %10.4f %10.1f %7.1f%% %10.2e\n", shape.name.c_str(), result.ms, result.tflops,
                100.0 * result.tflops / peak, result.relative_error);
    std::fflush(stdout);
    if (csv != nullptr) {
      std::fprintf(csv, "%s,%d,%d,%d,%.6f,%.3f,%.3f,%.3e,%d,%d,%d\n", shape.name.c_str(), shape.batch,
                   shape.length, shape.causal ? 1 : 0, result.ms, result.tflops, peak, result.relative_error,
                   g_shape.qo_heads, g_shape.kv_heads, g_shape.head_dim);
    }
  }
  if (csv != nullptr) std::fclose(csv);
  CHECK_CUDA(cudaStreamDestroy(stream));
  return 0;
}
