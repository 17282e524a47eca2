// POD benchmark (PERFORMANCE.md, case "pod"): the five reference mixed batches (prefill requests
// x q/kv length, with 128 decode requests x kv length) at the standard shape (Hq 32, Hkv 8,
// D 128, bf16 q and KV, NHD), page sizes 1 and 16. Per case and page size:
//   fused     POD: one grid of prefill and decode CTAs (cuda::PodAttention)
//   b2b       the decode kernel (the planner's choice, tensor cores where the device has them)
//             then the prefill kernel (kAuto: Hopper on sm_90) back to back, as the CUDA backend
//             runs a mixed step without POD
//   b2b-mma   the same with the mma.sync prefill kernel (the tile code POD runs)
//   merged    one batch prefill plan over every request (kAuto)
//   side      the decode and the Hopper prefill side by side on two streams, the prefill over
//             plan::SideBySidePrefillCtas persistent CTAs (the CTAs column; 0: b2b's time) taking
//             works on demand, and the rest of the wave after the decode taking those left, as
//             the CUDA backend runs a mixed step where POD's auto rule leaves it
// The outputs of all variants are compared with each other (normwise relative error, bf16
// tolerance) before anything is timed; the decode and prefill kernels are each validated
// against the CPU reference by their own tests. Times are medians over groups of launches
// (~2 ms each) after warm-up; inputs are device-filled random data (the decode KV alone is
// >= 1 GB, beyond L2). Columns: ms per variant, fused/b2b and fused/merged (the bars: <= 0.85
// and < 1). torch is not run here.
//
// Usage: pod_bench [--only=SUBSTRING] [--page=1|16] [--warm_ms=N]   (whole run ~20-40 s on an H100)
//                  [--split=P1,P2,...] [--occupy=N1,N2,...] [--contiguous] [--verbose] [--no_tail]
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "attnd/kernels/cuda/decode.h"
#include "attnd/kernels/cuda/pod.h"
#include "attnd/kernels/cuda/prefill.h"
#include "bench_util.h"
#include "device_fill.h"
#include "plan/decode_plan.h"
#include "plan/pod_plan.h"
#include "plan/prefill_plan.h"
#include "plan/step_plan.h"

namespace attnd {
namespace {

using bench::MedianMs;

constexpr int32_t kQoHeads = 32;
constexpr int32_t kKvHeads = 8;
constexpr int32_t kHeadDim = 128;
constexpr int32_t kNumDecodes = 128;
constexpr DType kDtype = DType::kBFloat16;

struct Case {
  std::string name;
  int32_t num_prefills;
  int32_t prefill_q;
  int32_t prefill_kv;
  int32_t decode_kv;
};

template <typename F>
float TimeMs(F&& launch_one, cudaStream_t stream) {
  for (int i = 0; i < 3; ++i) launch_one();
  CHECK_CUDA(cudaStreamSynchronize(stream));
  const auto launch = [&](int) { launch_one(); };
  const float first_ms = MedianMs(3, 1, launch, stream);
  const int inner = std::max(1, static_cast<int>(2.0f / std::max(first_ms, 1e-3f)));
  return MedianMs(15, inner, launch, stream);
}

const int32_t* Upload(const std::vector<int32_t>& host) {
  void* device;
  CHECK_CUDA(cudaMalloc(&device, std::max<size_t>(host.size(), 4) * sizeof(int32_t)));
  if (!host.empty()) {
    CHECK_CUDA(cudaMemcpy(device, host.data(), host.size() * sizeof(int32_t), cudaMemcpyHostToDevice));
  }
  return static_cast<const int32_t*>(device);
}

std::vector<uint16_t> Download(const void* device, int64_t count) {
  std::vector<uint16_t> host(count);
  CHECK_CUDA(cudaMemcpy(host.data(), device, count * 2, cudaMemcpyDeviceToHost));
  return host;
}

double RelativeError(const std::vector<uint16_t>& got, const std::vector<uint16_t>& want) {
  double error_sq = 0, norm_sq = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double a = BFloat16ToFloat(got[i]), b = BFloat16ToFloat(want[i]);
    error_sq += std::isnan(a) ? 1e30 : (a - b) * (a - b);
    norm_sq += b * b;
  }
  return std::sqrt(error_sq / std::max(norm_sq, 1e-30));
}

struct Row {
  float fused_ms, b2b_ms, b2b_mma_ms, merged_ms;
  double error_b2b, error_merged;
  std::string pod_plan;
  float side_ms = 0;       // the backend's mixed step on Hopper: decode and prefill side by side
  int32_t side_ctas = 0;   // its prefill's persistent CTAs (0: the step runs b2b)
  float decode_ms = 0, prefill_ms = 0;           // --split: each half alone
  std::string decode_kernel;
  std::vector<std::pair<int32_t, float>> split;  // --split: (prefill CTAs, ms) side by side
  struct Occupied {
    int32_t sms;      // held
    float decode_ms;  // the decode beside them
    double copy_tbps;  // the copy kernel beside them, read + write
  };
  std::vector<Occupied> occupied;  // --occupy
};

// --split=P1,P2,...: a diagnostic of an SM-partitioned POD. The decode kernel and the Hopper
// prefill kernel persistent over P CTAs (one per SM) run at once on two streams (the prefill's
// launched first, at a higher priority, so it holds P SMs and the decode the rest), checked
// against b2b's outputs, then timed. --contiguous: each request's pages in order (FlashInfer's
// benchmark), instead of shuffled.
std::vector<int32_t> g_splits;
// Side by side (and --split), the prefill's CTAs take works on demand, and a second grid of
// (wave - P) CTAs after the decode on its stream takes what is left (BatchPrefillTail), so the
// decode's SMs join the prefill once it is done; the merge after both (the backend's way).
// --no_tail: the prefill's P CTAs each walk their fixed part of the layout, and nothing joins
// them (the backend before the twentieth session).
bool g_tail = true;
// --occupy=N1,N2,...: a diagnostic of the decode side by side. The decode alone, and the copy
// kernel, while a spinning kernel holds N SMs (bench::OccupySms, launched first on another
// stream), as the side-by-side prefill's persistent CTAs hold them.
std::vector<int32_t> g_occupy;
bool g_contiguous = false;

// "1,22,333" -> {1, 22, 333}.
std::vector<int32_t> IntList(const char* text) {
  std::vector<int32_t> values;
  for (const char* p = text; *p != '\0';) {
    values.push_back(std::atoi(p));
    while (*p != '\0' && *p != ',') ++p;
    if (*p == ',') ++p;
  }
  return values;
}

Row RunCase(const Case& shape, int32_t page_size, cudaStream_t stream) {
  const int32_t batch = shape.num_prefills + kNumDecodes;
  std::vector<int32_t> q_lens, kv_lens;
  for (int32_t i = 0; i < shape.num_prefills; ++i) {
    q_lens.push_back(shape.prefill_q);
    kv_lens.push_back(shape.prefill_kv);
  }
  for (int32_t i = 0; i < kNumDecodes; ++i) {
    q_lens.push_back(1);
    kv_lens.push_back(shape.decode_kv);
  }
  std::vector<int32_t> qo_indptr{0}, page_indptr{0}, last_page_len;
  for (int32_t b = 0; b < batch; ++b) {
    qo_indptr.push_back(qo_indptr.back() + q_lens[b]);
    const int32_t pages = (kv_lens[b] + page_size - 1) / page_size;
    page_indptr.push_back(page_indptr.back() + pages);
    last_page_len.push_back(kv_lens[b] - (pages - 1) * page_size);
  }
  const int64_t rows = qo_indptr.back();
  const int64_t num_pages = page_indptr.back();
  std::vector<int32_t> page_ids(num_pages);
  std::iota(page_ids.begin(), page_ids.end(), 0);
  std::mt19937 rng(static_cast<uint32_t>(shape.prefill_q * 7 + shape.decode_kv + page_size));
  if (!g_contiguous) std::shuffle(page_ids.begin(), page_ids.end(), rng);

  const int64_t row_elements = int64_t{kQoHeads} * kHeadDim;
  const int64_t pool_elements = num_pages * page_size * kKvHeads * kHeadDim;
  void *q, *k_pool, *v_pool;
  CHECK_CUDA(cudaMalloc(&q, rows * row_elements * 2));
  CHECK_CUDA(cudaMalloc(&k_pool, pool_elements * 2));
  CHECK_CUDA(cudaMalloc(&v_pool, pool_elements * 2));
  CHECK_CUDA(bench::FillRandom(q, kDtype, rows * row_elements, 1, 1.0f, stream));
  CHECK_CUDA(bench::FillRandom(k_pool, kDtype, pool_elements, 2, 1.0f, stream));
  CHECK_CUDA(bench::FillRandom(v_pool, kDtype, pool_elements, 3, 1.0f, stream));
  void* outputs[3];
  for (void*& o : outputs) {
    CHECK_CUDA(cudaMalloc(&o, rows * row_elements * 2));
    CHECK_CUDA(cudaMemset(o, 0xff, rows * row_elements * 2));  // NaN: every row must be written
  }
  void* o_fused = outputs[0];
  void* o_b2b = outputs[1];
  void* o_merged = outputs[2];
  const int32_t* d_qo_indptr = Upload(qo_indptr);
  const int32_t* d_page_indptr = Upload(page_indptr);
  const int32_t* d_page_ids = Upload(page_ids);
  const int32_t* d_last = Upload(last_page_len);

  const PagedKvView k_view{k_pool, kDtype, KvLayout::kNHD, num_pages, page_size, kKvHeads, kHeadDim};
  const PagedKvView v_view{v_pool, kDtype, KvLayout::kNHD, num_pages, page_size, kKvHeads, kHeadDim};
  AttentionParams params;
  params.causal = true;
  params.sm_scale = 1.0f / std::sqrt(static_cast<float>(kHeadDim));

  auto waves = cuda::BatchPrefillCtasPerWave(kHeadDim, kDtype, kDtype);
  CHECK_OK(waves.status());
  auto pod_waves = cuda::PodCtasPerWave(kHeadDim, kDtype, kDtype);
  CHECK_OK(pod_waves.status());
  auto prefill_input = [&](std::span<const int32_t> indptr, std::span<const int32_t> kv) {
    plan::PrefillPlanInput input;
    input.qo_indptr = indptr;
    input.kv_lengths = kv;
    input.num_qo_heads = kQoHeads;
    input.num_kv_heads = kKvHeads;
    input.head_dim = kHeadDim;
    input.causal = true;
    input.ctas_per_wave = *waves;
    return input;
  };
  auto workspace_of = [](int64_t bytes) {
    void* workspace;
    CHECK_CUDA(cudaMalloc(&workspace, std::max<int64_t>(bytes, 256)));
    return workspace;
  };
  cuda::BatchPrefillArgs all_args;
  all_args.q = {q, kDtype, rows, kQoHeads, kHeadDim};
  all_args.qo_indptr = d_qo_indptr;
  all_args.pages = {batch, page_size, d_page_indptr, d_page_ids, d_page_ids, d_last};
  all_args.k_cache = k_view;
  all_args.v_cache = v_view;
  all_args.params = params;

  // Fused.
  auto pod = plan::PlanPod(prefill_input(qo_indptr, kv_lens), *pod_waves);
  CHECK_OK(pod.status());
  if (!pod->fused()) {
    std::fprintf(stderr, "%s: the POD plan did not fuse\n", shape.name.c_str());
    std::exit(1);
  }
  const int64_t pod_bytes = cuda::PodWorkspaceBytes(*pod);
  void* pod_workspace = workspace_of(pod_bytes);
  CHECK_OK(cuda::UploadPodPlan(*pod, pod_workspace, pod_bytes, stream));
  cuda::BatchPrefillArgs fused_args = all_args;
  fused_args.o = {o_fused, kDtype, rows, kQoHeads, kHeadDim};
  auto run_fused = [&] { CHECK_OK(cuda::PodAttention(*pod, fused_args, pod_workspace, pod_bytes, stream)); };

  // Back to back: decode over the decode requests, prefill over the prefill requests, each on
  // its own sub-batch (prefix of the arrays for the prefills; the decodes' own indptr).
  const int32_t prefill_rows = qo_indptr[shape.num_prefills];
  std::vector<int32_t> decode_qo_indptr(kNumDecodes + 1), decode_page_indptr(kNumDecodes + 1);
  std::vector<int64_t> decode_kv(kNumDecodes, shape.decode_kv);
  for (int32_t i = 0; i <= kNumDecodes; ++i) {
    decode_qo_indptr[i] = i;
    decode_page_indptr[i] = page_indptr[shape.num_prefills + i] - page_indptr[shape.num_prefills];
  }
  const int32_t* d_decode_page_indptr = Upload(decode_page_indptr);
  const cuda::DecodeKernelConfig decode_config{kDtype, kDtype, kHeadDim, kQoHeads / kKvHeads};
  auto decode_ctas = cuda::DecodeCtasPerWave(decode_config);
  CHECK_OK(decode_ctas.status());
  plan::DecodePlanOptions decode_options;
  decode_options.num_kv_heads = kKvHeads;
  decode_options.ctas_per_wave = *decode_ctas;
  // As the backend plans a decode (StepPlanContext): the tensor-core kernel where the device has
  // it, the planner choosing per batch.
  if (cuda::TensorCoreDecodeSupports(decode_config)) {
    auto tensor_ctas = cuda::TensorCoreDecodeCtasPerWave(decode_config);
    CHECK_OK(tensor_ctas.status());
    decode_options.tensor_core_supported = true;
    decode_options.tensor_core_ctas_per_wave = *tensor_ctas;
  }
  auto decode_plan = plan::PlanBatchDecode(decode_qo_indptr, decode_kv, decode_options);
  CHECK_OK(decode_plan.status());
  const int32_t* d_decode_work = Upload(decode_plan->Pack());
  const bool tensor_core = decode_plan->kernel == plan::DecodeKernel::kTensorCore;
  const int64_t decode_bytes = cuda::BatchDecodeWorkspaceBytes(decode_plan->num_partials, kQoHeads, kHeadDim);
  void* decode_workspace = workspace_of(decode_bytes);
  cuda::BatchDecodeArgs decode_args;
  decode_args.q = {static_cast<uint16_t*>(q) + prefill_rows * row_elements, kDtype, kNumDecodes, kQoHeads, kHeadDim};
  decode_args.pages = {kNumDecodes, page_size, d_decode_page_indptr, d_page_ids + page_indptr[shape.num_prefills],
                       d_page_ids + page_indptr[shape.num_prefills], d_last + shape.num_prefills};
  decode_args.k_cache = k_view;
  decode_args.v_cache = v_view;
  decode_args.params = params;
  decode_args.work = decode_plan->View(d_decode_work);
  decode_args.o = {static_cast<uint16_t*>(o_b2b) + prefill_rows * row_elements, kDtype, kNumDecodes, kQoHeads,
                   kHeadDim};
  decode_args.workspace = decode_workspace;
  decode_args.workspace_bytes = decode_bytes;

  const std::span<const int32_t> prefill_indptr(qo_indptr.data(), shape.num_prefills + 1);
  const std::span<const int32_t> prefill_kv(kv_lens.data(), shape.num_prefills);
  cuda::BatchPrefillArgs prefill_args = all_args;
  prefill_args.pages.batch_size = shape.num_prefills;
  prefill_args.o = {o_b2b, kDtype, rows, kQoHeads, kHeadDim};
  auto prefill_auto = plan::PlanPrefill(prefill_input(prefill_indptr, prefill_kv));
  CHECK_OK(prefill_auto.status());
  plan::PrefillPlanInput mma_input = prefill_input(prefill_indptr, prefill_kv);
  mma_input.kernel = plan::PrefillKernel::kMmaSync;
  auto prefill_mma = plan::PlanPrefill(mma_input);
  CHECK_OK(prefill_mma.status());
  const int64_t auto_bytes = cuda::BatchPrefillWorkspaceBytes(*prefill_auto);
  const int64_t mma_bytes = cuda::BatchPrefillWorkspaceBytes(*prefill_mma);
  void* auto_workspace = workspace_of(auto_bytes);
  void* mma_workspace = workspace_of(mma_bytes);
  CHECK_OK(cuda::UploadBatchPrefillPlan(*prefill_auto, auto_workspace, auto_bytes, stream));
  CHECK_OK(cuda::UploadBatchPrefillPlan(*prefill_mma, mma_workspace, mma_bytes, stream));
  auto run_b2b = [&] {
    CHECK_OK(cuda::BatchDecode(decode_args, stream));
    CHECK_OK(cuda::BatchPrefill(*prefill_auto, prefill_args, auto_workspace, auto_bytes, stream));
  };
  auto run_b2b_mma = [&] {
    CHECK_OK(cuda::BatchDecode(decode_args, stream));
    CHECK_OK(cuda::BatchPrefill(*prefill_mma, prefill_args, mma_workspace, mma_bytes, stream));
  };

  // One merged prefill plan over every request.
  auto merged = plan::PlanPrefill(prefill_input(qo_indptr, kv_lens));
  CHECK_OK(merged.status());
  const int64_t merged_bytes = cuda::BatchPrefillWorkspaceBytes(*merged);
  void* merged_workspace = workspace_of(merged_bytes);
  CHECK_OK(cuda::UploadBatchPrefillPlan(*merged, merged_workspace, merged_bytes, stream));
  cuda::BatchPrefillArgs merged_args = all_args;
  merged_args.o = {o_merged, kDtype, rows, kQoHeads, kHeadDim};
  auto run_merged = [&] { CHECK_OK(cuda::BatchPrefill(*merged, merged_args, merged_workspace, merged_bytes, stream)); };

  // Check before timing: every variant against the others, on every row.
  run_fused();
  run_b2b();
  run_merged();
  CHECK_CUDA(cudaStreamSynchronize(stream));
  const std::vector<uint16_t> fused_host = Download(o_fused, rows * row_elements);
  Row row;
  row.error_b2b = RelativeError(fused_host, Download(o_b2b, rows * row_elements));
  row.error_merged = RelativeError(fused_host, Download(o_merged, rows * row_elements));
  if (!(row.error_b2b <= 1e-2) || !(row.error_merged <= 1e-2)) {
    std::fprintf(stderr, "%s page %d: fused differs from b2b by %.3g, from merged by %.3g: not timing\n",
                 shape.name.c_str(), page_size, row.error_b2b, row.error_merged);
    std::exit(1);
  }
  row.pod_plan = pod->DebugString();
  row.fused_ms = TimeMs(run_fused, stream);
  row.b2b_ms = TimeMs(run_b2b, stream);
  row.b2b_mma_ms = TimeMs(run_b2b_mma, stream);
  row.merged_ms = TimeMs(run_merged, stream);
  CHECK_CUDA(cudaGetLastError());
  int low = 0, high = 0;
  CHECK_CUDA(cudaDeviceGetStreamPriorityRange(&low, &high));
  cudaStream_t side;
  CHECK_CUDA(cudaStreamCreateWithPriority(&side, cudaStreamNonBlocking, high));
  cudaEvent_t fork, join;
  CHECK_CUDA(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming));
  CHECK_CUDA(cudaEventCreateWithFlags(&join, cudaEventDisableTiming));
  // The decode and the Hopper prefill over `ctas` persistent CTAs side by side, as the CUDA
  // backend runs a mixed step (CudaStep::EnqueueMhaKernels), into o_merged; checked against
  // fused, then timed.
  // The prefill is planned for its share of the SMs, as the step planner plans it (its items laid
  // out for that grid).
  auto time_side_by_side = [&](int32_t ctas) {
    plan::PrefillPlanInput side_input = prefill_input(prefill_indptr, prefill_kv);
    side_input.ctas_per_wave.hopper_tile128 = ctas;
    auto side_plan = plan::PlanPrefill(side_input);
    CHECK_OK(side_plan.status());
    const int64_t side_bytes = cuda::BatchPrefillWorkspaceBytes(*side_plan);
    void* side_workspace = workspace_of(side_bytes);
    CHECK_OK(cuda::UploadBatchPrefillPlan(*side_plan, side_workspace, side_bytes, stream));
    cuda::BatchPrefillArgs split_args = prefill_args;
    split_args.max_persistent_ctas = ctas;
    split_args.works_on_demand = g_tail;
    split_args.tail_ctas = g_tail ? std::max(waves->hopper_tile128 - ctas, 0) : 0;
    split_args.o = {o_merged, kDtype, rows, kQoHeads, kHeadDim};
    cuda::BatchDecodeArgs split_decode = decode_args;
    split_decode.o = {static_cast<uint16_t*>(o_merged) + prefill_rows * row_elements, kDtype, kNumDecodes,
                      kQoHeads, kHeadDim};
    auto run_split = [&] {
      CHECK_CUDA(cudaEventRecord(fork, stream));
      CHECK_CUDA(cudaStreamWaitEvent(side, fork, 0));
      CHECK_OK(cuda::BatchPrefill(*side_plan, split_args, side_workspace, side_bytes, side));
      CHECK_OK(cuda::BatchDecode(split_decode, stream));
      CHECK_OK(cuda::BatchPrefillTail(*side_plan, split_args, side_workspace, side_bytes, stream));
      CHECK_CUDA(cudaEventRecord(join, side));
      CHECK_CUDA(cudaStreamWaitEvent(stream, join, 0));
      CHECK_OK(cuda::MergeBatchPrefill(*side_plan, split_args, side_workspace, side_bytes, stream));
    };
    CHECK_CUDA(cudaMemsetAsync(o_merged, 0xff, rows * row_elements * 2, stream));
    run_split();
    CHECK_CUDA(cudaStreamSynchronize(stream));
    const double error = RelativeError(Download(o_merged, rows * row_elements), fused_host);
    if (!(error <= 1e-2)) {
      std::fprintf(stderr, "%s page %d side by side over %d CTAs: differs from fused by %.3g: not timing\n",
                   shape.name.c_str(), page_size, ctas, error);
      std::exit(1);
    }
    const double ms = TimeMs(run_split, stream);
    CHECK_CUDA(cudaStreamSynchronize(stream));
    CHECK_CUDA(cudaFree(side_workspace));
    return ms;
  };
  {
    // The planner's rule (plan::SideBySidePrefillCtas) on this step.
    StepBatch batch_shape;
    batch_shape.batch_size = batch;
    batch_shape.qo_indptr = qo_indptr;
    batch_shape.page_indptr = page_indptr;
    batch_shape.k_page_indices = page_ids;
    batch_shape.last_page_len = last_page_len;
    batch_shape.options.params = params;
    CacheGeometry geometry;
    geometry.num_qo_heads = kQoHeads;
    geometry.num_kv_heads = kKvHeads;
    geometry.k_head_dim = geometry.v_head_dim = kHeadDim;
    geometry.page_size = page_size;
    geometry.kv_dtype = kDtype;
    row.side_ctas = plan::SideBySidePrefillCtas(batch_shape, geometry, waves->hopper_tile128);
    row.side_ms = row.side_ctas > 0 ? time_side_by_side(row.side_ctas) : row.b2b_ms;
  }
  if (!g_splits.empty()) {
    row.decode_kernel = tensor_core ? "tensor cores" : "CUDA cores";
    row.decode_ms = TimeMs([&] { CHECK_OK(cuda::BatchDecode(decode_args, stream)); }, stream);
    row.prefill_ms = TimeMs(
        [&] { CHECK_OK(cuda::BatchPrefill(*prefill_auto, prefill_args, auto_workspace, auto_bytes, stream)); },
        stream);
    for (int32_t ctas : g_splits) row.split.push_back({ctas, time_side_by_side(ctas)});
  }
  if (!g_occupy.empty()) {
    // Median of 15: the SMs held for 3 ms, `launch` issued 50 us later on the other stream (its
    // CTAs take the SMs left), timed by events around it.
    cudaEvent_t begin, end;
    CHECK_CUDA(cudaEventCreate(&begin));
    CHECK_CUDA(cudaEventCreate(&end));
    auto time_beside_held = [&](int32_t sms, auto&& launch) {
      std::vector<float> times;
      for (int rep = 0; rep < 18; ++rep) {
        CHECK_CUDA(bench::OccupySms(sms, 3000, side));
        std::this_thread::sleep_for(std::chrono::microseconds(50));
        CHECK_CUDA(cudaEventRecord(begin, stream));
        launch();
        CHECK_CUDA(cudaEventRecord(end, stream));
        CHECK_CUDA(cudaDeviceSynchronize());
        float ms = 0;
        CHECK_CUDA(cudaEventElapsedTime(&ms, begin, end));
        if (rep >= 3) times.push_back(ms);
      }
      std::sort(times.begin(), times.end());
      return times[times.size() / 2];
    };
    // The copy kernel over (up to) 256 MB of the K pool, beside the same held SMs: what plain
    // 16-byte loads and stores reach per SM.
    const size_t copy_bytes = std::min<size_t>(size_t{256} << 20, pool_elements * 2 / 16 * 16);
    void* copy_target = nullptr;
    CHECK_CUDA(cudaMalloc(&copy_target, copy_bytes));
    for (int32_t sms : g_occupy) {
      const float decode_ms = time_beside_held(sms, [&] { CHECK_OK(cuda::BatchDecode(decode_args, stream)); });
      const float copy_ms =
          time_beside_held(sms, [&] { CHECK_CUDA(bench::CopyWithKernel(copy_target, k_pool, copy_bytes, stream)); });
      row.occupied.push_back({sms, decode_ms, 2.0 * copy_bytes / (copy_ms * 1e9)});
    }
    CHECK_CUDA(cudaFree(copy_target));
    CHECK_CUDA(cudaEventDestroy(begin));
    CHECK_CUDA(cudaEventDestroy(end));
  }

  CHECK_CUDA(cudaEventDestroy(fork));
  CHECK_CUDA(cudaEventDestroy(join));
  CHECK_CUDA(cudaStreamDestroy(side));

  for (void* p : {q, k_pool, v_pool, outputs[0], outputs[1], outputs[2], pod_workspace, decode_workspace,
                  auto_workspace, mma_workspace, merged_workspace}) {
    CHECK_CUDA(cudaFree(p));
  }
  for (const int32_t* p : {d_qo_indptr, d_page_indptr, d_page_ids, d_last, d_decode_page_indptr, d_decode_work}) {
    CHECK_CUDA(cudaFree(const_cast<int32_t*>(p)));
  }
  return row;
}

}  // namespace
}  // namespace attnd

int main(int argc, char** argv) {
  using namespace attnd;
  std::string only;
  std::vector<int32_t> page_sizes = {1, 16};
  bool verbose = false;
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], "--only=", 7) == 0) only = argv[i] + 7;
    if (std::strncmp(argv[i], "--page=", 7) == 0) page_sizes = {std::atoi(argv[i] + 7)};
    if (std::strcmp(argv[i], "--verbose") == 0) verbose = true;
    if (std::strcmp(argv[i], "--contiguous") == 0) g_contiguous = true;
    if (std::strncmp(argv[i], "--occupy=", 9) == 0) g_occupy = IntList(argv[i] + 9);
    if (std::strncmp(argv[i], "--split=", 8) == 0) g_splits = IntList(argv[i] + 8);
    if (std::strcmp(argv[i], "--no_tail") == 0) g_tail = false;
    bench::ParseWarmFlag(argv[i]);
  }
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
  auto pod_waves = cuda::PodCtasPerWave(kHeadDim, kDtype, kDtype);
  CHECK_OK(pod_waves.status());
  auto waves = cuda::BatchPrefillCtasPerWave(kHeadDim, kDtype, kDtype);
  CHECK_OK(waves.status());
  std::printf("CTAs per wave: pod tile128 %d tile64 %d; prefill mma tile128 %d tile16 %d, hopper %d\n",
              pod_waves->tile128, pod_waves->tile64, waves->tile128, waves->tile16, waves->hopper_tile128);
  const std::vector<Case> cases = {
      {"2x2048+128x2048", 2, 2048, 2048, 2048},
      {"1x2048+128x2048", 1, 2048, 2048, 2048},
      {"1x4096+128x4096", 1, 4096, 4096, 4096},
      {"1x4096+128x8192", 1, 4096, 4096, 8192},
      {"1x6000/7000+128x8192", 1, 6000, 7000, 8192},
  };
  std::printf("%-22s %4s %9s %9s %9s %9s %10s %13s %9s %14s %9s %10s\n", "case", "page", "fused", "b2b", "b2b-mma",
              "merged", "fused/b2b", "fused/merged", "max.err", "side (CTAs)", "side/b2b", "side/merged");
  for (int32_t page_size : page_sizes) {
    for (const Case& shape : cases) {
      if (!only.empty() && shape.name.find(only) == std::string::npos) continue;
      const Row row = RunCase(shape, page_size, stream);
      if (verbose) std::printf("%s", row.pod_plan.c_str());
      std::printf("%-22s %4d %9.4f %9.4f %9.4f %9.4f %10.3f %13.3f %9.2e %9.4f (%2d) %9.3f %10.3f\n",
                  shape.name.c_str(), page_size, row.fused_ms, row.b2b_ms, row.b2b_mma_ms, row.merged_ms,
                  row.fused_ms / row.b2b_ms, row.fused_ms / row.merged_ms, std::max(row.error_b2b, row.error_merged),
                  row.side_ms, row.side_ctas, row.side_ms / row.b2b_ms, row.side_ms / row.merged_ms);
      if (!g_splits.empty()) {
        std::printf("  decode alone %.4f (%s), prefill alone %.4f; side by side:", row.decode_ms, row.decode_kernel.c_str(),
                    row.prefill_ms);
        for (const auto& [ctas, ms] : row.split) std::printf(" P=%d %.4f (%.3f of b2b)", ctas, ms, ms / row.b2b_ms);
        std::printf("\n");
      }
      if (!row.occupied.empty()) {
        std::printf("  decode with SMs held:");
        for (const auto& [sms, ms, tbps] : row.occupied) std::printf(" %d held %.4f (copy %.2f TB/s)", sms, ms, tbps);
        std::printf("\n");
      }
      std::fflush(stdout);
    }
  }
  CHECK_CUDA(cudaStreamDestroy(stream));
  return 0;
}
