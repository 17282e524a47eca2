// mla_bench: PERFORMANCE.md's "mla" case. MLA decode, 128 heads, kv_lora_rank 512 + rope 64,
// bf16 q and latent cache, page 64 (pages shuffled, SHARED table); batch 16, 32, 64, 128, 256,
// lengths drawn with seed = batch from {4096, 8192, 16384, 32768, 65536, 131072} weighted
// 35, 20, 15, 12, 10, 8. Per batch the planner's schemes run on the same inputs:
//   nosplit   one chunk per request
//   onewave   the smallest chunk whose CTAs fit one wave (the batch-decode rule)
//   oversub   oversubscription with the planner's defaults (longest chunks launched first)
//   auto      what the planner picks by its cost estimate
// (all with the kernel MlaDecode picks: the wide-tile Hopper one on an H100;
// --hopper_variant=old runs them on the two-CTA Hopper kernel, =new on the wide-tile one, =both on
// both, the wide ones named *_wide, each with its own summary) and with --variants: one wave
// and oversubscription on the mma.sync kernel; oversubscription by the plain rule (no search
// over min_tokens_per_cta doublings), with other min_tokens_per_cta / max_waves, in request
// order, and as a padded grid (batch x max splits CTAs in request order, the extra CTAs of short
// requests exiting at once, as a kernel without a planner launches them).
//
// After the mixed sweep, the uniform cases FlashInfer's Hopper MLA kernel was measured on
// (PERFORMANCE.md: 64 x 8192 in 0.279 ms), batch 16, 64 and 128 x 8192 keys, run the same
// variants on the same shape (--cases=mixed or --cases=uniform runs one group).
//
// Each variant is checked first (o poisoned with NaN) against the float64 CPU reference on two
// requests of the batch (the first and the longest: a full float64 reference of 256 requests
// of up to 131072 keys x 128 heads would take minutes), then timed: a CUDA graph of N launches
// (decode + merge), median of 15 replays, / N. Bytes: every latent byte (ckv + kpe) read once,
// q read once, o written once; % copy is against the larger of two copy bandwidths measured at
// the start of the same run (1 GiB device-to-device: cudaMemcpy and a 16-byte copy kernel).
// TFLOP/s counts Q K^T (576 wide) and P V (512 wide) of every head and key: at 128 heads a
// latent row of 1152 bytes carries 278.5 KFLOP, so streaming at 2.23 TB/s takes ~540 TFLOP/s of
// dense bf16 tensor work: MLA decode at this head count sits near the matmul roof, not only the
// bandwidth one.
//
//   mla_bench [--variants] [--batches=16,32] [--uniform=16,64,128] [--cases=mixed,uniform]
//             [--hopper_variant=auto|old|new|both] [--only=VARIANT] [--csv=PATH] [--warm_ms=N]
//             [--kv_dtype=bf16|fp8] [--hot_pages=N]
//
// --kv_dtype=fp8: the latent cache in fp8 e4m3 (q and o bf16; bytes count one a cached value).
// --hot_pages=N (a diagnostic): every page id folded into the first N pages, so that the latent
// read comes from L2 (% copy then counts bytes HBM did not serve).
//
// --warm_ms=N (every kernel benchmark): N ms of the measured work before each timing, so that
// every case meets the card in the same power state (bench_util.h, WarmUp).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "attnd/kernels/cuda/mla_decode.h"
#include "bench_util.h"
#include "device_fill.h"
#include "plan/mla_plan.h"
#include "reference/attention.h"

namespace attnd::bench {
namespace {

// The planner's cost-model constants for every variant (-1: MlaPlanOptions' defaults), to re-fit
// them for a kernel.
int32_t g_cta_overhead_tokens = -1;
int32_t g_merge_tokens_per_partial_row = -1;
// The latent cache's dtype (--kv_dtype=bf16|fp8); q and o stay bf16.
DType g_kv_dtype = DType::kBFloat16;
int64_t KvBytes() { return DTypeBytes(g_kv_dtype); }
// --hot_pages=N: every page id folded into the first N pages (a diagnostic: with N pages in L2,
// the time without HBM's share). 0: every page its own.
int32_t g_hot_pages = 0;

using bench::DeviceMemory;
using bench::CopyToDevice;
using bench::Median;
using bench::TimeGraph;
using bench::CopyBandwidths;
using bench::MeasureCopy;

constexpr int32_t kHeads = 128;
constexpr int32_t kRank = 512;
constexpr int32_t kRope = 64;
constexpr int32_t kPageSize = 64;
constexpr int kReplays = 15;
constexpr double kTargetGraphSeconds = 5e-3;
constexpr double kTolerance = 1e-2;
constexpr int64_t kUniformKeys = 8192;
// FlashInfer's Hopper MLA kernel, 64 x 8192 on our H100 (PERFORMANCE.md peers).
constexpr double kFlashInferUniform64Seconds = 0.279e-3;

double TimeOnce(cudaStream_t stream, const std::function<void()>& enqueue) {
  cudaEvent_t start, stop;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));
  enqueue();
  CHECK_CUDA(cudaEventRecord(start, stream));
  enqueue();
  CHECK_CUDA(cudaEventRecord(stop, stream));
  CHECK_CUDA(cudaEventSynchronize(stop));
  float ms = 0;
  CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
  CHECK_CUDA(cudaEventDestroy(start));
  CHECK_CUDA(cudaEventDestroy(stop));
  return ms * 1e-3;
}

// PERFORMANCE.md's length distribution, seed = batch.
std::vector<int64_t> DrawLengths(int32_t batch) {
  const int64_t values[] = {4096, 8192, 16384, 32768, 65536, 131072};
  std::mt19937 rng(static_cast<uint32_t>(batch));
  std::discrete_distribution<int> pick({35, 20, 15, 12, 10, 8});
  std::vector<int64_t> lengths(batch);
  for (int64_t& length : lengths) length = values[pick(rng)];
  return lengths;
}

enum class Variant { kNoSplit, kOneWave, kOversub, kAuto, kOversubParams, kOversubRequestOrder, kOversubPadded };

struct VariantSpec {
  std::string name;
  Variant kind;
  int32_t min_tokens_per_cta = 0;  // 0: planner default
  int32_t max_waves = 0;
  cuda::MlaKernel kernel = cuda::MlaKernel::kAuto;
  int32_t candidates = 0;  // 0: planner default
};

struct Row {
  std::string group;  // "mixed" or "uniform8192"
  int32_t batch = 0;
  std::string variant;
  std::string plan;
  double seconds = 0;
  double spread = 0;
  double bytes = 0;
  double flops = 0;
  double error = 0;
  double onewave_seconds = 0;
};

// One batch: inputs on the device, the reference of two requests, every variant checked and
// timed.
class MlaBatch {
 public:
  MlaBatch(std::string group, std::vector<int64_t> lengths, int32_t ctas_per_wave, cudaStream_t stream)
      : group_(std::move(group)),
        batch_(static_cast<int32_t>(lengths.size())),
        ctas_per_wave_(ctas_per_wave),
        stream_(stream),
        lengths_(std::move(lengths)) {
    const int32_t batch = batch_;
    indptr_.push_back(0);
    for (int64_t length : lengths_) {
      total_tokens_ += length;
      indptr_.push_back(indptr_.back() + static_cast<int32_t>((length + kPageSize - 1) / kPageSize));
    }
    const int64_t pages = indptr_.back();
    ckv_ = std::make_unique<DeviceMemory>(pages * kPageSize * kRank * KvBytes());
    kpe_ = std::make_unique<DeviceMemory>(pages * kPageSize * kRope * KvBytes());
    q_nope_ = std::make_unique<DeviceMemory>(int64_t{batch} * kHeads * kRank * 2);
    q_pe_ = std::make_unique<DeviceMemory>(int64_t{batch} * kHeads * kRope * 2);
    o_ = std::make_unique<DeviceMemory>(int64_t{batch} * kHeads * kRank * 2);
    lse_ = std::make_unique<DeviceMemory>(int64_t{batch} * kHeads * 4);
    CHECK_CUDA(FillRandom(ckv_->get(), g_kv_dtype, ckv_->bytes() / KvBytes(), 1000 + batch, 1.0f, stream));
    CHECK_CUDA(FillRandom(kpe_->get(), g_kv_dtype, kpe_->bytes() / KvBytes(), 2000 + batch, 1.0f, stream));
    CHECK_CUDA(FillRandom(q_nope_->get(), DType::kBFloat16, q_nope_->bytes() / 2, 3000 + batch, 2.0f, stream));
    CHECK_CUDA(FillRandom(q_pe_->get(), DType::kBFloat16, q_pe_->bytes() / 2, 4000 + batch, 2.0f, stream));
    page_ids_.resize(pages);
    std::iota(page_ids_.begin(), page_ids_.end(), 0);
    std::mt19937 rng(17);
    std::shuffle(page_ids_.begin(), page_ids_.end(), rng);
    if (g_hot_pages > 0) {
      for (int32_t& id : page_ids_) id %= g_hot_pages;
    }
    indptr_device_ = std::make_unique<DeviceMemory>(indptr_.size() * 4);
    ids_device_ = std::make_unique<DeviceMemory>(page_ids_.size() * 4);
    CopyToDevice(indptr_device_->get(), indptr_);
    CopyToDevice(ids_device_->get(), page_ids_);
    qo_indptr_.resize(batch + 1);
    std::iota(qo_indptr_.begin(), qo_indptr_.end(), 0);
    params_.causal = true;
    params_.sm_scale = 1.0f / std::sqrt(192.0f);
    bytes_ = static_cast<double>(total_tokens_) * (kRank + kRope) * KvBytes() +
             static_cast<double>(batch) * kHeads * (kRank + kRope) * 2 + static_cast<double>(batch) * kHeads * kRank * 2;
    CHECK_CUDA(cudaStreamSynchronize(stream));
    // The first request and the longest (the last one when all are equally long).
    const auto longest = std::max_element(lengths_.rbegin(), lengths_.rend());
    checked_ = {0, static_cast<int32_t>(lengths_.rend() - longest - 1)};
    if (checked_[1] == 0) checked_.pop_back();
    ComputeReference();
  }

  double bytes() const { return bytes_; }
  const std::vector<int64_t>& lengths() const { return lengths_; }

  Row Run(const VariantSpec& spec) {
    plan::MlaPlanOptions options;
    options.num_heads = kHeads;
    options.ctas_per_wave = ctas_per_wave_;
    if (g_cta_overhead_tokens >= 0) options.cta_overhead_tokens = g_cta_overhead_tokens;
    if (g_merge_tokens_per_partial_row >= 0) {
      options.merge_tokens_per_partial_row = g_merge_tokens_per_partial_row;
    }
    switch (spec.kind) {
      case Variant::kNoSplit:
        options.split_mode = plan::MlaSplitMode::kNone;
        break;
      case Variant::kOneWave:
        options.split_mode = plan::MlaSplitMode::kOneWave;
        break;
      case Variant::kAuto:
        options.split_mode = plan::MlaSplitMode::kAuto;
        break;
      case Variant::kOversub:
      case Variant::kOversubParams:
      case Variant::kOversubPadded:
        options.split_mode = plan::MlaSplitMode::kOversubscribe;
        break;
      case Variant::kOversubRequestOrder:
        options.split_mode = plan::MlaSplitMode::kOversubscribe;
        options.longest_first = false;
        break;
    }
    if (spec.min_tokens_per_cta > 0) options.min_tokens_per_cta = spec.min_tokens_per_cta;
    if (spec.max_waves > 0) options.max_waves = spec.max_waves;
    if (spec.candidates > 0) options.oversubscribe_candidates = spec.candidates;
    if (spec.kind == Variant::kOversubPadded) options.longest_first = false;
    auto planned = plan::PlanMlaDecode(qo_indptr_, lengths_, options);
    CHECK_OK(planned.status());
    plan::MlaPlan plan = *std::move(planned);
    if (spec.kind == Variant::kOversubPadded) {
      // Request-major grid of batch x max_chunks x row tiles; chunks a request lacks are
      // placeholder units that exit at once.
      std::vector<plan::MlaWorkUnit> padded;
      const int32_t tiles = (kHeads + plan::kMlaRowsPerCta - 1) / plan::kMlaRowsPerCta;
      size_t next = 0;
      for (int32_t b = 0; b < batch_; ++b) {
        int32_t count = 0;
        while (next < plan.units.size() && plan.units[next].request == b) {
          padded.push_back(plan.units[next++]);
          ++count;
        }
        for (; count < plan.max_chunks * tiles; ++count) padded.push_back(plan::MlaWorkUnit{});
      }
      plan.units = std::move(padded);
    }
    char description[200];
    std::snprintf(description, sizeof description, "%s chunk=%d ctas=%d (%.1f waves) partials=%d est=%lld",
                  plan::MlaSplitModeName(plan.mode), plan.kv_chunk_tokens, plan.num_units(),
                  static_cast<double>(plan.num_units()) / ctas_per_wave_, plan.num_partials,
                  static_cast<long long>(plan.estimated_cost));
    const std::vector<int32_t> packed = plan.Pack();
    DeviceMemory packed_device(packed.size() * 4);
    CopyToDevice(packed_device.get(), packed);
    const int64_t workspace_bytes = cuda::MlaDecodeWorkspaceBytes(plan.num_partials, kHeads, kRank);
    DeviceMemory workspace(workspace_bytes);

    cuda::MlaDecodeArgs args;
    args.q_nope = TokenHeadsView{q_nope_->get(), DType::kBFloat16, batch_, kHeads, kRank};
    args.q_pe = TokenHeadsView{q_pe_->get(), DType::kBFloat16, batch_, kHeads, kRope};
    args.pages = PageTableView{batch_, kPageSize, indptr_device_->get<int32_t>(), ids_device_->get<int32_t>(),
                               ids_device_->get<int32_t>(), nullptr};
    const int64_t pages = indptr_.back();
    args.ckv_cache = PagedKvView{ckv_->get(), g_kv_dtype, KvLayout::kNHD, pages, kPageSize, 1, kRank};
    args.kpe_cache = PagedKvView{kpe_->get(), g_kv_dtype, KvLayout::kNHD, pages, kPageSize, 1, kRope};
    args.params = params_;
    args.work = plan.View(packed_device.get<int32_t>());
    args.o = TokenHeadsView{o_->get(), DType::kBFloat16, batch_, kHeads, kRank};
    args.lse = lse_->get<float>();
    args.workspace = workspace.get();
    args.workspace_bytes = workspace_bytes;
    args.kernel = spec.kernel;

    CHECK_CUDA(cudaMemsetAsync(o_->get(), 0xff, o_->bytes(), stream_));
    CHECK_CUDA(cudaMemsetAsync(lse_->get(), 0xff, lse_->bytes(), stream_));
    CHECK_OK(cuda::MlaDecode(args, stream_));
    CHECK_CUDA(cudaStreamSynchronize(stream_));
    Row row;
    row.group = group_;
    row.batch = batch_;
    row.variant = spec.name;
    row.plan = description;
    row.bytes = bytes_;
    row.flops = 2.0 * kHeads * (kRank + kRope + kRank) * static_cast<double>(total_tokens_);
    row.error = Check();

    auto enqueue = [&] { CHECK_OK(cuda::MlaDecode(args, stream_)); };
    const double once = TimeOnce(stream_, enqueue);
    const int launches = std::clamp(static_cast<int>(std::ceil(kTargetGraphSeconds / std::max(once, 1e-6))), 2, 200);
    row.seconds = TimeGraph(stream_, launches, [&](int) { enqueue(); }, kReplays, &row.spread);
    return row;
  }

 private:
  // Float64 reference of the checked requests, from their pages read back.
  void ComputeReference() {
    const int32_t rows = static_cast<int32_t>(checked_.size());
    std::vector<int32_t> host_indptr = {0}, host_ids, last_page_len;
    std::vector<uint16_t> q_nope(int64_t{rows} * kHeads * kRank), q_pe(int64_t{rows} * kHeads * kRope);
    for (int32_t r = 0; r < rows; ++r) {
      const int32_t b = checked_[r];
      const int32_t pages = indptr_[b + 1] - indptr_[b];
      for (int32_t p = 0; p < pages; ++p) {
        const int64_t page = page_ids_[indptr_[b] + p];
        const size_t ckv_at = ref_ckv_.size(), kpe_at = ref_kpe_.size();
        ref_ckv_.resize(ckv_at + kPageSize * kRank * KvBytes());
        ref_kpe_.resize(kpe_at + kPageSize * kRope * KvBytes());
        CHECK_CUDA(cudaMemcpy(ref_ckv_.data() + ckv_at, ckv_->get<uint8_t>() + page * kPageSize * kRank * KvBytes(),
                              kPageSize * kRank * KvBytes(), cudaMemcpyDeviceToHost));
        CHECK_CUDA(cudaMemcpy(ref_kpe_.data() + kpe_at, kpe_->get<uint8_t>() + page * kPageSize * kRope * KvBytes(),
                              kPageSize * kRope * KvBytes(), cudaMemcpyDeviceToHost));
        host_ids.push_back(static_cast<int32_t>(host_ids.size()));
      }
      host_indptr.push_back(static_cast<int32_t>(host_ids.size()));
      last_page_len.push_back(static_cast<int32_t>(lengths_[b] - int64_t{pages - 1} * kPageSize));
      CHECK_CUDA(cudaMemcpy(q_nope.data() + int64_t{r} * kHeads * kRank, q_nope_->get<uint16_t>() + int64_t{b} * kHeads * kRank,
                            kHeads * kRank * 2, cudaMemcpyDeviceToHost));
      CHECK_CUDA(cudaMemcpy(q_pe.data() + int64_t{r} * kHeads * kRope, q_pe_->get<uint16_t>() + int64_t{b} * kHeads * kRope,
                            kHeads * kRope * 2, cudaMemcpyDeviceToHost));
    }
    std::vector<int32_t> qo(rows + 1);
    std::iota(qo.begin(), qo.end(), 0);
    ref_o_.assign(int64_t{rows} * kHeads * kRank, 0.0f);
    ref_lse_.assign(int64_t{rows} * kHeads, 0.0f);
    reference::MlaAttentionArgs args;
    args.q_nope = TokenHeadsView{q_nope.data(), DType::kBFloat16, rows, kHeads, kRank};
    args.q_pe = TokenHeadsView{q_pe.data(), DType::kBFloat16, rows, kHeads, kRope};
    args.qo_indptr = qo.data();
    args.pages = PageTableView{rows, kPageSize, host_indptr.data(), host_ids.data(), host_ids.data(), last_page_len.data()};
    const int64_t pages = static_cast<int64_t>(host_ids.size());
    args.ckv_cache = PagedKvView{ref_ckv_.data(), g_kv_dtype, KvLayout::kNHD, pages, kPageSize, 1, kRank};
    args.kpe_cache = PagedKvView{ref_kpe_.data(), g_kv_dtype, KvLayout::kNHD, pages, kPageSize, 1, kRope};
    args.params = params_;
    args.o = TokenHeadsView{ref_o_.data(), DType::kFloat32, rows, kHeads, kRank};
    args.lse = ref_lse_.data();
    args.accumulation = reference::Accumulation::kFloat64;
    reference::MlaAttention(args);
  }

  // Normwise relative error of the checked requests' o (and NaN if an lse is off by > 1e-3).
  double Check() {
    double diff = 0, norm = 0;
    std::vector<uint16_t> o(kHeads * kRank);
    std::vector<float> lse(kHeads);
    bool lse_ok = true;
    for (size_t r = 0; r < checked_.size(); ++r) {
      const int32_t b = checked_[r];
      CHECK_CUDA(cudaMemcpy(o.data(), o_->get<uint16_t>() + int64_t{b} * kHeads * kRank, o.size() * 2, cudaMemcpyDeviceToHost));
      CHECK_CUDA(cudaMemcpy(lse.data(), lse_->get<float>() + int64_t{b} * kHeads, lse.size() * 4, cudaMemcpyDeviceToHost));
      for (size_t i = 0; i < o.size(); ++i) {
        const double value = BFloat16ToFloat(o[i]);
        const double expected = ref_o_[r * o.size() + i];
        diff += (value - expected) * (value - expected);
        norm += expected * expected;
      }
      for (int32_t h = 0; h < kHeads; ++h) {
        const float expected = ref_lse_[r * kHeads + h];
        if (!(std::fabs(lse[h] - expected) <= 1e-3f + 1e-4f * std::fabs(expected))) lse_ok = false;
      }
    }
    if (!lse_ok || std::isnan(diff)) return NAN;
    return std::sqrt(diff / std::max(norm, 1e-30));
  }

  std::string group_;
  int32_t batch_;
  int32_t ctas_per_wave_;
  cudaStream_t stream_;
  std::vector<int64_t> lengths_;
  int64_t total_tokens_ = 0;
  std::vector<int32_t> indptr_;
  std::vector<int32_t> page_ids_;
  std::vector<int32_t> qo_indptr_;
  std::unique_ptr<DeviceMemory> ckv_, kpe_, q_nope_, q_pe_, o_, lse_, indptr_device_, ids_device_;
  AttentionParams params_;
  double bytes_ = 0;
  std::vector<int32_t> checked_;
  std::vector<uint8_t> ref_ckv_, ref_kpe_;  // raw bytes of g_kv_dtype
  std::vector<float> ref_o_, ref_lse_;
};

void PrintDevice() {
  int device = 0, sms = 0, l2 = 0, clock_khz = 0, driver = 0, runtime = 0;
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDevice(&device));
  CHECK_CUDA(cudaGetDeviceProperties(&prop, device));
  CHECK_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  CHECK_CUDA(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, device));
  cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, device);
  CHECK_CUDA(cudaDriverGetVersion(&driver));
  CHECK_CUDA(cudaRuntimeGetVersion(&runtime));
  std::printf("device: %s, %d SMs, L2 %d MB, peak SM clock %d MHz, driver %d, runtime %d\n", prop.name, sms,
              l2 >> 20, clock_khz / 1000, driver, runtime);
}

std::vector<int32_t> ParseList(const char* p) {
  std::vector<int32_t> values;
  while (*p != '\0') {
    char* end = nullptr;
    values.push_back(static_cast<int32_t>(std::strtol(p, &end, 10)));
    if (end == p) break;
    p = *end == ',' ? end + 1 : end;
  }
  return values;
}

// One case of a group: its label, the batch's lengths.
struct Case {
  std::string group;
  int32_t batch;
  std::vector<int64_t> lengths;
};

// `suffix`: the variants' name suffix ("" or "_wide": the wide-tile Hopper kernel's rows).
void PrintSummary(const std::vector<Row>& rows, const std::string& group, double copy_bandwidth,
                  const std::string& suffix) {
  std::printf("\nsummary, %s%s (%% of copy %.3f TB/s; speedup = onewave time / time)\n", group.c_str(),
              suffix.c_str(), copy_bandwidth / 1e12);
  std::printf("batch | nosplit | onewave | oversub | auto | oversub/onewave | auto us\n");
  std::vector<int32_t> batches;
  for (const Row& row : rows) {
    if (row.group == group && std::find(batches.begin(), batches.end(), row.batch) == batches.end()) {
      batches.push_back(row.batch);
    }
  }
  for (int32_t batch : batches) {
    double t[4] = {0, 0, 0, 0};
    double bytes = 0;
    for (const Row& row : rows) {
      if (row.group != group || row.batch != batch) continue;
      bytes = row.bytes;
      if (row.variant == "nosplit" + suffix) t[0] = row.seconds;
      if (row.variant == "onewave" + suffix) t[1] = row.seconds;
      if (row.variant == "oversub" + suffix) t[2] = row.seconds;
      if (row.variant == "auto" + suffix) t[3] = row.seconds;
    }
    auto percent = [&](double seconds) { return seconds > 0 ? 100 * bytes / seconds / copy_bandwidth : 0.0; };
    std::printf("%5d | %5.1f%% | %5.1f%% | %5.1f%% | %5.1f%% | %.2fx | %.1f\n", batch, percent(t[0]), percent(t[1]),
                percent(t[2]), percent(t[3]), t[2] > 0 ? t[1] / t[2] : 0.0, t[3] * 1e6);
  }
}

int Main(int argc, char** argv) {
  bool variants = false;
  std::string csv_path;
  std::string only;
  std::vector<int32_t> batches = {16, 32, 64, 128, 256};
  std::vector<int32_t> uniform_batches = {16, 64, 128};
  bool run_mixed = true, run_uniform = true;
  std::string hopper_variant = "auto";
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--variants") {
      variants = true;
    } else if (arg.rfind("--only=", 0) == 0) {
      only = arg.substr(7);
    } else if (arg.rfind("--csv=", 0) == 0) {
      csv_path = arg.substr(6);
    } else if (arg.rfind("--batches=", 0) == 0) {
      batches = ParseList(arg.c_str() + 10);
    } else if (arg.rfind("--uniform=", 0) == 0) {
      uniform_batches = ParseList(arg.c_str() + 10);
    } else if (arg.rfind("--hopper_variant=", 0) == 0 &&
               (arg.substr(17) == "auto" || arg.substr(17) == "old" || arg.substr(17) == "new" ||
                arg.substr(17) == "both")) {
      hopper_variant = arg.substr(17);
    } else if (arg.rfind("--cta_overhead_tokens=", 0) == 0) {
      g_cta_overhead_tokens = std::atoi(arg.c_str() + 22);
    } else if (arg.rfind("--merge_tokens_per_partial_row=", 0) == 0) {
      g_merge_tokens_per_partial_row = std::atoi(arg.c_str() + 31);
    } else if (arg == "--kv_dtype=bf16" || arg == "--kv_dtype=fp8") {
      g_kv_dtype = arg == "--kv_dtype=fp8" ? DType::kFloat8E4M3 : DType::kBFloat16;
    } else if (arg.rfind("--hot_pages=", 0) == 0) {
      g_hot_pages = std::max(0, std::atoi(arg.c_str() + 12));
    } else if (arg.rfind("--cases=", 0) == 0) {
      const std::string cases = arg.substr(8);
      run_mixed = cases.find("mixed") != std::string::npos;
      run_uniform = cases.find("uniform") != std::string::npos;
    } else if (!ParseWarmFlag(arg.c_str())) {
      std::fprintf(stderr,
                   "usage: mla_bench [--variants] [--batches=16,32,...] [--uniform=16,64,128] "
                   "[--cases=mixed,uniform] [--hopper_variant=auto|old|new|both] [--only=VARIANT] [--csv=PATH]\n"
                   "                 [--kv_dtype=bf16|fp8] [--hot_pages=N] [--cta_overhead_tokens=N] [--merge_tokens_per_partial_row=N] [--warm_ms=N]\n");
      return 2;
    }
  }
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    std::fprintf(stderr, "mla_bench: no CUDA device\n");
    return 1;
  }
  PrintDevice();
  PrintWarmUp();
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const CopyBandwidths copy = MeasureCopy(stream);
  const double copy_bandwidth = copy.reference();
  std::printf("copy bandwidth (1 GiB D2D, read + write): cudaMemcpy %.3f TB/s, copy kernel %.3f TB/s; "
              "%%copy below is against %.3f TB/s\n",
              copy.memcpy / 1e12, copy.kernel / 1e12, copy_bandwidth / 1e12);
  auto ctas = cuda::MlaDecodeCtasPerWave({DType::kBFloat16, g_kv_dtype, kRank, kRope});
  CHECK_OK(ctas.status());
  std::printf("mla: %d heads, rank %d + rope %d, bf16 q, %s cache, page %d; %d CTAs per wave (measured occupancy x SMs)\n",
              kHeads, kRank, kRope, DTypeName(g_kv_dtype), kPageSize, *ctas);
  std::fflush(stdout);

  if (hopper_variant == "new" || hopper_variant == "both") {
    auto wide = cuda::MlaDecodeCtasPerWave(
        {DType::kBFloat16, g_kv_dtype, kRank, kRope, cuda::MlaKernel::kHopperWide});
    CHECK_OK(wide.status());
    std::printf("wide-tile Hopper kernel: %d CTAs per wave%s\n", *wide,
                *wide == *ctas ? "" : " (differs: its plans still use the default kernel's count)");
  }
  std::vector<VariantSpec> specs;
  const std::pair<std::string, Variant> base_specs[] = {{"nosplit", Variant::kNoSplit},
                                                        {"onewave", Variant::kOneWave},
                                                        {"oversub", Variant::kOversub},
                                                        {"auto", Variant::kAuto}};
  // auto: the kernel MlaDecode picks; old: the two-CTA Hopper kernel; new: the wide-tile one
  // (the names kept, its own summary); both: old, then *_wide rows.
  for (const auto& [name, kind] : base_specs) {
    if (hopper_variant == "auto") specs.push_back({name, kind});
    if (hopper_variant == "old" || hopper_variant == "both") {
      specs.push_back({name, kind, 0, 0, cuda::MlaKernel::kHopper});
    }
  }
  for (const auto& [name, kind] : base_specs) {
    if (hopper_variant == "new") specs.push_back({name, kind, 0, 0, cuda::MlaKernel::kHopperWide});
    if (hopper_variant == "both") specs.push_back({name + "_wide", kind, 0, 0, cuda::MlaKernel::kHopperWide});
  }
  if (variants) {
    specs.push_back({"onewave_mma", Variant::kOneWave, 0, 0, cuda::MlaKernel::kMmaSync});
    specs.push_back({"oversub_mma", Variant::kOversub, 0, 0, cuda::MlaKernel::kMmaSync});
    specs.push_back({"oversub_rule", Variant::kOversubParams, 0, 0, cuda::MlaKernel::kAuto, 1});
    for (int32_t min_tokens : {1024, 4096}) {
      specs.push_back({"oversub_min" + std::to_string(min_tokens), Variant::kOversubParams, min_tokens, 0,
                       cuda::MlaKernel::kAuto, 1});
    }
    for (int32_t waves : {4, 16}) {
      specs.push_back({"oversub_waves" + std::to_string(waves), Variant::kOversubParams, 0, waves,
                       cuda::MlaKernel::kAuto, 1});
    }
    specs.push_back({"oversub_reqorder", Variant::kOversubRequestOrder});
    specs.push_back({"oversub_padded", Variant::kOversubPadded});
  }
  if (!only.empty()) {
    std::erase_if(specs, [&](const VariantSpec& spec) { return spec.name != only; });
  }

  const std::string uniform_group = "uniform" + std::to_string(kUniformKeys);
  std::vector<Case> cases;
  if (run_mixed) {
    for (int32_t batch : batches) cases.push_back({"mixed", batch, DrawLengths(batch)});
  }
  if (run_uniform) {
    for (int32_t batch : uniform_batches) {
      cases.push_back({uniform_group, batch, std::vector<int64_t>(batch, kUniformKeys)});
    }
  }

  std::vector<Row> rows;
  bool failed = false;
  for (const Case& c : cases) {
    MlaBatch data(c.group, c.lengths, *ctas, stream);
    if (c.group == "mixed") {
      int64_t counts[6] = {0, 0, 0, 0, 0, 0};
      for (int64_t length : data.lengths()) counts[static_cast<int>(std::log2(static_cast<double>(length))) - 12]++;
      std::printf("\nbatch %d: lengths 4k x%lld 8k x%lld 16k x%lld 32k x%lld 64k x%lld 128k x%lld, %.1f MB of latent\n",
                  c.batch, static_cast<long long>(counts[0]), static_cast<long long>(counts[1]),
                  static_cast<long long>(counts[2]), static_cast<long long>(counts[3]),
                  static_cast<long long>(counts[4]), static_cast<long long>(counts[5]), data.bytes() / 1e6);
    } else {
      std::printf("\nuniform batch %d x %lld keys, %.1f MB of latent%s\n", c.batch,
                  static_cast<long long>(kUniformKeys), data.bytes() / 1e6,
                  c.batch == 64 ? " (FlashInfer Hopper MLA on our H100: 279.0 us)" : "");
    }
    double onewave = 0;
    for (const VariantSpec& spec : specs) {
      Row row = data.Run(spec);
      if (spec.name == "onewave" || spec.name == "onewave_wide") onewave = row.seconds;  // per kernel
      row.onewave_seconds = onewave;
      const bool ok = row.error <= kTolerance;
      failed |= !ok;
      char versus_peer[48] = "";
      if (c.group == uniform_group && c.batch == 64) {
        std::snprintf(versus_peer, sizeof versus_peer, "  x%.2f vs FlashInfer", kFlashInferUniform64Seconds / row.seconds);
      }
      std::printf("  %-18s %9.1f us %7.3f TB/s %6.1f%% copy %5.0f TFLOP/s  x%.2f vs onewave%s  spread %.2f  err %.1e%s  [%s]\n",
                  row.variant.c_str(), row.seconds * 1e6, row.bytes / row.seconds / 1e12,
                  100 * row.bytes / row.seconds / copy_bandwidth, row.flops / row.seconds / 1e12,
                  onewave > 0 ? onewave / row.seconds : 0.0,
                  versus_peer, row.spread, row.error, ok ? "" : " FAILED CHECK", row.plan.c_str());
      std::fflush(stdout);
      rows.push_back(row);
    }
  }

  const char* kernel_names = hopper_variant == "new" ? "wide-tile Hopper kernel" : "default kernel";
  std::printf("\nsummaries below: %s%s\n", kernel_names,
              hopper_variant == "both" ? "; then *_wide: the wide-tile Hopper kernel" : "");
  if (run_mixed) PrintSummary(rows, "mixed", copy_bandwidth, "");
  if (run_uniform) PrintSummary(rows, uniform_group, copy_bandwidth, "");
  if (hopper_variant == "both") {
    if (run_mixed) PrintSummary(rows, "mixed", copy_bandwidth, "_wide");
    if (run_uniform) PrintSummary(rows, uniform_group, copy_bandwidth, "_wide");
  }
  if (!csv_path.empty()) {
    FILE* file = std::fopen(csv_path.c_str(), "w");
    if (file != nullptr) {
      std::fprintf(file, "group,batch,variant,time_us,tbps,frac_copy,copy_tbps,tflops,speedup_vs_onewave,spread,error,plan\n");
      for (const Row& row : rows) {
        std::fprintf(file, "%s,%d,%s,%.2f,%.4f,%.4f,%.4f,%.1f,%.3f,%.3f,%.2e,%s\n", row.group.c_str(), row.batch,
                     row.variant.c_str(), row.seconds * 1e6, row.bytes / row.seconds / 1e12,
                     row.bytes / row.seconds / copy_bandwidth, copy_bandwidth / 1e12, row.flops / row.seconds / 1e12,
                     row.onewave_seconds > 0 ? row.onewave_seconds / row.seconds : 0.0, row.spread, row.error,
                     row.plan.c_str());
      }
      std::fclose(file);
    }
  }
  CHECK_CUDA(cudaStreamDestroy(stream));
  return failed ? 1 : 0;
}

}  // namespace
}  // namespace attnd::bench

int main(int argc, char** argv) { return attnd::bench::Main(argc, argv); }
