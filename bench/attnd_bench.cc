// attnd_bench: the decode and append kernel benchmarks of PERFORMANCE.md.
//
// Per case: build the inputs on the device (random, fixed seeds), enough independent input sets
// that one rotation exceeds the L2 (~200 MB), check the result of set 0 against the CPU
// reference with poisoned outputs, then time a CUDA graph of N launches rotating over the sets
// with events (median of the replays, divided by N). Each case reports its time and the
// fraction of the device-to-device copy bandwidth measured at the start of the same run.
//
//   attnd_bench [--decode] [--append] [--quick] [--variants] [--issue14] [--e2e] [--contiguous-pages]
//               [--decode-kernel=auto|cuda_core|tensor_core|all] [--csv=PATH] [--tc-max-chunk=N]
//               [--warm_ms=N] [--qo_heads=N] [--kv_heads=N] [--head_dim=N] [--page_size=N]
//               [--decode_cases=BATCHxLENGTH,...] [--kv_dtype=bf16|f16|fp8]
// (no case flag: both). --quick runs a reduced sweep; --variants adds decode cases with pinned
// chunk sizes next to the planner's choice; --issue14 runs only the decode shapes of issue 14's
// table; --e2e only short-context batches (the e2e shape's decode layers). --decode-kernel forces the decode kernel (default auto: the planner's choice); "all"
// runs every case with each of auto, cuda_core and tensor_core (names suffixed _auto, _cc, _tc).
// --contiguous-pages gives each request's decode pages in order (FlashInfer's measurement in
// issue 14 used contiguous page ids) instead of shuffled. --kv_dtype sets the decode cache's
// dtype (q and o stay bf16).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "attnd/kernels/cuda/append.h"
#include "attnd/kernels/cuda/decode.h"
#include "attnd/kernels/rope.h"
#include "bench_util.h"
#include "device_fill.h"
#include "plan/decode_plan.h"
#include "reference/append.h"
#include "reference/attention.h"

namespace attnd::bench {
namespace {

// --contiguous-pages: decode page tables in order instead of shuffled.
bool g_contiguous_pages = false;
// --tc-max-chunk=N: the planner's tensor-core chunk cap (0: none); -1 keeps its default.
int32_t g_tc_max_chunk = -1;
// --kv_dtype=bf16|f16|fp8: the decode cases' cache dtype (q and o stay bf16; the tensor-core
// kernel needs the cache in q's type, so other caches run the CUDA-core kernel).
DType g_kv_dtype = DType::kBFloat16;

using bench::DeviceMemory;
using bench::CopyToDevice;
using bench::Median;
using bench::TimeGraph;
using bench::CopyBandwidths;
using bench::MeasureCopy;

constexpr int64_t kRotationBytes = 200'000'000;  // 4x the H100's 50 MB L2
constexpr int kMaxSets = 64;
constexpr double kTargetGraphSeconds = 3e-3;
constexpr int kReplays = 15;

// The shape of every decode and append case (--qo_heads, --kv_heads, --head_dim, --page_size).
Shape g_shape;

int SetsFor(int64_t bytes_per_set) {
  return static_cast<int>(std::clamp<int64_t>((kRotationBytes + bytes_per_set - 1) / bytes_per_set, 1, kMaxSets));
}

// Launches per graph: a few milliseconds of work, a multiple of the set count.
int LaunchesFor(double estimated_seconds, int sets) {
  int launches = static_cast<int>(std::ceil(kTargetGraphSeconds / std::max(estimated_seconds, 1e-6)));
  launches = std::clamp(launches, 3, 400);
  return (launches + sets - 1) / sets * sets;
}

bool FitsInMemory(size_t bytes) {
  size_t free_bytes = 0, total_bytes = 0;
  CHECK_CUDA(cudaMemGetInfo(&free_bytes, &total_bytes));
  return bytes + (size_t{1} << 30) < free_bytes;
}

struct Result {
  std::string kind;
  std::string name;
  int32_t batch = 0;
  int64_t kv_len = 0;  // mean for mixed lengths
  int64_t max_kv_len = 0;
  int64_t tokens = 0;
  double bytes = 0;
  double seconds = 0;
  std::string note;
};

// ---------------------------------------------------------------------------------------------
// Decode

struct DecodeSpec {
  std::string name;
  std::vector<int64_t> lengths;
  int32_t fixed_split_tokens = 0;  // variants: a pinned chunk instead of the planner's
  plan::DecodeKernelChoice kernel = plan::DecodeKernelChoice::kAuto;
};

// Both decode kernels' waves for the standard shape (measured occupancy x SMs).
struct DecodeWaves {
  int32_t cuda_core = 0;
  int32_t tensor_core = 0;
};

// Normwise relative error of GPU rows (bf16) against the float64 reference for a few requests,
// read back from the device pools.
double CheckDecode(const std::vector<int64_t>& lengths, const std::vector<int32_t>& indptr,
                   const std::vector<int32_t>& k_indices, const DeviceMemory& k_pool,
                   const DeviceMemory& v_pool, const DeviceMemory& q, const DeviceMemory& o,
                   const AttentionParams& params) {
  const int32_t batch = static_cast<int32_t>(lengths.size());
  const std::vector<int32_t> picks = batch > 1 ? std::vector<int32_t>{0, batch - 1} : std::vector<int32_t>{0};
  const int64_t page_bytes = int64_t{g_shape.page_size} * g_shape.kv_heads * g_shape.head_dim * DTypeBytes(g_kv_dtype);
  const int64_t row_elements = int64_t{g_shape.qo_heads} * g_shape.head_dim;
  std::vector<int32_t> host_indptr = {0}, host_pages, last_page_len;
  std::vector<uint8_t> host_k, host_v, host_q, gpu_o;
  for (int32_t b : picks) {
    const int32_t pages = indptr[b + 1] - indptr[b];
    for (int32_t p = 0; p < pages; ++p) {
      const int64_t page = k_indices[indptr[b] + p];
      const size_t at = host_k.size();
      host_k.resize(at + page_bytes);
      host_v.resize(at + page_bytes);
      CHECK_CUDA(cudaMemcpy(host_k.data() + at, k_pool.get<uint8_t>() + page * page_bytes, page_bytes, cudaMemcpyDeviceToHost));
      CHECK_CUDA(cudaMemcpy(host_v.data() + at, v_pool.get<uint8_t>() + page * page_bytes, page_bytes, cudaMemcpyDeviceToHost));
      host_pages.push_back(static_cast<int32_t>(host_pages.size()));
    }
    host_indptr.push_back(static_cast<int32_t>(host_pages.size()));
    last_page_len.push_back(pages == 0 ? 0 : static_cast<int32_t>(lengths[b] - int64_t{pages - 1} * g_shape.page_size));
    const size_t at = host_q.size();
    host_q.resize(at + row_elements * 2);
    gpu_o.resize(at + row_elements * 2);
    CHECK_CUDA(cudaMemcpy(host_q.data() + at, q.get<uint8_t>() + b * row_elements * 2, row_elements * 2, cudaMemcpyDeviceToHost));
    CHECK_CUDA(cudaMemcpy(gpu_o.data() + at, o.get<uint8_t>() + b * row_elements * 2, row_elements * 2, cudaMemcpyDeviceToHost));
  }
  const int32_t rows = static_cast<int32_t>(picks.size());
  std::vector<int32_t> qo_indptr(rows + 1);
  std::iota(qo_indptr.begin(), qo_indptr.end(), 0);
  std::vector<float> ref_o(rows * row_elements);
  reference::BatchAttentionArgs args;
  args.q = TokenHeadsView{host_q.data(), DType::kBFloat16, rows, g_shape.qo_heads, g_shape.head_dim};
  args.qo_indptr = qo_indptr.data();
  args.pages = PageTableView{rows, g_shape.page_size, host_indptr.data(), host_pages.data(), host_pages.data(), last_page_len.data()};
  args.k_cache = PagedKvView{host_k.data(), g_kv_dtype, KvLayout::kNHD,
                             static_cast<int64_t>(host_pages.size()), g_shape.page_size, g_shape.kv_heads, g_shape.head_dim};
  args.v_cache = args.k_cache;
  args.v_cache.data = host_v.data();
  args.params = params;
  args.o = TokenHeadsView{ref_o.data(), DType::kFloat32, rows, g_shape.qo_heads, g_shape.head_dim};
  args.accumulation = reference::Accumulation::kFloat64;
  reference::BatchAttention(args);
  double diff = 0, norm = 0;
  for (int64_t i = 0; i < rows * row_elements; ++i) {
    uint16_t bits;
    std::memcpy(&bits, gpu_o.data() + i * 2, 2);
    const double value = BFloat16ToFloat(bits);
    diff += (value - ref_o[i]) * (value - ref_o[i]);
    norm += double{ref_o[i]} * ref_o[i];
  }
  return std::isnan(diff) ? NAN : std::sqrt(diff / std::max(norm, 1e-30));
}

Result RunDecode(const DecodeSpec& spec, const DecodeWaves& waves, cudaStream_t stream) {
  Result result;
  result.kind = "decode";
  result.name = spec.name;
  result.batch = static_cast<int32_t>(spec.lengths.size());
  const int32_t batch = result.batch;
  int64_t total_tokens = 0, pages_per_set = 0;
  for (int64_t length : spec.lengths) {
    total_tokens += length;
    pages_per_set += (length + g_shape.page_size - 1) / g_shape.page_size;
  }
  result.kv_len = total_tokens / batch;
  result.max_kv_len = *std::max_element(spec.lengths.begin(), spec.lengths.end());
  const int kv_bytes = DTypeBytes(g_kv_dtype);
  const int64_t page_bytes = int64_t{g_shape.page_size} * g_shape.kv_heads * g_shape.head_dim * kv_bytes;
  const int64_t row_bytes = int64_t{g_shape.qo_heads} * g_shape.head_dim * 2;
  // Bytes a decode must move: every K and V byte once (at the cache dtype), q read once, o
  // written once.
  const int64_t bytes = total_tokens * g_shape.kv_heads * g_shape.head_dim * kv_bytes * 2 + 2 * batch * row_bytes;
  result.bytes = static_cast<double>(bytes);
  const int sets = SetsFor(bytes);
  const size_t pool_bytes = static_cast<size_t>(sets * pages_per_set * page_bytes);
  if (!FitsInMemory(2 * pool_bytes)) {
    result.note = "skipped: does not fit";
    return result;
  }
  DeviceMemory k_pool(pool_bytes), v_pool(pool_bytes);
  DeviceMemory q(sets * batch * row_bytes), o(sets * batch * row_bytes);
  CHECK_CUDA(FillRandom(k_pool.get(), g_kv_dtype, pool_bytes / kv_bytes, 11, 1.0f, stream));
  CHECK_CUDA(FillRandom(v_pool.get(), g_kv_dtype, pool_bytes / kv_bytes, 12, 1.0f, stream));
  CHECK_CUDA(FillRandom(q.get(), DType::kBFloat16, sets * batch * row_bytes / 2, 13, 3.0f, stream));

  // Page tables: set s owns pages [s * pages_per_set, (s + 1) * pages_per_set), shuffled (in
  // order with --contiguous-pages, as FlashInfer's figures in issue 14 were measured).
  std::mt19937 rng(17);
  std::vector<int32_t> indptr = {0};
  for (int64_t length : spec.lengths) indptr.push_back(indptr.back() + static_cast<int32_t>((length + g_shape.page_size - 1) / g_shape.page_size));
  std::vector<std::vector<int32_t>> k_indices(sets);
  DeviceMemory indptr_device(indptr.size() * 4), indices_device(sets * pages_per_set * 4);
  CopyToDevice(indptr_device.get(), indptr);
  for (int s = 0; s < sets; ++s) {
    k_indices[s].resize(pages_per_set);
    std::iota(k_indices[s].begin(), k_indices[s].end(), static_cast<int32_t>(s * pages_per_set));
    if (!g_contiguous_pages) std::shuffle(k_indices[s].begin(), k_indices[s].end(), rng);
    CopyToDevice(indices_device.get<int32_t>() + s * pages_per_set, k_indices[s]);
  }

  std::vector<int32_t> qo_indptr(batch + 1);
  std::iota(qo_indptr.begin(), qo_indptr.end(), 0);
  plan::DecodePlanOptions options;
  options.num_kv_heads = g_shape.kv_heads;
  options.ctas_per_wave = waves.cuda_core;
  options.tensor_core_supported = waves.tensor_core > 0;  // (none for this shape: 0)
  options.tensor_core_ctas_per_wave = waves.tensor_core;
  options.kernel_choice = spec.kernel;
  options.fixed_split_tokens = spec.fixed_split_tokens;
  if (g_tc_max_chunk >= 0) options.tensor_core_max_chunk_tokens = g_tc_max_chunk;
  auto plan = plan::PlanBatchDecode(qo_indptr, spec.lengths, options);
  CHECK_OK(plan.status());
  const std::vector<int32_t> packed = plan->Pack();
  DeviceMemory packed_device(packed.size() * 4);
  CopyToDevice(packed_device.get(), packed);
  const int64_t workspace_bytes = cuda::BatchDecodeWorkspaceBytes(plan->num_partials, g_shape.qo_heads, g_shape.head_dim);
  DeviceMemory workspace(workspace_bytes);

  AttentionParams params;
  params.sm_scale = 1.0f / std::sqrt(static_cast<float>(g_shape.head_dim));
  std::vector<cuda::BatchDecodeArgs> args(sets);
  for (int s = 0; s < sets; ++s) {
    cuda::BatchDecodeArgs& a = args[s];
    a.q = TokenHeadsView{q.get<uint8_t>() + s * batch * row_bytes, DType::kBFloat16, batch, g_shape.qo_heads, g_shape.head_dim};
    a.pages = PageTableView{batch, g_shape.page_size, indptr_device.get<int32_t>(),
                            indices_device.get<int32_t>() + s * pages_per_set,
                            indices_device.get<int32_t>() + s * pages_per_set, nullptr};
    a.k_cache = PagedKvView{k_pool.get(), g_kv_dtype, KvLayout::kNHD, sets * pages_per_set, g_shape.page_size, g_shape.kv_heads, g_shape.head_dim};
    a.v_cache = a.k_cache;
    a.v_cache.data = v_pool.get();
    a.params = params;
    a.work = plan->View(packed_device.get<int32_t>());
    a.o = TokenHeadsView{o.get<uint8_t>() + s * batch * row_bytes, DType::kBFloat16, batch, g_shape.qo_heads, g_shape.head_dim};
    a.workspace = workspace.get();
    a.workspace_bytes = workspace_bytes;
  }

  // Correctness of set 0 first, with o poisoned (NaN).
  CHECK_CUDA(cudaMemsetAsync(o.get(), 0xff, o.bytes(), stream));
  CHECK_OK(cuda::BatchDecode(args[0], stream));
  CHECK_CUDA(cudaStreamSynchronize(stream));
  const double error = CheckDecode(spec.lengths, indptr, k_indices[0], k_pool, v_pool, q, o, params);
  char note[160];
  std::snprintf(note, sizeof note, "kernel=%s chunk=%d items=%d sets=%d err=%.1e%s",
                plan->kernel == plan::DecodeKernel::kTensorCore ? "tc" : "cc", plan->kv_chunk_tokens,
                plan->num_items(), sets, error, error <= 1e-2 ? "" : " FAILED CHECK");
  result.note = note;

  const double estimate = bytes / 2.5e12 + 5e-6;
  const int launches = LaunchesFor(estimate, sets);
  result.seconds = TimeGraph(stream, launches, [&](int i) { CHECK_OK(cuda::BatchDecode(args[i % sets], stream)); }, kReplays);
  return result;
}

// Pinned-chunk variants of the small-batch and mixed cases, to compare with the planner's choice.
std::vector<DecodeSpec> DecodeVariants(const std::vector<DecodeSpec>& specs) {
  std::vector<DecodeSpec> variants;
  for (const DecodeSpec& spec : specs) {
    const size_t batch = spec.lengths.size();
    if (batch > 256) continue;
    for (int32_t chunk : {64, 256, 512, 1024, 2048, 4096, 8192}) {
      if (batch == 1 && chunk > 512) continue;
      if (batch > 1 && chunk < 256) continue;
      if (batch > 16 && chunk < 1024) continue;
      DecodeSpec variant = spec;
      variant.name += "_fix" + std::to_string(chunk);
      variant.fixed_split_tokens = chunk;
      variants.push_back(variant);
    }
  }
  return variants;
}

// The decode rows of issue 14's table (FlashInfer's figures to beat), and PERFORMANCE.md's two
// further peer shapes (b128 x 8192, b256 x 4096).
std::vector<DecodeSpec> Issue14DecodeSpecs() {
  std::vector<DecodeSpec> specs;
  for (const auto& [batch, length] : {std::pair{1, 4096}, std::pair{1, 8192}, std::pair{16, 1024},
                                      std::pair{16, 4096}, std::pair{64, 4096}, std::pair{128, 4096},
                                      std::pair{128, 8192}, std::pair{256, 4096},
                                      std::pair{256, 32768}}) {
    specs.push_back({"b" + std::to_string(batch) + "_kv" + std::to_string(length),
                     std::vector<int64_t>(batch, length)});
  }
  return specs;
}

// Every spec once per kernel choice in `choices`, suffixed when there is more than one.
std::vector<DecodeSpec> WithKernels(const std::vector<DecodeSpec>& specs,
                                    const std::vector<plan::DecodeKernelChoice>& choices) {
  std::vector<DecodeSpec> out;
  for (const DecodeSpec& spec : specs) {
    for (plan::DecodeKernelChoice choice : choices) {
      DecodeSpec variant = spec;
      variant.kernel = choice;
      if (choices.size() > 1) {
        variant.name += choice == plan::DecodeKernelChoice::kAuto       ? "_auto"
                        : choice == plan::DecodeKernelChoice::kCudaCore ? "_cc"
                                                                        : "_tc";
      }
      out.push_back(variant);
    }
  }
  return out;
}

// The decode layers of PERFORMANCE.md's e2e shape (128 sequences, a 64-token prompt, then decode
// steps: 65 to ~120 keys each) and of its micro-batches, and other short-context batches (where
// the planner's choice between the CUDA-core and tensor-core kernels is made on few keys).
std::vector<DecodeSpec> E2eDecodeSpecs() {
  std::vector<DecodeSpec> specs;
  for (const auto& [batch, length] : {std::pair{128, 65}, std::pair{128, 117}, std::pair{64, 117},
                                      std::pair{32, 117}, std::pair{128, 256}, std::pair{128, 512},
                                      std::pair{256, 256}, std::pair{1, 512}, std::pair{1, 2048},
                                      std::pair{4, 512}, std::pair{8, 256}, std::pair{16, 128},
                                      std::pair{16, 256}, std::pair{32, 64}}) {
    specs.push_back({"b" + std::to_string(batch) + "_kv" + std::to_string(length),
                     std::vector<int64_t>(batch, length)});
  }
  return specs;
}

// --decode_cases=1x4096,16x1024,...: uniform batches (batch x kv length), named as the sweep names
// them (b1_kv4096). Empty on a malformed list.
std::vector<DecodeSpec> ListedDecodeSpecs(const std::string& list) {
  std::vector<DecodeSpec> specs;
  for (const std::string& item : SplitList(list)) {
    int batch = 0;
    long long length = 0;
    if (std::sscanf(item.c_str(), "%dx%lld", &batch, &length) != 2 || batch <= 0 || length <= 0) return {};
    specs.push_back({"b" + std::to_string(batch) + "_kv" + std::to_string(length),
                     std::vector<int64_t>(batch, length)});
  }
  return specs;
}

std::vector<DecodeSpec> DecodeSpecs(bool quick) {
  std::vector<DecodeSpec> specs;
  const std::vector<int32_t> batches = quick ? std::vector<int32_t>{1, 16, 64, 256} : std::vector<int32_t>{1, 16, 64, 128, 256};
  const std::vector<int64_t> lengths = quick ? std::vector<int64_t>{1024, 8192} : std::vector<int64_t>{1024, 4096, 8192, 32768};
  for (int32_t batch : batches) {
    for (int64_t length : lengths) {
      specs.push_back({"b" + std::to_string(batch) + "_kv" + std::to_string(length),
                       std::vector<int64_t>(batch, length)});
    }
  }
  // Mixed lengths: uniform in [1, 2 * mean], seed = batch.
  for (const auto& [batch, mean] : {std::pair{16, 4096}, std::pair{64, 4096}, std::pair{256, 4096}, std::pair{64, 1024}}) {
    std::mt19937 rng(batch);
    std::uniform_int_distribution<int64_t> uniform(1, 2 * int64_t{mean});
    DecodeSpec spec{"mixed_b" + std::to_string(batch) + "_mean" + std::to_string(mean), {}};
    for (int b = 0; b < batch; ++b) spec.lengths.push_back(uniform(rng));
    specs.push_back(spec);
  }
  return specs;
}

// ---------------------------------------------------------------------------------------------
// Append

struct AppendSpec {
  int64_t tokens;
  DType in_dtype;
  DType cache_dtype;
  bool rope = true;  // variants: false measures the same copy without rotation
};

Result RunAppend(const AppendSpec& spec, cudaStream_t stream) {
  Result result;
  result.kind = "append";
  result.name = std::string(spec.in_dtype == DType::kFloat16 ? "f16" : "bf16") + "->" +
                (spec.cache_dtype == DType::kFloat8E4M3 ? "fp8" : "bf16") + (spec.rope ? "" : "_norope") +
                "_t" + std::to_string(spec.tokens);
  result.tokens = spec.tokens;
  const int64_t tokens = spec.tokens;
  const int32_t batch = static_cast<int32_t>(std::min<int64_t>(tokens, 64));
  result.batch = batch;
  const int64_t per_request = tokens / batch;
  const int cache_bytes = DTypeBytes(spec.cache_dtype);
  std::vector<int64_t> prior(batch), total(batch);
  std::vector<int32_t> indptr = {0};
  for (int32_t b = 0; b < batch; ++b) {
    prior[b] = (b * 7) % g_shape.page_size;
    total[b] = prior[b] + per_request;
    indptr.push_back(indptr.back() + static_cast<int32_t>((total[b] + g_shape.page_size - 1) / g_shape.page_size));
  }
  const int64_t pages_per_set = indptr.back();
  const int64_t q_bytes = tokens * g_shape.qo_heads * g_shape.head_dim * 2;
  const int64_t kv_in_bytes = tokens * g_shape.kv_heads * g_shape.head_dim * 2;
  // q read and written, k and v read, k and v stored at the cache dtype.
  const int64_t bytes = 2 * q_bytes + 2 * kv_in_bytes + 2 * tokens * g_shape.kv_heads * g_shape.head_dim * cache_bytes;
  result.bytes = static_cast<double>(bytes);
  const int sets = SetsFor(bytes);
  const int64_t page_bytes = int64_t{g_shape.page_size} * g_shape.kv_heads * g_shape.head_dim * cache_bytes;
  DeviceMemory q_in(sets * q_bytes), q_out(sets * q_bytes), k_in(sets * kv_in_bytes), v_in(sets * kv_in_bytes);
  DeviceMemory k_pool(sets * pages_per_set * page_bytes), v_pool(sets * pages_per_set * page_bytes);
  CHECK_CUDA(FillRandom(q_in.get(), spec.in_dtype, sets * q_bytes / 2, 21, 4.0f, stream));
  CHECK_CUDA(FillRandom(k_in.get(), spec.in_dtype, sets * kv_in_bytes / 2, 22, 4.0f, stream));
  CHECK_CUDA(FillRandom(v_in.get(), spec.in_dtype, sets * kv_in_bytes / 2, 23, 4.0f, stream));
  CHECK_CUDA(cudaMemsetAsync(k_pool.get(), 0, k_pool.bytes(), stream));
  CHECK_CUDA(cudaMemsetAsync(v_pool.get(), 0, v_pool.bytes(), stream));

  std::vector<int32_t> batch_indices, positions;
  for (int32_t b = 0; b < batch; ++b) {
    for (int64_t t = prior[b]; t < total[b]; ++t) {
      batch_indices.push_back(b);
      positions.push_back(static_cast<int32_t>(t));
    }
  }
  DeviceMemory batch_device(tokens * 4), positions_device(tokens * 4), indptr_device(indptr.size() * 4);
  CopyToDevice(batch_device.get(), batch_indices);
  CopyToDevice(positions_device.get(), positions);
  CopyToDevice(indptr_device.get(), indptr);
  std::mt19937 rng(31);
  std::vector<std::vector<int32_t>> page_ids(sets);
  DeviceMemory pages_device(sets * pages_per_set * 4);
  for (int s = 0; s < sets; ++s) {
    page_ids[s].resize(pages_per_set);
    std::iota(page_ids[s].begin(), page_ids[s].end(), static_cast<int32_t>(s * pages_per_set));
    std::shuffle(page_ids[s].begin(), page_ids[s].end(), rng);
    CopyToDevice(pages_device.get<int32_t>() + s * pages_per_set, page_ids[s]);
  }
  RopeConfig rope;
  rope.style = spec.rope ? RopeStyle::kNeox : RopeStyle::kNone;
  rope.rotary_dim = g_shape.head_dim;
  rope.theta = 500000.0;
  const std::vector<float> inv_freq = RopeInverseFrequencies(rope);
  DeviceMemory inv_freq_device(inv_freq.size() * 4);
  CopyToDevice(inv_freq_device.get(), inv_freq);
  const float k_scale = spec.cache_dtype == DType::kFloat8E4M3 ? 0.05f : 1.0f;
  const float v_scale = k_scale;

  std::vector<cuda::AppendKvArgs> args(sets);
  for (int s = 0; s < sets; ++s) {
    cuda::AppendKvArgs& a = args[s];
    a.tokens = AppendIndexView{tokens, batch_device.get<int32_t>(), positions_device.get<int32_t>()};
    const int32_t* ids = pages_device.get<int32_t>() + s * pages_per_set;
    a.pages = PageTableView{batch, g_shape.page_size, indptr_device.get<int32_t>(), ids, ids, nullptr};
    a.rope_style = rope.style;
    a.rope_inv_freq = inv_freq_device.get<float>();
    a.rotary_dim = spec.rope ? g_shape.head_dim : 0;
    a.q_in = TokenHeadsView{q_in.get<uint8_t>() + s * q_bytes, spec.in_dtype, tokens, g_shape.qo_heads, g_shape.head_dim};
    a.q_out = TokenHeadsView{q_out.get<uint8_t>() + s * q_bytes, spec.in_dtype, tokens, g_shape.qo_heads, g_shape.head_dim};
    a.k_in = TokenHeadsView{k_in.get<uint8_t>() + s * kv_in_bytes, spec.in_dtype, tokens, g_shape.kv_heads, g_shape.head_dim};
    a.v_in = TokenHeadsView{v_in.get<uint8_t>() + s * kv_in_bytes, spec.in_dtype, tokens, g_shape.kv_heads, g_shape.head_dim};
    a.k_cache = PagedKvView{k_pool.get(), spec.cache_dtype, KvLayout::kNHD, sets * pages_per_set, g_shape.page_size, g_shape.kv_heads, g_shape.head_dim};
    a.v_cache = a.k_cache;
    a.v_cache.data = v_pool.get();
    a.k_scale = k_scale;
    a.v_scale = v_scale;
  }

  // Check set 0 against the reference: poisoned q_out, pools as they are (zeros).
  CHECK_CUDA(cudaMemsetAsync(q_out.get(), 0xff, q_bytes, stream));
  CHECK_OK(cuda::AppendKv(args[0], stream));
  CHECK_CUDA(cudaStreamSynchronize(stream));
  std::vector<uint8_t> host_q(q_bytes), host_k(kv_in_bytes), host_v(kv_in_bytes), gpu_q(q_bytes);
  const int64_t set_pool_bytes = pages_per_set * page_bytes;
  std::vector<uint8_t> gpu_k(set_pool_bytes), gpu_v(set_pool_bytes);
  CHECK_CUDA(cudaMemcpy(host_q.data(), q_in.get(), q_bytes, cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaMemcpy(host_k.data(), k_in.get(), kv_in_bytes, cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaMemcpy(host_v.data(), v_in.get(), kv_in_bytes, cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaMemcpy(gpu_q.data(), q_out.get(), q_bytes, cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaMemcpy(gpu_k.data(), k_pool.get(), set_pool_bytes, cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaMemcpy(gpu_v.data(), v_pool.get(), set_pool_bytes, cudaMemcpyDeviceToHost));
  std::vector<uint8_t> ref_q(q_bytes, 0xff), ref_k(set_pool_bytes, 0), ref_v(set_pool_bytes, 0);
  reference::AppendArgs ref;
  ref.tokens = AppendIndexView{tokens, batch_indices.data(), positions.data()};
  ref.pages = PageTableView{batch, g_shape.page_size, indptr.data(), page_ids[0].data(), page_ids[0].data(), nullptr};
  ref.rope_style = rope.style;
  ref.rope_inv_freq = inv_freq;
  ref.q_in = TokenHeadsView{host_q.data(), spec.in_dtype, tokens, g_shape.qo_heads, g_shape.head_dim};
  ref.q_out = TokenHeadsView{ref_q.data(), spec.in_dtype, tokens, g_shape.qo_heads, g_shape.head_dim};
  ref.k_in = TokenHeadsView{host_k.data(), spec.in_dtype, tokens, g_shape.kv_heads, g_shape.head_dim};
  ref.v_in = TokenHeadsView{host_v.data(), spec.in_dtype, tokens, g_shape.kv_heads, g_shape.head_dim};
  ref.k_cache = PagedKvView{ref_k.data(), spec.cache_dtype, KvLayout::kNHD, pages_per_set, g_shape.page_size, g_shape.kv_heads, g_shape.head_dim};
  ref.v_cache = ref.k_cache;
  ref.v_cache.data = ref_v.data();
  ref.k_scale = k_scale;
  ref.v_scale = v_scale;
  reference::AppendKv(ref);
  // Elements more than one code apart beyond a rotation's rounding (cos/sin on the GPU and the
  // host may differ by an ulp, which can move a rounding where the rotation cancels).
  auto far = [](const std::vector<uint8_t>& a, const std::vector<uint8_t>& b, DType dtype,
                double tolerance) {
    const int element_bytes = DTypeBytes(dtype);
    int64_t count = 0;
    for (size_t i = 0; i < a.size(); i += element_bytes) {
      int64_t x = 0, y = 0;
      if (element_bytes == 1) {
        x = (a[i] & 0x80) ? -(a[i] & 0x7f) : (a[i] & 0x7f);
        y = (b[i] & 0x80) ? -(b[i] & 0x7f) : (b[i] & 0x7f);
      } else {
        uint16_t p, r;
        std::memcpy(&p, &a[i], 2);
        std::memcpy(&r, &b[i], 2);
        x = (p & 0x8000) ? -(p & 0x7fff) : (p & 0x7fff);
        y = (r & 0x8000) ? -(r & 0x7fff) : (r & 0x7fff);
      }
      if (std::abs(x - y) <= 1) continue;
      const double difference = std::fabs(double{LoadAsFloat(dtype, &a[i], 0)} - LoadAsFloat(dtype, &b[i], 0));
      count += !(difference <= tolerance);
    }
    return count;
  };
  const double tolerance = 16 * 0x1p-24 * 4.0;  // inputs are in [-4, 4)
  const int64_t mismatches = far(gpu_q, ref_q, spec.in_dtype, tolerance) +
                             far(gpu_k, ref_k, spec.cache_dtype, tolerance / k_scale) +
                             far(gpu_v, ref_v, spec.cache_dtype, tolerance / v_scale);
  char note[160];
  std::snprintf(note, sizeof note, "sets=%d far_elements=%lld%s", sets, static_cast<long long>(mismatches),
                mismatches == 0 ? "" : " FAILED CHECK");
  result.note = note;

  const double estimate = bytes / 2.5e12 + 4e-6;
  const int launches = LaunchesFor(estimate, sets);
  result.seconds = TimeGraph(stream, launches, [&](int i) { CHECK_OK(cuda::AppendKv(args[i % sets], stream)); }, kReplays);
  return result;
}

// ---------------------------------------------------------------------------------------------

void PrintDevice() {
  int device = 0, sms = 0, l2 = 0, clock_khz = 0, memory_khz = 0, driver = 0, runtime = 0;
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDevice(&device));
  CHECK_CUDA(cudaGetDeviceProperties(&prop, device));
  CHECK_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  CHECK_CUDA(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, device));
  cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, device);
  cudaDeviceGetAttribute(&memory_khz, cudaDevAttrMemoryClockRate, device);
  CHECK_CUDA(cudaDriverGetVersion(&driver));
  CHECK_CUDA(cudaRuntimeGetVersion(&runtime));
  std::printf("device: %s, %d SMs, L2 %d MB, peak SM clock %d MHz, memory clock %d MHz, driver %d, runtime %d\n",
              prop.name, sms, l2 >> 20, clock_khz / 1000, memory_khz / 1000, driver, runtime);
}

int Main(int argc, char** argv) {
  bool decode = false, append = false, quick = false, variants = false, issue14 = false, e2e = false;
  std::vector<plan::DecodeKernelChoice> kernels = {plan::DecodeKernelChoice::kAuto};
  std::string csv_path;
  std::string decode_cases;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--decode") {
      decode = true;
    } else if (arg == "--append") {
      append = true;
    } else if (arg == "--quick") {
      quick = true;
    } else if (arg == "--variants") {
      variants = true;
    } else if (arg == "--contiguous-pages") {
      g_contiguous_pages = true;
    } else if (arg == "--issue14") {
      issue14 = true;
      decode = true;
    } else if (arg == "--e2e") {
      e2e = true;
      decode = true;
    } else if (arg == "--decode-kernel=auto") {
      kernels = {plan::DecodeKernelChoice::kAuto};
    } else if (arg == "--decode-kernel=cuda_core") {
      kernels = {plan::DecodeKernelChoice::kCudaCore};
    } else if (arg == "--decode-kernel=tensor_core") {
      kernels = {plan::DecodeKernelChoice::kTensorCore};
    } else if (arg == "--decode-kernel=all") {
      kernels = {plan::DecodeKernelChoice::kAuto, plan::DecodeKernelChoice::kCudaCore,
                 plan::DecodeKernelChoice::kTensorCore};
    } else if (arg.rfind("--tc-max-chunk=", 0) == 0) {
      g_tc_max_chunk = std::atoi(arg.c_str() + 15);
    } else if (arg == "--kv_dtype=bf16" || arg == "--kv_dtype=f16" || arg == "--kv_dtype=fp8") {
      g_kv_dtype = arg == "--kv_dtype=bf16" ? DType::kBFloat16
                   : arg == "--kv_dtype=f16" ? DType::kFloat16
                                             : DType::kFloat8E4M3;
    } else if (arg.rfind("--csv=", 0) == 0) {
      csv_path = arg.substr(6);
    } else if (arg.rfind("--decode_cases=", 0) == 0) {
      decode_cases = arg.substr(15);
      decode = true;
    } else if (!ParseShapeFlag(arg.c_str(), g_shape) && !ParseWarmFlag(arg.c_str())) {
      std::fprintf(stderr,
                   "usage: attnd_bench [--decode] [--append] [--quick] [--variants] [--issue14] [--e2e]\n"
                   "                   [--contiguous-pages] [--tc-max-chunk=N] [--warm_ms=N]\n"
                   "                   [--decode-kernel=auto|cuda_core|tensor_core|all] [--csv=PATH]\n"
                   "                   [--qo_heads=N] [--kv_heads=N] [--head_dim=N] [--page_size=N]\n"
                   "                   [--decode_cases=BATCHxLENGTH,...] [--kv_dtype=bf16|f16|fp8]\n");
      return 2;
    }
  }
  if (!CheckShape(g_shape, "attnd_bench")) return 2;
  if (!decode && !append) decode = append = true;
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    std::fprintf(stderr, "attnd_bench: no CUDA device\n");
    return 1;
  }
  PrintDevice();
  PrintWarmUp();
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const CopyBandwidths copy = MeasureCopy(stream);
  const double copy_bandwidth = copy.reference();
  std::printf("copy bandwidth (1 GiB D2D, read + write): cudaMemcpy %.3f TB/s, copy kernel %.3f TB/s; "
              "%%copy below is against the larger, %.3f TB/s\n",
              copy.memcpy / 1e12, copy.kernel / 1e12, copy_bandwidth / 1e12);

  std::vector<Result> results;
  auto report = [&](const Result& r) {
    const double fraction = r.seconds > 0 ? r.bytes / r.seconds / copy_bandwidth : 0;
    std::printf("%-7s %-22s %10.2f us %8.3f TB/s %6.1f%%  %s\n", r.kind.c_str(), r.name.c_str(),
                r.seconds * 1e6, r.seconds > 0 ? r.bytes / r.seconds / 1e12 : 0.0, 100 * fraction,
                r.note.c_str());
    std::fflush(stdout);
    results.push_back(r);
  };
  if (decode) {
    const cuda::DecodeKernelConfig config{DType::kBFloat16, g_kv_dtype, g_shape.head_dim, g_shape.qo_heads / g_shape.kv_heads};
    auto ctas = cuda::DecodeCtasPerWave(config);
    CHECK_OK(ctas.status());
    // No tensor-core kernel for some shapes (group < 4, say): the CUDA-core kernel alone.
    auto tensor_ctas = cuda::TensorCoreDecodeCtasPerWave(config);
    const DecodeWaves waves{*ctas, tensor_ctas.ok() ? *tensor_ctas : 0};
    std::printf("decode: Hq %d Hkv %d D %d, q bf16, cache %s NHD page %d; CTAs per wave (measured occupancy x SMs): "
                "CUDA-core kernel %d, tensor-core kernel %d\n",
                g_shape.qo_heads, g_shape.kv_heads, g_shape.head_dim, DTypeName(g_kv_dtype), g_shape.page_size,
                waves.cuda_core, waves.tensor_core);
    const std::vector<DecodeSpec> specs = !decode_cases.empty() ? ListedDecodeSpecs(decode_cases)
                                          : issue14                ? Issue14DecodeSpecs()
                                          : e2e                    ? E2eDecodeSpecs()
                                                                   : DecodeSpecs(quick);
    if (specs.empty()) {
      std::fprintf(stderr, "attnd_bench: --decode_cases wants BATCHxLENGTH,...\n");
      return 2;
    }
    for (const DecodeSpec& spec : WithKernels(specs, kernels)) report(RunDecode(spec, waves, stream));
    if (variants) {
      for (const DecodeSpec& spec : WithKernels(DecodeVariants(specs), kernels)) {
        report(RunDecode(spec, waves, stream));
      }
    }
  }
  if (append) {
    std::printf("append: Hq %d Hkv %d D %d, neox RoPE, NHD page %d (q rotated into q_out)\n", g_shape.qo_heads,
                g_shape.kv_heads, g_shape.head_dim, g_shape.page_size);
    const std::vector<int64_t> token_counts = quick ? std::vector<int64_t>{1, 1024, 16384}
                                                    : std::vector<int64_t>{1, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384};
    for (const auto& [in_dtype, cache_dtype] : {std::pair{DType::kFloat16, DType::kFloat8E4M3},
                                                std::pair{DType::kBFloat16, DType::kBFloat16}}) {
      for (int64_t tokens : token_counts) report(RunAppend({tokens, in_dtype, cache_dtype}, stream));
    }
    if (variants) {
      for (int64_t tokens : {int64_t{4096}, int64_t{16384}}) {
        report(RunAppend({tokens, DType::kBFloat16, DType::kBFloat16, /*rope=*/false}, stream));
      }
    }
  }
  if (!csv_path.empty()) {
    FILE* file = std::fopen(csv_path.c_str(), "w");
    if (file == nullptr) {
      std::fprintf(stderr, "cannot write %s\n", csv_path.c_str());
      return 1;
    }
    std::fprintf(file, "kind,name,batch,kv_len,max_kv_len,tokens,bytes,time_us,tbps,copy_tbps,frac_copy,note\n");
    for (const Result& r : results) {
      std::fprintf(file, "%s,%s,%d,%lld,%lld,%lld,%.0f,%.3f,%.4f,%.4f,%.4f,%s\n", r.kind.c_str(), r.name.c_str(),
                   r.batch, static_cast<long long>(r.kv_len), static_cast<long long>(r.max_kv_len),
                   static_cast<long long>(r.tokens), r.bytes,
                   r.seconds * 1e6, r.seconds > 0 ? r.bytes / r.seconds / 1e12 : 0.0, copy_bandwidth / 1e12,
                   r.seconds > 0 ? r.bytes / r.seconds / copy_bandwidth : 0.0, r.note.c_str());
    }
    std::fclose(file);
  }
  CHECK_CUDA(cudaStreamDestroy(stream));
  for (const Result& r : results) {
    if (r.note.find("FAILED") != std::string::npos) return 1;
  }
  return 0;
}

}  // namespace
}  // namespace attnd::bench

int main(int argc, char** argv) { return attnd::bench::Main(argc, argv); }
