// Speed of the reference ops as the CPU backend runs them (float32 accumulation), on the
// standard shapes of PERFORMANCE.md scaled to a CPU. Not a test: prints one line per case.
//   reference_cpu_bench [repeats] [substring of the case names to run]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include <sys/resource.h>

#include "reference/append.h"
#include "reference/attention.h"
#include "reference/parallel.h"
#include "reference_test_util.h"

namespace attnd::reference {
namespace {

const char* g_filter = "";

bool Selected(const std::string& name) { return name.find(g_filter) != std::string::npos; }

using testing::HostTensor;
using testing::PagedCache;
using testing::PagedCacheSpec;

double ProcessCpuSeconds() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return usage.ru_utime.tv_sec + usage.ru_utime.tv_usec * 1e-6 + usage.ru_stime.tv_sec +
         usage.ru_stime.tv_usec * 1e-6;
}

// CPU seconds per run of the last measurement: on a shared machine wall time also counts other
// processes' turns, CPU time much less so.
double g_cpu_seconds = 0;

double MedianSeconds(int repeats, const std::function<void()>& body) {
  body();  // warm-up: thread pool, workspaces
  std::vector<double> seconds;
  const double cpu_start = ProcessCpuSeconds();
  for (int i = 0; i < repeats; ++i) {
    const auto start = std::chrono::steady_clock::now();
    body();
    seconds.push_back(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  g_cpu_seconds = (ProcessCpuSeconds() - cpu_start) / repeats;
  std::sort(seconds.begin(), seconds.end());
  return seconds[seconds.size() / 2];
}

// Hq 32, Hkv 8, D 128, bf16, page 16, NHD.
void BenchAttention(const std::string& name, const std::vector<int64_t>& kv_lens,
                    const std::vector<int32_t>& q_lens, bool causal, int repeats,
                    Accumulation accumulation = Accumulation::kFloat32) {
  if (!Selected(name)) return;
  PagedCacheSpec spec;
  spec.num_heads = 8;
  spec.head_dim = 128;
  spec.page_size = 16;
  spec.kv_lens = kv_lens;
  PagedCache cache(spec);
  std::vector<int32_t> qo_indptr{0};
  for (int32_t len : q_lens) qo_indptr.push_back(qo_indptr.back() + len);
  std::mt19937 rng(1);
  HostTensor q = HostTensor::Random(DType::kBFloat16, qo_indptr.back(), 32, 128, rng);
  HostTensor o = HostTensor::Poisoned(DType::kBFloat16, qo_indptr.back(), 32, 128);
  std::vector<float> lse(qo_indptr.back() * 32);
  BatchAttentionArgs args;
  args.q = q.View();
  args.qo_indptr = qo_indptr.data();
  args.pages = cache.Table();
  args.k_cache = cache.KView();
  args.v_cache = cache.VView();
  args.params.causal = causal;
  args.params.sm_scale = 1.0f / std::sqrt(128.0f);
  args.o = o.View();
  args.lse = lse.data();
  args.accumulation = accumulation;
  const double seconds = MedianSeconds(repeats, [&] { BatchAttention(args); });

  double flops = 0, kv_bytes = 0;
  for (size_t b = 0; b < kv_lens.size(); ++b) {
    kv_bytes += 2.0 * kv_lens[b] * 8 * 128 * 2;
    for (int64_t i = 0; i < q_lens[b]; ++i) {
      const int64_t visible = causal ? kv_lens[b] - q_lens[b] + i + 1 : kv_lens[b];
      flops += 4.0 * 32 * 128 * visible;
    }
  }
  std::printf("%-44s %9.2f ms (cpu %8.2f ms) %7.1f GFLOP/s %6.2f GB/s of KV\n", name.c_str(),
              seconds * 1e3, g_cpu_seconds * 1e3, flops / seconds * 1e-9,
              kv_bytes / seconds * 1e-9);
}

void BenchAppend(int64_t num_tokens, int repeats) {
  const std::string name = "append fp16->fp8 neox, " + std::to_string(num_tokens) + " tokens";
  if (!Selected(name)) return;
  PagedCacheSpec spec;
  spec.num_heads = 8;
  spec.head_dim = 128;
  spec.kv_lens = {num_tokens};
  spec.dtype = DType::kFloat8E4M3;
  PagedCache cache(spec);
  std::vector<int32_t> batch(num_tokens, 0), positions(num_tokens);
  for (int64_t t = 0; t < num_tokens; ++t) positions[t] = static_cast<int32_t>(t);
  std::mt19937 rng(2);
  HostTensor q = HostTensor::Random(DType::kFloat16, num_tokens, 32, 128, rng);
  HostTensor q_out = HostTensor::Poisoned(DType::kFloat16, num_tokens, 32, 128);
  HostTensor k = HostTensor::Random(DType::kFloat16, num_tokens, 8, 128, rng);
  HostTensor v = HostTensor::Random(DType::kFloat16, num_tokens, 8, 128, rng);
  RopeConfig rope;
  rope.style = RopeStyle::kNeox;
  rope.rotary_dim = 128;
  const std::vector<float> inv_freq = RopeInverseFrequencies(rope);
  AppendArgs args;
  args.tokens = {num_tokens, batch.data(), positions.data()};
  args.pages = cache.Table();
  args.rope_style = RopeStyle::kNeox;
  args.rope_inv_freq = inv_freq;
  args.q_in = q.View();
  args.q_out = q_out.View();
  args.k_in = k.View();
  args.v_in = v.View();
  args.k_cache = cache.KView();
  args.v_cache = cache.VView();
  const double seconds = MedianSeconds(repeats, [&] { AppendKv(args); });
  std::printf("%-44s %9.2f ms (cpu %8.2f ms)\n", name.c_str(), seconds * 1e3,
              g_cpu_seconds * 1e3);
}

void BenchMlaDecode(int32_t batch, int64_t kv_len, int repeats) {
  const std::string name =
      "mla decode H16, batch " + std::to_string(batch) + " x kv " + std::to_string(kv_len);
  if (!Selected(name)) return;
  PagedCacheSpec spec;
  spec.num_heads = 1;
  spec.head_dim = 512;
  spec.v_head_dim = 64;
  spec.page_size = 64;
  spec.kv_lens.assign(batch, kv_len);
  PagedCache cache(spec);
  std::vector<int32_t> qo_indptr(batch + 1);
  for (int32_t b = 0; b <= batch; ++b) qo_indptr[b] = b;
  std::mt19937 rng(3);
  HostTensor q_nope = HostTensor::Random(DType::kBFloat16, batch, 16, 512, rng);
  HostTensor q_pe = HostTensor::Random(DType::kBFloat16, batch, 16, 64, rng);
  HostTensor o = HostTensor::Poisoned(DType::kBFloat16, batch, 16, 512);
  MlaAttentionArgs args;
  args.q_nope = q_nope.View();
  args.q_pe = q_pe.View();
  args.qo_indptr = qo_indptr.data();
  args.pages = cache.Table();
  args.ckv_cache = cache.KView();
  args.kpe_cache = cache.VView();
  args.params.sm_scale = 1.0f / std::sqrt(192.0f);
  args.o = o.View();
  const double seconds = MedianSeconds(repeats, [&] { MlaAttention(args); });
  std::printf("%-44s %9.2f ms (cpu %8.2f ms)\n", name.c_str(), seconds * 1e3,
              g_cpu_seconds * 1e3);
}

}  // namespace
}  // namespace attnd::reference

int main(int argc, char** argv) {
  using namespace attnd::reference;
  const int repeats = argc > 1 ? std::max(1, std::atoi(argv[1])) : 5;
  if (argc > 2) g_filter = argv[2];
  std::printf("threads %d; Hq 32, Hkv 8, D 128, bf16 KV, page 16, float32 accumulation\n",
              ParallelismLevel());
  BenchAttention("decode batch 32 x kv 2048",
                 std::vector<int64_t>(32, 2048), std::vector<int32_t>(32, 1), true, repeats);
  BenchAttention("decode batch 1 x kv 4096", {4096}, {1}, true, repeats);
  BenchAttention("prefill 512 rows x kv 512, causal", {512}, {512}, true, repeats);
  BenchAttention("prefill 512 rows x kv 512, non-causal", {512}, {512}, false, repeats);
  BenchAttention("chunked prefill 256 rows x kv 4096, causal", {4096}, {256}, true, repeats);
  {
    std::vector<int64_t> kv(33, 2048);
    std::vector<int32_t> q(33, 1);
    kv[0] = 2048;
    q[0] = 256;
    BenchAttention("mixed 256-row prefill + 32 decodes, kv 2048", kv, q, true, repeats);
  }
  BenchAttention("prefill 512 x 512 causal, float64 (oracle)", {512}, {512}, true,
                 std::max(1, repeats / 2), Accumulation::kFloat64);
  BenchAppend(4096, repeats);
  BenchMlaDecode(16, 4096, repeats);
  return 0;
}
