// Fused RoPE + quantise + paged append on the GPU against the CPU reference (DESIGN 4.1, 7).
// Sweep: fp16/bf16 inputs into fp16/bf16/fp8 caches, head dims 64/128/256, page sizes 1/16/128,
// NHD/HND, SHARED/SEPARATE_KV, neox (full, half and odd partial rotary), interleaved and no
// RoPE, FP8 scales that saturate; MLA (ckv/kpe/q_pe); and positions past 131072 (up to 2^20 + 2)
// for bf16 and fp8 caches, MHA and MLA. The pools start as random bytes and q_out
// as NaN; padding tokens (batch index -1, with positions that would otherwise hit real slots)
// are mixed in.
//
// Checks: every byte of every slot no real token owns is unchanged (so padding touched
// nothing), q_out rows of padding tokens stay poisoned, and each written element matches the
// reference's to within one code of its dtype, or within 16 float ulps of the operands' scale
// where the rotation cancels (the GPU's float cos/sin are within 2^-23 of the exact values, the
// host's correctly rounded: they may differ by an ulp or two, which can move a rounding), with
// at most 1% of elements differing at all.
#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <ostream>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "attnd/kernels/cuda/append.h"
#include "attnd/kernels/rope.h"
#include "gtest/gtest.h"
#include "kernel_test_util.h"
#include "reference/append.h"

namespace attnd {
namespace {

using kernel_test::DeviceBuffer;
using kernel_test::DevicePageTable;
using kernel_test::HostPageTable;
using kernel_test::Upload;

struct AppendCase {
  DType in_dtype = DType::kBFloat16;
  DType cache_dtype = DType::kBFloat16;
  int32_t head_dim = 128;
  int32_t num_qo_heads = 8;
  int32_t num_kv_heads = 2;
  int32_t page_size = 16;
  KvLayout layout = KvLayout::kNHD;
  bool separate_kv = false;
  RopeStyle rope = RopeStyle::kNeox;
  int32_t rotary_dim = 0;  // 0: head_dim
  bool with_q = true;
  uint32_t seed = 1;
  bool long_positions = false;  // MakeLongStep instead of MakeStep
  int32_t many_tokens = 0;      // > 0: MakeManyStep with about this many rows
};

std::string CaseName(const AppendCase& c) {
  std::string rope = c.rope == RopeStyle::kNone ? "norope"
                     : c.rope == RopeStyle::kNeox ? "neox" : "inter";
  return std::string(kernel_test::ShortName(c.in_dtype)) + "_to_" +
         kernel_test::ShortName(c.cache_dtype) + "_d" + std::to_string(c.head_dim) + "_p" +
         std::to_string(c.page_size) + (c.layout == KvLayout::kNHD ? "_nhd" : "_hnd") +
         (c.separate_kv ? "_sep_" : "_") + rope + std::to_string(c.rotary_dim) +
         (c.with_q ? "" : "_noq") + (c.long_positions ? "_long" : "") +
         (c.many_tokens > 0 ? "_t" + std::to_string(c.many_tokens) : "");
}

// Distance in codes between two stored values of a 1- or 2-byte dtype (sign-magnitude).
int64_t CodeDistance(DType dtype, const uint8_t* a, const uint8_t* b) {
  auto ordinal = [&](const uint8_t* p) -> int64_t {
    if (DTypeBytes(dtype) == 1) {
      const int64_t magnitude = p[0] & 0x7f;
      return (p[0] & 0x80) ? -magnitude : magnitude;
    }
    uint16_t bits;
    std::memcpy(&bits, p, 2);
    const int64_t magnitude = bits & 0x7fff;
    return (bits & 0x8000) ? -magnitude : magnitude;
  };
  return std::abs(ordinal(a) - ordinal(b));
}

// Compares two pools slot by slot: slots outside `written` must equal `initial` byte for byte
// (on the GPU result; the reference is checked too), written slots must be within one code of
// the reference.
struct Comparison {
  int64_t elements = 0;
  int64_t differing = 0;
  int64_t far = 0;             // more than one code apart
  int64_t unwritten_changed = 0;
};

void CompareBytes(DType dtype, const uint8_t* gpu, const uint8_t* ref, const uint8_t* initial,
                  int64_t count, bool written, double abs_tolerance, Comparison* result) {
  const int bytes = DTypeBytes(dtype);
  for (int64_t i = 0; i < count; ++i) {
    const uint8_t* g = gpu + i * bytes;
    const uint8_t* r = ref + i * bytes;
    if (!written) {
      if (std::memcmp(g, initial + i * bytes, bytes) != 0) ++result->unwritten_changed;
      continue;
    }
    ++result->elements;
    if (std::memcmp(g, r, bytes) == 0) continue;
    ++result->differing;
    if (CodeDistance(dtype, g, r) > 1 &&
        !(std::fabs(LoadAsFloat(dtype, g, 0) - LoadAsFloat(dtype, r, 0)) <= abs_tolerance)) {
      ++result->far;
    }
  }
}

void ExpectClose(const char* what, const Comparison& c) {
  EXPECT_EQ(c.unwritten_changed, 0) << what << ": bytes outside the appended slots changed";
  EXPECT_EQ(c.far, 0) << what << ": elements more than one code from the reference";
  EXPECT_LE(c.differing, c.elements / 100 + 1) << what << ": " << c.differing << " of "
                                               << c.elements << " elements differ";
}

// The step: requests with prior lengths get new tokens at their end; padding rows interleave.
struct AppendStep {
  HostPageTable table;  // lengths include the new tokens
  std::vector<int32_t> batch_indices;
  std::vector<int32_t> positions;
  // Per pool slot (page * page_size + entry): does a real token write it?
  std::vector<bool> k_written, v_written;
};

// Requests of `prior` tokens get `fresh` new ones each; padding rows (one in four, their
// positions naming real slots) interleave, and one far-off padding row ends the step.
AppendStep MakeStepOf(const std::vector<int64_t>& prior, const std::vector<int64_t>& fresh,
                      int32_t page_size, bool separate_kv, std::mt19937& rng) {
  AppendStep step;
  std::vector<int64_t> total;
  for (size_t b = 0; b < prior.size(); ++b) total.push_back(prior[b] + fresh[b]);
  step.table = kernel_test::MakePageTable(total, page_size, separate_kv, 2, rng);
  std::uniform_int_distribution<int32_t> coin(0, 3);
  for (size_t b = 0; b < prior.size(); ++b) {
    for (int64_t t = prior[b]; t < total[b]; ++t) {
      if (coin(rng) == 0) {
        // Padding whose position names a real slot: it must still write nothing.
        step.batch_indices.push_back(-1);
        step.positions.push_back(static_cast<int32_t>(t));
      }
      step.batch_indices.push_back(static_cast<int32_t>(b));
      step.positions.push_back(static_cast<int32_t>(t));
    }
  }
  step.batch_indices.push_back(-1);
  step.positions.push_back(123456);
  const int64_t slots = step.table.num_pages * page_size;
  step.k_written.assign(slots, false);
  step.v_written.assign(slots, false);
  for (size_t i = 0; i < step.batch_indices.size(); ++i) {
    const int32_t b = step.batch_indices[i];
    if (b < 0) continue;
    const int32_t slot = step.table.indptr[b] + step.positions[i] / page_size;
    const int32_t entry = step.positions[i] % page_size;
    step.k_written[int64_t{step.table.k_indices[slot]} * page_size + entry] = true;
    step.v_written[int64_t{step.table.v_indices[slot]} * page_size + entry] = true;
  }
  return step;
}

AppendStep MakeStep(int32_t page_size, bool separate_kv, std::mt19937& rng) {
  const std::vector<int64_t> prior = {0, 5, page_size - 1 > 0 ? page_size - 1 : 1, 3 * page_size, 40};
  const std::vector<int64_t> fresh = {7, 1, 2, page_size + 2, 0};
  return MakeStepOf(prior, fresh, page_size, separate_kv, rng);
}

// About `tokens` rows (a quarter more with the padding) over 37 requests of random prior
// lengths: past the launcher's small-step grid (1024 tokens), where CTAs run every job of
// their tokens and the grid may be smaller than the token groups.
AppendStep MakeManyStep(int32_t page_size, bool separate_kv, int32_t tokens, std::mt19937& rng) {
  constexpr int kRequests = 37;
  std::uniform_int_distribution<int64_t> prior_length(0, 300);
  std::vector<int64_t> prior, fresh;
  const int64_t real = tokens * 4 / 5;
  for (int b = 0; b < kRequests; ++b) {
    prior.push_back(prior_length(rng));
    fresh.push_back(real / kRequests + (b < real % kRequests ? 1 : 0));
  }
  return MakeStepOf(prior, fresh, page_size, separate_kv, rng);
}

// Requests deep into their sequences (new tokens at positions 131069 to 2^20 + 2): each page
// list covers every earlier position, but only the pages that hold new tokens are distinct;
// the rest all name page 0, which no token writes (so it must come back unchanged).
AppendStep MakeLongStep(int32_t page_size, bool separate_kv, std::mt19937& rng) {
  const std::vector<int64_t> prior = {131069, 131072, 200003, int64_t{1} << 20};
  const std::vector<int64_t> fresh = {5, 1, 9, 3};
  AppendStep step;
  HostPageTable& table = step.table;
  table.page_size = page_size;
  int32_t next_k = 1, next_v = 1;
  for (size_t b = 0; b < prior.size(); ++b) {
    const int64_t total = prior[b] + fresh[b];
    const int64_t pages = (total + page_size - 1) / page_size;
    for (int64_t p = 0; p < pages; ++p) {
      const bool holds_new = (p + 1) * page_size > prior[b];
      table.k_indices.push_back(holds_new ? next_k++ : 0);
      // SEPARATE_KV: V ids in reverse order of K's.
      table.v_indices.push_back(holds_new ? (separate_kv ? -(next_v++) : table.k_indices.back()) : 0);
    }
    table.indptr.push_back(static_cast<int32_t>(table.k_indices.size()));
    table.last_page_len.push_back(static_cast<int32_t>(total - (pages - 1) * page_size));
  }
  table.num_pages = next_k;
  for (int32_t& id : table.v_indices) {
    if (id < 0) id = next_k + id;  // -1 .. -(n) -> n .. 1
  }
  std::uniform_int_distribution<int32_t> coin(0, 2);
  for (size_t b = 0; b < prior.size(); ++b) {
    for (int64_t t = prior[b]; t < prior[b] + fresh[b]; ++t) {
      if (coin(rng) == 0) {
        step.batch_indices.push_back(-1);
        step.positions.push_back(static_cast<int32_t>(t));
      }
      step.batch_indices.push_back(static_cast<int32_t>(b));
      step.positions.push_back(static_cast<int32_t>(t));
    }
  }
  const int64_t slots = table.num_pages * page_size;
  step.k_written.assign(slots, false);
  step.v_written.assign(slots, false);
  for (size_t i = 0; i < step.batch_indices.size(); ++i) {
    const int32_t b = step.batch_indices[i];
    if (b < 0) continue;
    const int32_t slot = table.indptr[b] + step.positions[i] / page_size;
    const int32_t entry = step.positions[i] % page_size;
    step.k_written[int64_t{table.k_indices[slot]} * page_size + entry] = true;
    step.v_written[int64_t{table.v_indices[slot]} * page_size + entry] = true;
  }
  return step;
}

// Compares one pool (all heads of every slot) of the GPU and reference results.
Comparison ComparePool(const PagedKvView& view, const std::vector<uint8_t>& gpu,
                       const std::vector<uint8_t>& ref, const std::vector<uint8_t>& initial,
                       const std::vector<bool>& written, double abs_tolerance) {
  Comparison result;
  const int bytes = DTypeBytes(view.dtype);
  for (int64_t page = 0; page < view.num_pages; ++page) {
    for (int32_t entry = 0; entry < view.page_size; ++entry) {
      for (int32_t head = 0; head < view.num_heads; ++head) {
        const int64_t offset = view.Offset(page, entry, head) * bytes;
        CompareBytes(view.dtype, gpu.data() + offset, ref.data() + offset, initial.data() + offset,
                     view.head_dim, written[page * view.page_size + entry], abs_tolerance, &result);
      }
    }
  }
  return result;
}

Comparison CompareQ(DType dtype, int64_t row_elements, const AppendStep& step,
                    const std::vector<uint8_t>& gpu, const std::vector<uint8_t>& ref,
                    const std::vector<uint8_t>& poison, double abs_tolerance) {
  Comparison result;
  const int bytes = DTypeBytes(dtype);
  for (size_t t = 0; t < step.batch_indices.size(); ++t) {
    const int64_t offset = static_cast<int64_t>(t) * row_elements * bytes;
    CompareBytes(dtype, gpu.data() + offset, ref.data() + offset, poison.data() + offset,
                 row_elements, step.batch_indices[t] >= 0, abs_tolerance, &result);
  }
  return result;
}

class AppendSweepTest : public ::testing::TestWithParam<AppendCase> {};

TEST_P(AppendSweepTest, MatchesReference) {
  ATTND_SKIP_WITHOUT_GPU();
  const AppendCase& c = GetParam();
  std::mt19937 rng(c.seed);
  AppendStep step = c.many_tokens > 0 ? MakeManyStep(c.page_size, c.separate_kv, c.many_tokens, rng)
                    : c.long_positions ? MakeLongStep(c.page_size, c.separate_kv, rng)
                                       : MakeStep(c.page_size, c.separate_kv, rng);
  const int64_t num_tokens = static_cast<int64_t>(step.batch_indices.size());
  const int32_t rotary_dim = c.rotary_dim > 0 ? c.rotary_dim : c.head_dim;
  RopeConfig rope_config;
  rope_config.style = c.rope;
  rope_config.rotary_dim = rotary_dim;
  rope_config.theta = 10000.0;
  const std::vector<float> inv_freq = RopeInverseFrequencies(rope_config);

  // FP8: inputs reach past 448 * scale so saturation is exercised.
  const float range = c.cache_dtype == DType::kFloat8E4M3 ? 600.0f : 4.0f;
  const float k_scale = c.cache_dtype == DType::kFloat8E4M3 ? 0.5f : 1.0f;
  const float v_scale = c.cache_dtype == DType::kFloat8E4M3 ? 2.0f : 1.0f;
  std::vector<uint8_t> q_in = kernel_test::RandomElements(
      c.in_dtype, num_tokens * c.num_qo_heads * c.head_dim, range, rng);
  std::vector<uint8_t> k_in = kernel_test::RandomElements(
      c.in_dtype, num_tokens * c.num_kv_heads * c.head_dim, range, rng);
  std::vector<uint8_t> v_in = kernel_test::RandomElements(
      c.in_dtype, num_tokens * c.num_kv_heads * c.head_dim, range, rng);
  std::vector<uint8_t> q_poison(q_in.size(), 0xff);
  const int64_t pool_bytes = step.table.num_pages * c.page_size * c.num_kv_heads *
                             int64_t{c.head_dim} * DTypeBytes(c.cache_dtype);
  std::vector<uint8_t> k_initial(pool_bytes), v_initial(pool_bytes);
  for (auto& byte : k_initial) byte = static_cast<uint8_t>(rng());
  for (auto& byte : v_initial) byte = static_cast<uint8_t>(rng());

  auto make_pool = [&](void* data) {
    return PagedKvView{data, c.cache_dtype, c.layout, step.table.num_pages, c.page_size,
                       c.num_kv_heads, c.head_dim};
  };

  // Reference on host copies.
  std::vector<uint8_t> ref_q = q_poison, ref_k = k_initial, ref_v = v_initial;
  reference::AppendArgs ref_args;
  ref_args.tokens = AppendIndexView{num_tokens, step.batch_indices.data(), step.positions.data()};
  ref_args.pages = step.table.View();
  ref_args.rope_style = c.rope;
  ref_args.rope_inv_freq = inv_freq;
  if (c.with_q) {
    ref_args.q_in = TokenHeadsView{q_in.data(), c.in_dtype, num_tokens, c.num_qo_heads, c.head_dim};
    ref_args.q_out = TokenHeadsView{ref_q.data(), c.in_dtype, num_tokens, c.num_qo_heads, c.head_dim};
  }
  ref_args.k_in = TokenHeadsView{k_in.data(), c.in_dtype, num_tokens, c.num_kv_heads, c.head_dim};
  ref_args.v_in = TokenHeadsView{v_in.data(), c.in_dtype, num_tokens, c.num_kv_heads, c.head_dim};
  ref_args.k_cache = make_pool(ref_k.data());
  ref_args.v_cache = make_pool(ref_v.data());
  ref_args.k_scale = k_scale;
  ref_args.v_scale = v_scale;
  reference::AppendKv(ref_args);

  // GPU.
  DevicePageTable table(step.table, c.separate_kv);
  DeviceBuffer batch_indices = Upload(step.batch_indices);
  DeviceBuffer positions = Upload(step.positions);
  DeviceBuffer inv_freq_device = Upload(inv_freq);
  DeviceBuffer q_in_device = Upload(q_in), k_in_device = Upload(k_in), v_in_device = Upload(v_in);
  DeviceBuffer q_out_device = Upload(q_poison);
  DeviceBuffer k_pool = Upload(k_initial), v_pool = Upload(v_initial);
  cuda::AppendKvArgs args;
  args.tokens = AppendIndexView{num_tokens, batch_indices.as<int32_t>(), positions.as<int32_t>()};
  args.pages = table.view;
  args.rope_style = c.rope;
  args.rope_inv_freq = inv_freq_device.as<float>();
  args.rotary_dim = c.rope == RopeStyle::kNone ? 0 : rotary_dim;
  if (c.with_q) {
    args.q_in = TokenHeadsView{q_in_device.get(), c.in_dtype, num_tokens, c.num_qo_heads, c.head_dim};
    args.q_out = TokenHeadsView{q_out_device.get(), c.in_dtype, num_tokens, c.num_qo_heads, c.head_dim};
  }
  args.k_in = TokenHeadsView{k_in_device.get(), c.in_dtype, num_tokens, c.num_kv_heads, c.head_dim};
  args.v_in = TokenHeadsView{v_in_device.get(), c.in_dtype, num_tokens, c.num_kv_heads, c.head_dim};
  args.k_cache = make_pool(k_pool.get());
  args.v_cache = make_pool(v_pool.get());
  args.k_scale = k_scale;
  args.v_scale = v_scale;
  const absl::Status status = cuda::AppendKv(args, nullptr);
  ASSERT_TRUE(status.ok()) << status;
  ATTND_ASSERT_CUDA(cudaDeviceSynchronize());

  const std::vector<uint8_t> gpu_q = kernel_test::Download<uint8_t>(q_out_device, q_poison.size());
  const std::vector<uint8_t> gpu_k = kernel_test::Download<uint8_t>(k_pool, pool_bytes);
  const std::vector<uint8_t> gpu_v = kernel_test::Download<uint8_t>(v_pool, pool_bytes);
  const double tolerance = 16 * 0x1p-24 * range;
  ExpectClose("k pool", ComparePool(make_pool(nullptr), gpu_k, ref_k, k_initial, step.k_written,
                                    tolerance / k_scale));
  ExpectClose("v pool", ComparePool(make_pool(nullptr), gpu_v, ref_v, v_initial, step.v_written,
                                    tolerance / v_scale));
  // The reference obeys the same rule (sanity of the oracle and of the written-slot mask).
  EXPECT_EQ(ComparePool(make_pool(nullptr), ref_k, ref_k, k_initial, step.k_written, 0)
                .unwritten_changed,
            0);
  if (c.with_q) {
    ExpectClose("q_out", CompareQ(c.in_dtype, int64_t{c.num_qo_heads} * c.head_dim, step, gpu_q,
                                  ref_q, q_poison, tolerance));
  } else {
    EXPECT_EQ(gpu_q, q_poison) << "q_out written without q";
  }
}

std::vector<AppendCase> AppendCases() {
  std::vector<AppendCase> cases;
  uint32_t seed = 1;
  for (DType in_dtype : {DType::kFloat16, DType::kBFloat16}) {
    for (DType cache_dtype : {DType::kFloat16, DType::kBFloat16, DType::kFloat8E4M3}) {
      for (int32_t head_dim : {64, 128, 256}) {
        for (int32_t page_size : {1, 16, 128}) {
          for (KvLayout layout : {KvLayout::kNHD, KvLayout::kHND}) {
            AppendCase c;
            c.in_dtype = in_dtype;
            c.cache_dtype = cache_dtype;
            c.head_dim = head_dim;
            c.page_size = page_size;
            c.layout = layout;
            c.separate_kv = seed % 2 == 0;
            // Cycle the rotary variants through the sweep.
            switch (seed % 5) {
              case 0:
                c.rope = RopeStyle::kNeox;
                break;
              case 1:
                c.rope = RopeStyle::kInterleaved;
                break;
              case 2:
                c.rope = RopeStyle::kNeox;
                c.rotary_dim = head_dim / 2;
                break;
              case 3:
                c.rope = RopeStyle::kNeox;
                c.rotary_dim = head_dim == 64 ? 24 : 40;  // half not a multiple of 16
                break;
              case 4:
                c.rope = seed % 3 == 0 ? RopeStyle::kNone : RopeStyle::kInterleaved;
                c.rotary_dim = c.rope == RopeStyle::kNone ? 0 : 26;
                break;
            }
            c.with_q = seed % 7 != 3;
            c.seed = seed++;
            cases.push_back(c);
          }
        }
      }
    }
  }
  return cases;
}

// gtest prints a parameter in test listings and failures; without this, as raw bytes
// (padding included), which change from build to build.
void PrintTo(const AppendCase& c, std::ostream* os) { *os << CaseName(c); }

INSTANTIATE_TEST_SUITE_P(Sweep, AppendSweepTest, ::testing::ValuesIn(AppendCases()),
                         [](const ::testing::TestParamInfo<AppendCase>& info) {
                           return CaseName(info.param) + "_" + std::to_string(info.index);
                         });

// Positions past 131072 (issue 15: the kernel's float cos/sin against the reference's), bf16 and
// fp8 caches, neox (shuffled partners on 16-bit caches) and interleaved.
INSTANTIATE_TEST_SUITE_P(
    LongPositions, AppendSweepTest,
    ::testing::Values(AppendCase{DType::kBFloat16, DType::kBFloat16, 128, 8, 2, 16, KvLayout::kNHD, false,
                                 RopeStyle::kNeox, 0, true, 21, true},
                      AppendCase{DType::kFloat16, DType::kFloat8E4M3, 128, 8, 2, 16, KvLayout::kNHD, true,
                                 RopeStyle::kNeox, 0, true, 22, true},
                      AppendCase{DType::kBFloat16, DType::kBFloat16, 64, 4, 1, 64, KvLayout::kHND, true,
                                 RopeStyle::kInterleaved, 0, true, 23, true},
                      AppendCase{DType::kBFloat16, DType::kFloat8E4M3, 256, 4, 1, 1, KvLayout::kNHD, false,
                                 RopeStyle::kNeox, 64, true, 24, true}),
    [](const ::testing::TestParamInfo<AppendCase>& info) { return CaseName(info.param); });

// Steps of about 300 rows (CTAs of 2 tokens, one job each), 700 (4 tokens, one job each) and 1100
// to 5000 (every job in each CTA), every dtype pair's kind and both rotary styles.
AppendCase ManyTokens(DType in_dtype, DType cache_dtype, int32_t head_dim, int32_t page_size,
                      KvLayout layout, bool separate_kv, RopeStyle rope, int32_t rotary_dim,
                      bool with_q, uint32_t seed, int32_t tokens, int32_t num_qo_heads = 8,
                      int32_t num_kv_heads = 2) {
  AppendCase c{in_dtype, cache_dtype, head_dim, num_qo_heads, num_kv_heads, page_size, layout,
               separate_kv, rope, rotary_dim, with_q, seed, false};
  c.many_tokens = tokens;
  return c;
}

INSTANTIATE_TEST_SUITE_P(
    ManyTokens, AppendSweepTest,
    ::testing::Values(
        ManyTokens(DType::kBFloat16, DType::kBFloat16, 128, 16, KvLayout::kNHD, false,
                   RopeStyle::kNeox, 0, true, 31, 1100),
        ManyTokens(DType::kFloat16, DType::kFloat8E4M3, 128, 16, KvLayout::kNHD, true,
                   RopeStyle::kNeox, 0, true, 32, 3001),
        ManyTokens(DType::kBFloat16, DType::kBFloat16, 64, 1, KvLayout::kHND, true,
                   RopeStyle::kInterleaved, 0, true, 33, 5003),
        ManyTokens(DType::kBFloat16, DType::kFloat8E4M3, 256, 128, KvLayout::kNHD, false,
                   RopeStyle::kNeox, 40, true, 34, 2500),
        ManyTokens(DType::kFloat16, DType::kFloat16, 128, 16, KvLayout::kHND, false,
                   RopeStyle::kNone, 0, false, 35, 4100),
        ManyTokens(DType::kBFloat16, DType::kBFloat16, 128, 16, KvLayout::kNHD, false,
                   RopeStyle::kNeox, 0, true, 36, 300),
        ManyTokens(DType::kFloat16, DType::kFloat8E4M3, 64, 8, KvLayout::kHND, true,
                   RopeStyle::kInterleaved, 0, true, 37, 700)),
    [](const ::testing::TestParamInfo<AppendCase>& info) { return CaseName(info.param); });

// Steps of about 10000 rows (the largest grids; a staged kernel took them until 2026-11-27), 3 to
// 32 KB of rows a token, both rotary styles, token counts that leave a partial last CTA.
INSTANTIATE_TEST_SUITE_P(
    LargeSteps, AppendSweepTest,
    ::testing::Values(
        ManyTokens(DType::kBFloat16, DType::kBFloat16, 128, 16, KvLayout::kNHD, false,
                   RopeStyle::kNeox, 0, true, 41, 10243, 8, 2),
        ManyTokens(DType::kFloat16, DType::kFloat8E4M3, 128, 16, KvLayout::kNHD, true,
                   RopeStyle::kNeox, 0, true, 42, 10301, 40, 8),
        ManyTokens(DType::kBFloat16, DType::kBFloat16, 128, 8, KvLayout::kHND, false,
                   RopeStyle::kInterleaved, 64, true, 43, 10402, 64, 8),
        ManyTokens(DType::kBFloat16, DType::kFloat8E4M3, 256, 16, KvLayout::kNHD, false,
                   RopeStyle::kNeox, 0, true, 44, 10251, 48, 8),
        ManyTokens(DType::kFloat16, DType::kFloat16, 64, 1, KvLayout::kHND, true,
                   RopeStyle::kNone, 0, false, 45, 10500, 8, 4)),
    [](const ::testing::TestParamInfo<AppendCase>& info) {
      return CaseName(info.param) + "_h" + std::to_string(info.param.num_qo_heads) + "_" +
             std::to_string(info.param.num_kv_heads);
    });

// A few for compute-sanitizer.
INSTANTIATE_TEST_SUITE_P(
    SanitizerAppend, AppendSweepTest,
    ::testing::Values(AppendCase{DType::kBFloat16, DType::kFloat8E4M3, 64, 4, 1, 1, KvLayout::kHND,
                                 true, RopeStyle::kNeox, 24, true, 11},
                      AppendCase{DType::kFloat16, DType::kBFloat16, 256, 8, 2, 16, KvLayout::kNHD,
                                 false, RopeStyle::kInterleaved, 0, true, 12}),
    [](const ::testing::TestParamInfo<AppendCase>& info) { return CaseName(info.param); });

// (cache dtype, page size, positions past 131072, rows of a large step: 0 for a small one; about
// 3000 or 10000 run every job in each CTA)
class AppendMlaTest : public ::testing::TestWithParam<std::tuple<DType, int32_t, bool, int32_t>> {};

TEST_P(AppendMlaTest, MatchesReference) {
  ATTND_SKIP_WITHOUT_GPU();
  const auto [cache_dtype, page_size, long_positions, many_rows] = GetParam();
  const DType in_dtype = DType::kBFloat16;
  constexpr int32_t kLora = 512, kRope = 64, kHeads = 16;
  std::mt19937 rng(77 + page_size);
  AppendStep step = many_rows > 0    ? MakeManyStep(page_size, /*separate_kv=*/true, many_rows, rng)
                    : long_positions ? MakeLongStep(page_size, /*separate_kv=*/true, rng)
                                     : MakeStep(page_size, /*separate_kv=*/true, rng);
  const int64_t num_tokens = static_cast<int64_t>(step.batch_indices.size());
  RopeConfig rope_config;
  rope_config.style = RopeStyle::kNeox;
  rope_config.rotary_dim = kRope;
  const std::vector<float> inv_freq = RopeInverseFrequencies(rope_config);
  const float scale = cache_dtype == DType::kFloat8E4M3 ? 0.25f : 1.0f;
  std::vector<uint8_t> q_pe = kernel_test::RandomElements(in_dtype, num_tokens * kHeads * kRope, 50, rng);
  std::vector<uint8_t> ckv = kernel_test::RandomElements(in_dtype, num_tokens * kLora, 50, rng);
  std::vector<uint8_t> kpe = kernel_test::RandomElements(in_dtype, num_tokens * kRope, 50, rng);
  std::vector<uint8_t> q_poison(q_pe.size(), 0xff);
  const int64_t slots = step.table.num_pages * page_size;
  std::vector<uint8_t> ckv_initial(slots * kLora * DTypeBytes(cache_dtype));
  std::vector<uint8_t> kpe_initial(slots * kRope * DTypeBytes(cache_dtype));
  for (auto& byte : ckv_initial) byte = static_cast<uint8_t>(rng());
  for (auto& byte : kpe_initial) byte = static_cast<uint8_t>(rng());
  auto pool = [&](void* data, int32_t dim) {
    return PagedKvView{data, cache_dtype, KvLayout::kNHD, step.table.num_pages, page_size, 1, dim};
  };

  std::vector<uint8_t> ref_q = q_poison, ref_ckv = ckv_initial, ref_kpe = kpe_initial;
  reference::MlaAppendArgs ref_args;
  ref_args.tokens = AppendIndexView{num_tokens, step.batch_indices.data(), step.positions.data()};
  ref_args.pages = step.table.View();
  ref_args.rope_style = RopeStyle::kNeox;
  ref_args.rope_inv_freq = inv_freq;
  ref_args.q_pe_in = TokenHeadsView{q_pe.data(), in_dtype, num_tokens, kHeads, kRope};
  ref_args.q_pe_out = TokenHeadsView{ref_q.data(), in_dtype, num_tokens, kHeads, kRope};
  ref_args.ckv_in = TokenHeadsView{ckv.data(), in_dtype, num_tokens, 1, kLora};
  ref_args.kpe_in = TokenHeadsView{kpe.data(), in_dtype, num_tokens, 1, kRope};
  ref_args.ckv_cache = pool(ref_ckv.data(), kLora);
  ref_args.kpe_cache = pool(ref_kpe.data(), kRope);
  ref_args.ckv_scale = scale;
  ref_args.kpe_scale = scale;
  reference::AppendMla(ref_args);

  DevicePageTable table(step.table, true);
  DeviceBuffer batch_indices = Upload(step.batch_indices), positions = Upload(step.positions);
  DeviceBuffer inv_freq_device = Upload(inv_freq);
  DeviceBuffer q_in_device = Upload(q_pe), ckv_device = Upload(ckv), kpe_device = Upload(kpe);
  DeviceBuffer q_out_device = Upload(q_poison);
  DeviceBuffer ckv_pool = Upload(ckv_initial), kpe_pool = Upload(kpe_initial);
  cuda::AppendMlaArgs args;
  args.tokens = AppendIndexView{num_tokens, batch_indices.as<int32_t>(), positions.as<int32_t>()};
  args.pages = table.view;
  args.rope_style = RopeStyle::kNeox;
  args.rope_inv_freq = inv_freq_device.as<float>();
  args.q_pe_in = TokenHeadsView{q_in_device.get(), in_dtype, num_tokens, kHeads, kRope};
  args.q_pe_out = TokenHeadsView{q_out_device.get(), in_dtype, num_tokens, kHeads, kRope};
  args.ckv_in = TokenHeadsView{ckv_device.get(), in_dtype, num_tokens, 1, kLora};
  args.kpe_in = TokenHeadsView{kpe_device.get(), in_dtype, num_tokens, 1, kRope};
  args.ckv_cache = pool(ckv_pool.get(), kLora);
  args.kpe_cache = pool(kpe_pool.get(), kRope);
  args.ckv_scale = scale;
  args.kpe_scale = scale;
  const absl::Status status = cuda::AppendMla(args, nullptr);
  ASSERT_TRUE(status.ok()) << status;
  ATTND_ASSERT_CUDA(cudaDeviceSynchronize());

  const double tolerance = 16 * 0x1p-24 * 50;
  ExpectClose("ckv", ComparePool(pool(nullptr, kLora),
                                 kernel_test::Download<uint8_t>(ckv_pool, ckv_initial.size()),
                                 ref_ckv, ckv_initial, step.k_written, 0));
  ExpectClose("kpe", ComparePool(pool(nullptr, kRope),
                                 kernel_test::Download<uint8_t>(kpe_pool, kpe_initial.size()),
                                 ref_kpe, kpe_initial, step.v_written, tolerance / scale));
  ExpectClose("q_pe", CompareQ(in_dtype, int64_t{kHeads} * kRope, step,
                               kernel_test::Download<uint8_t>(q_out_device, q_poison.size()),
                               ref_q, q_poison, tolerance));
}

INSTANTIATE_TEST_SUITE_P(Mla, AppendMlaTest,
                         ::testing::Values(std::tuple{DType::kBFloat16, 1, false, 0},
                                           std::tuple{DType::kBFloat16, 64, false, 0},
                                           std::tuple{DType::kFloat8E4M3, 16, false, 0},
                                           std::tuple{DType::kBFloat16, 64, true, 0},
                                           std::tuple{DType::kFloat8E4M3, 64, true, 0},
                                           std::tuple{DType::kBFloat16, 64, false, 3003},
                                           std::tuple{DType::kFloat8E4M3, 16, false, 2999},
                                           std::tuple{DType::kBFloat16, 64, false, 10301},
                                           std::tuple{DType::kFloat8E4M3, 16, false, 10301}),
                         [](const auto& info) {
                           return std::string(kernel_test::ShortName(std::get<0>(info.param))) + "_p" +
                                  std::to_string(std::get<1>(info.param)) +
                                  (std::get<2>(info.param) ? "_long" : "") +
                                  (std::get<3>(info.param) > 0 ? "_rows" + std::to_string(std::get<3>(info.param))
                                                               : "");
                         });

TEST(AppendArgsTest, RejectsRotaryWiderThanHead) {
  cuda::AppendKvArgs args;
  int32_t dummy[4] = {0, 0, 0, 0};
  args.tokens = AppendIndexView{1, dummy, dummy};
  args.pages = PageTableView{1, 16, dummy, dummy, dummy, dummy};
  alignas(16) static uint8_t storage[1 << 14];
  args.k_in = TokenHeadsView{storage, DType::kBFloat16, 1, 1, 64};
  args.v_in = args.k_in;
  args.k_cache = PagedKvView{storage, DType::kBFloat16, KvLayout::kNHD, 1, 16, 1, 64};
  args.v_cache = args.k_cache;
  args.rope_style = RopeStyle::kNeox;
  args.rope_inv_freq = reinterpret_cast<const float*>(storage);
  args.rotary_dim = 128;
  EXPECT_EQ(cuda::AppendKv(args, nullptr).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace attnd
