// AppendKv / AppendMla: RoPE, quantisation and paged stores, and that padding rows touch
// nothing. Expected values are built from RotateHead (itself checked against hand-computed
// rotations in rope_test.cc) and StoreFromFloat.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <utility>
#include <vector>

#include "reference/append.h"
#include "reference_test_util.h"

namespace attnd::reference {
namespace {

using testing::HostTensor;
using testing::PagedCache;
using testing::PagedCacheSpec;

struct Row {
  int32_t request;  // -1: padding
  int32_t position;
};

// Every request's last `new_tokens[b]` positions are appended, with padding rows spliced in.
// Padding rows carry position 0 of request 0's table slot, so a padding row that wrote
// anything would overwrite a live token.
std::vector<Row> NewTokenRows(const std::vector<int64_t>& kv_lens,
                              const std::vector<int32_t>& new_tokens) {
  std::vector<Row> rows = {{-1, 0}};
  for (size_t b = 0; b < kv_lens.size(); ++b) {
    for (int32_t i = 0; i < new_tokens[b]; ++i) {
      rows.push_back({static_cast<int32_t>(b), static_cast<int32_t>(kv_lens[b] - new_tokens[b] + i)});
      if (i == 1) rows.push_back({-1, 0});
    }
  }
  rows.push_back({-1, 0});
  return rows;
}

struct AppendSetup {
  PagedCache cache;
  std::vector<Row> rows;
  std::vector<int32_t> batch_indices;
  std::vector<int32_t> positions;
  HostTensor q_in, q_out, k_in, v_in;
  std::vector<float> inv_freq;
  RopeStyle style = RopeStyle::kNone;

  AppendArgs Args(float k_scale = 1.0f, float v_scale = 1.0f) {
    AppendArgs args;
    args.tokens = {static_cast<int64_t>(rows.size()), batch_indices.data(), positions.data()};
    args.pages = cache.Table();
    args.rope_style = style;
    args.rope_inv_freq = inv_freq;
    args.q_in = q_in.View();
    args.q_out = q_out.View();
    args.k_in = k_in.View();
    args.v_in = v_in.View();
    args.k_cache = cache.KView();
    args.v_cache = cache.VView();
    args.k_scale = k_scale;
    args.v_scale = v_scale;
    return args;
  }
};

AppendSetup MakeAppend(const PagedCacheSpec& spec, const std::vector<int32_t>& new_tokens,
                       int32_t num_qo_heads, RopeStyle style, int32_t rotary_dim,
                       DType input_dtype = DType::kBFloat16, double magnitude = 2.0) {
  AppendSetup setup{PagedCache(spec), NewTokenRows(spec.kv_lens, new_tokens), {}, {}, {}, {}, {},
                    {}, {}, RopeStyle::kNone};
  for (const Row& row : setup.rows) {
    setup.batch_indices.push_back(row.request);
    setup.positions.push_back(row.position);
  }
  const int64_t num_rows = static_cast<int64_t>(setup.rows.size());
  std::mt19937 rng(spec.seed + 7);
  setup.q_in = HostTensor::Random(input_dtype, num_rows, num_qo_heads, spec.head_dim, rng, magnitude);
  setup.q_out = HostTensor::Poisoned(input_dtype, num_rows, num_qo_heads, spec.head_dim);
  setup.k_in = HostTensor::Random(input_dtype, num_rows, spec.num_heads, spec.head_dim, rng, magnitude);
  setup.v_in = HostTensor::Random(input_dtype, num_rows, spec.num_heads, spec.head_dim, rng, magnitude);
  setup.style = style;
  if (style != RopeStyle::kNone) {
    RopeConfig config;
    config.style = style;
    config.rotary_dim = rotary_dim;
    setup.inv_freq = RopeInverseFrequencies(config);
  }
  return setup;
}

// The float32 head `in[row][head]`, rotated as the spec says.
std::vector<float> Rotated(const HostTensor& in, int64_t row, int32_t head, RopeStyle style,
                           const std::vector<float>& inv_freq, int32_t position) {
  std::vector<float> values(in.head_dim);
  for (int32_t d = 0; d < in.head_dim; ++d) values[d] = static_cast<float>(in.At(row, head, d));
  RotateHead(style, inv_freq, position, values);
  return values;
}

// Bytes of `value` stored in `dtype`.
uint32_t StoredBits(DType dtype, float value) {
  uint32_t bits = 0;
  StoreFromFloat(dtype, &bits, 0, value);
  return bits;
}

uint32_t PoolBits(const std::vector<uint8_t>& pool, DType dtype, int64_t element) {
  uint32_t bits = 0;
  std::memcpy(&bits, pool.data() + element * DTypeBytes(dtype), DTypeBytes(dtype));
  return bits;
}

void ExpectStoredRowsMatch(AppendSetup& setup, float k_scale, float v_scale, bool check_q) {
  const DType dtype = setup.cache.spec().dtype;
  for (size_t r = 0; r < setup.rows.size(); ++r) {
    const Row row = setup.rows[r];
    if (row.request < 0) continue;
    for (int32_t h = 0; h < setup.k_in.num_heads; ++h) {
      const std::vector<float> k = Rotated(setup.k_in, r, h, setup.style, setup.inv_freq, row.position);
      const std::vector<float> v = Rotated(setup.v_in, r, h, RopeStyle::kNone, {}, row.position);
      for (int32_t d = 0; d < setup.k_in.head_dim; ++d) {
        ASSERT_EQ(PoolBits(setup.cache.k_pool(), dtype,
                           setup.cache.ElementOffset(row.request, row.position, h, d, false)),
                  StoredBits(dtype, k[d] / k_scale))
            << "k row " << r << " head " << h << " dim " << d;
        ASSERT_EQ(PoolBits(setup.cache.v_pool(), dtype,
                           setup.cache.ElementOffset(row.request, row.position, h, d, true)),
                  StoredBits(dtype, v[d] / v_scale))
            << "v row " << r << " head " << h << " dim " << d;
      }
    }
    if (!check_q) continue;
    for (int32_t h = 0; h < setup.q_in.num_heads; ++h) {
      const std::vector<float> q = Rotated(setup.q_in, r, h, setup.style, setup.inv_freq, row.position);
      for (int32_t d = 0; d < setup.q_in.head_dim; ++d) {
        ASSERT_EQ(PoolBits(setup.q_out.bytes, setup.q_out.dtype,
                           (r * setup.q_out.num_heads + h) * setup.q_out.head_dim + d),
                  StoredBits(setup.q_out.dtype, q[d]))
            << "q row " << r << " head " << h << " dim " << d;
      }
    }
  }
}

// style, layout, page size.
class AppendKvSweep
    : public ::testing::TestWithParam<std::tuple<RopeStyle, KvLayout, int>> {};

TEST_P(AppendKvSweep, StoresRotatedKeysValuesAndQueries) {
  const auto [style, layout, page_size] = GetParam();
  PagedCacheSpec spec;
  spec.num_heads = 2;
  spec.head_dim = 128;
  spec.page_size = page_size;
  spec.layout = layout;
  spec.kv_lens = {1, 40, 17};
  AppendSetup setup = MakeAppend(spec, {1, 9, 17}, 8, style, /*rotary_dim=*/128);
  AppendKv(setup.Args());
  ExpectStoredRowsMatch(setup, 1.0f, 1.0f, /*check_q=*/true);
}

INSTANTIATE_TEST_SUITE_P(
    StylesLayoutsPages, AppendKvSweep,
    ::testing::Combine(::testing::Values(RopeStyle::kNone, RopeStyle::kNeox, RopeStyle::kInterleaved),
                       ::testing::Values(KvLayout::kNHD, KvLayout::kHND), ::testing::Values(1, 16)),
    [](const auto& info) {
      const RopeStyle style = std::get<0>(info.param);
      return std::string(style == RopeStyle::kNone   ? "NoRope"
                         : style == RopeStyle::kNeox ? "Neox"
                                                     : "Interleaved") +
             (std::get<1>(info.param) == KvLayout::kNHD ? "Nhd" : "Hnd") + "Page" +
             std::to_string(std::get<2>(info.param));
    });

TEST(AppendKv, PartialRotaryLeavesTrailingDimsOfQAndKUnrotated) {
  PagedCacheSpec spec;
  spec.num_heads = 1;
  spec.head_dim = 128;
  spec.dtype = DType::kFloat16;
  spec.kv_lens = {30};
  AppendSetup setup = MakeAppend(spec, {5}, 2, RopeStyle::kNeox, /*rotary_dim=*/64,
                                 DType::kFloat16);
  ASSERT_EQ(setup.inv_freq.size(), 32u);
  AppendKv(setup.Args());
  ExpectStoredRowsMatch(setup, 1.0f, 1.0f, true);
  for (size_t r = 0; r < setup.rows.size(); ++r) {
    if (setup.rows[r].request < 0) continue;
    for (int32_t d = 64; d < 128; ++d) {
      EXPECT_EQ(setup.q_out.At(r, 1, d), setup.q_in.At(r, 1, d));
      EXPECT_EQ(setup.cache.K(0, setup.rows[r].position, 0, d), setup.k_in.At(r, 0, d));
    }
  }
}

TEST(AppendKv, PaddingRowsLeaveCacheBytesIdentical) {
  for (const DType dtype : {DType::kBFloat16, DType::kFloat8E4M3}) {
    for (const KvLayout layout : {KvLayout::kNHD, KvLayout::kHND}) {
      PagedCacheSpec spec;
      spec.num_heads = 4;
      spec.head_dim = 64;
      spec.page_size = 8;
      spec.dtype = dtype;
      spec.layout = layout;
      spec.kv_lens = {20, 9};
      AppendSetup setup = MakeAppend(spec, {4, 3}, 8, RopeStyle::kNeox, 64);
      const std::vector<uint8_t> k_before = setup.cache.k_pool();
      const std::vector<uint8_t> v_before = setup.cache.v_pool();
      AppendKv(setup.Args(0.5f, 0.25f));

      // Bytes of the slots the real rows own may change; every other byte of both pools is
      // as it was.
      std::vector<bool> k_owned(k_before.size()), v_owned(v_before.size());
      for (const Row& row : setup.rows) {
        if (row.request < 0) continue;
        for (int32_t h = 0; h < 4; ++h) {
          for (int32_t d = 0; d < 64; ++d) {
            for (int b = 0; b < DTypeBytes(dtype); ++b) {
              k_owned[setup.cache.ElementOffset(row.request, row.position, h, d, false) *
                          DTypeBytes(dtype) + b] = true;
              v_owned[setup.cache.ElementOffset(row.request, row.position, h, d, true) *
                          DTypeBytes(dtype) + b] = true;
            }
          }
        }
      }
      int64_t changed_unowned = 0;
      for (size_t i = 0; i < k_before.size(); ++i)
        changed_unowned += !k_owned[i] && setup.cache.k_pool()[i] != k_before[i];
      for (size_t i = 0; i < v_before.size(); ++i)
        changed_unowned += !v_owned[i] && setup.cache.v_pool()[i] != v_before[i];
      EXPECT_EQ(changed_unowned, 0) << DTypeName(dtype);
      // Padding rows' q_out is untouched too.
      for (size_t r = 0; r < setup.rows.size(); ++r) {
        if (setup.rows[r].request >= 0) continue;
        for (int32_t h = 0; h < 8; ++h)
          for (int32_t d = 0; d < 64; ++d) ASSERT_TRUE(setup.q_out.IsPoisoned(r, h, d));
      }
      ExpectStoredRowsMatch(setup, 0.5f, 0.25f, true);
    }
  }
}

TEST(AppendKv, AllPaddingStepChangesNoByteAnywhere) {
  PagedCacheSpec spec;
  spec.num_heads = 2;
  spec.head_dim = 64;
  spec.kv_lens = {16, 3};
  AppendSetup setup = MakeAppend(spec, {2, 3}, 4, RopeStyle::kInterleaved, 64);
  for (int32_t& request : setup.batch_indices) request = -1;
  for (Row& row : setup.rows) row.request = -1;
  const std::vector<uint8_t> k_before = setup.cache.k_pool();
  const std::vector<uint8_t> v_before = setup.cache.v_pool();
  const std::vector<uint8_t> q_before = setup.q_out.bytes;
  AppendKv(setup.Args());
  EXPECT_EQ(setup.cache.k_pool(), k_before);
  EXPECT_EQ(setup.cache.v_pool(), v_before);
  EXPECT_EQ(setup.q_out.bytes, q_before);
}

TEST(AppendKv, WithoutQInputWritesNoQ) {
  PagedCacheSpec spec;
  spec.head_dim = 64;
  spec.kv_lens = {5};
  AppendSetup setup = MakeAppend(spec, {5}, 2, RopeStyle::kNeox, 64);
  AppendArgs args = setup.Args();
  args.q_in.data = nullptr;
  AppendKv(args);
  for (uint8_t byte : setup.q_out.bytes) ASSERT_EQ(byte, 0xFF);
  ExpectStoredRowsMatch(setup, 1.0f, 1.0f, /*check_q=*/false);
}

TEST(AppendKv, SeparateKvTablesStoreKAndVThroughTheirOwnPageIds) {
  PagedCacheSpec spec;
  spec.num_heads = 2;
  spec.head_dim = 64;
  spec.page_size = 4;
  spec.separate_kv = true;
  spec.kv_lens = {13, 6};
  AppendSetup setup = MakeAppend(spec, {13, 6}, 4, RopeStyle::kNeox, 64);
  ASSERT_NE(setup.cache.k_indices(), setup.cache.v_indices());
  AppendKv(setup.Args());
  ExpectStoredRowsMatch(setup, 1.0f, 1.0f, true);
}

TEST(AppendKv, Fp8RoundTripErrorIsWithinHalfAnUlpAndSaturates) {
  PagedCacheSpec spec;
  spec.num_heads = 2;
  spec.head_dim = 128;
  spec.dtype = DType::kFloat8E4M3;
  spec.kv_lens = {64};
  const float k_scale = 0.02f;  // inputs up to 10 reach 500 > 448 in storage: some saturate
  const float v_scale = 0.5f;
  AppendSetup setup = MakeAppend(spec, {64}, 2, RopeStyle::kNeox, 128, DType::kBFloat16, 10.0);
  AppendKv(setup.Args(k_scale, v_scale));
  int saturated = 0;
  for (size_t r = 0; r < setup.rows.size(); ++r) {
    const Row row = setup.rows[r];
    if (row.request < 0) continue;
    for (int32_t h = 0; h < 2; ++h) {
      const std::vector<float> k = Rotated(setup.k_in, r, h, setup.style, setup.inv_freq, row.position);
      for (int32_t d = 0; d < 128; ++d) {
        const double stored = setup.cache.K(0, row.position, h, d);
        const double exact = double{k[d]} / k_scale;
        if (std::fabs(exact) >= 448) {
          EXPECT_EQ(stored, std::copysign(448.0, exact));
          ++saturated;
        } else if (std::fabs(exact) >= std::ldexp(1.0, -6)) {
          EXPECT_LE(std::fabs(stored - exact), std::ldexp(std::fabs(exact), -4)) << exact;
        } else {
          EXPECT_LE(std::fabs(stored - exact), std::ldexp(1.0, -10)) << exact;  // subnormal step / 2
        }
        const double v_exact = setup.v_in.At(r, h, d) / v_scale;
        EXPECT_LE(std::fabs(setup.cache.V(0, row.position, h, d) - v_exact),
                  std::ldexp(std::fabs(v_exact), -4) + std::ldexp(1.0, -10));
      }
    }
  }
  EXPECT_GT(saturated, 0);
}

TEST(AppendKv, NhdAndHndPoolsHoldTheSameValues) {
  PagedCacheSpec spec;
  spec.num_heads = 4;
  spec.head_dim = 64;
  spec.page_size = 16;
  spec.kv_lens = {40, 3};
  spec.layout = KvLayout::kNHD;
  AppendSetup nhd = MakeAppend(spec, {40, 3}, 8, RopeStyle::kNeox, 64);
  spec.layout = KvLayout::kHND;
  AppendSetup hnd = MakeAppend(spec, {40, 3}, 8, RopeStyle::kNeox, 64);
  AppendKv(nhd.Args());
  AppendKv(hnd.Args());
  for (int32_t b = 0; b < 2; ++b)
    for (int64_t t = 0; t < spec.kv_lens[b]; ++t)
      for (int32_t h = 0; h < 4; ++h)
        for (int32_t d = 0; d < 64; ++d) {
          ASSERT_EQ(nhd.cache.K(b, t, h, d), hnd.cache.K(b, t, h, d));
          ASSERT_EQ(nhd.cache.V(b, t, h, d), hnd.cache.V(b, t, h, d));
        }
  EXPECT_EQ(nhd.q_out.bytes, hnd.q_out.bytes);
}

// ---- MLA ------------------------------------------------------------------------------------

TEST(AppendMla, StoresCkvUnrotatedAndRotatesKpeAndQPe) {
  for (const DType dtype : {DType::kBFloat16, DType::kFloat8E4M3}) {
    PagedCacheSpec spec;
    spec.num_heads = 1;
    spec.head_dim = 512;  // ckv pool
    spec.v_head_dim = 64;  // kpe pool
    spec.page_size = 16;
    spec.dtype = dtype;
    spec.separate_kv = true;
    spec.kv_lens = {35, 2};
    const std::vector<Row> rows = NewTokenRows(spec.kv_lens, {6, 2});
    PagedCache cache(spec);
    std::vector<int32_t> batch_indices, positions;
    for (const Row& row : rows) {
      batch_indices.push_back(row.request);
      positions.push_back(row.position);
    }
    const int64_t n = static_cast<int64_t>(rows.size());
    std::mt19937 rng(8);
    HostTensor q_pe = HostTensor::Random(DType::kBFloat16, n, 16, 64, rng);
    HostTensor q_pe_out = HostTensor::Poisoned(DType::kBFloat16, n, 16, 64);
    HostTensor ckv = HostTensor::Random(DType::kBFloat16, n, 1, 512, rng);
    HostTensor kpe = HostTensor::Random(DType::kBFloat16, n, 1, 64, rng);
    RopeConfig rope;
    rope.style = RopeStyle::kInterleaved;
    rope.rotary_dim = 64;
    const std::vector<float> inv_freq = RopeInverseFrequencies(rope);
    const std::vector<uint8_t> ckv_before = cache.k_pool();
    const std::vector<uint8_t> kpe_before = cache.v_pool();

    MlaAppendArgs args;
    args.tokens = {n, batch_indices.data(), positions.data()};
    args.pages = cache.Table();
    args.rope_style = RopeStyle::kInterleaved;
    args.rope_inv_freq = inv_freq;
    args.q_pe_in = q_pe.View();
    args.q_pe_out = q_pe_out.View();
    args.ckv_in = ckv.View();
    args.kpe_in = kpe.View();
    args.ckv_cache = cache.KView();
    args.kpe_cache = cache.VView();
    args.ckv_scale = 0.25f;
    args.kpe_scale = 2.0f;
    AppendMla(args);

    std::vector<bool> ckv_owned(ckv_before.size()), kpe_owned(kpe_before.size());
    for (int64_t r = 0; r < n; ++r) {
      const Row row = rows[r];
      if (row.request < 0) {
        for (int32_t h = 0; h < 16; ++h)
          for (int32_t d = 0; d < 64; ++d) ASSERT_TRUE(q_pe_out.IsPoisoned(r, h, d));
        continue;
      }
      const std::vector<float> ckv_row = Rotated(ckv, r, 0, RopeStyle::kNone, {}, row.position);
      const std::vector<float> kpe_row = Rotated(kpe, r, 0, RopeStyle::kInterleaved, inv_freq, row.position);
      for (int32_t d = 0; d < 512; ++d) {
        const int64_t element = cache.ElementOffset(row.request, row.position, 0, d, false);
        ASSERT_EQ(PoolBits(cache.k_pool(), dtype, element), StoredBits(dtype, ckv_row[d] / 0.25f));
        for (int b = 0; b < DTypeBytes(dtype); ++b) ckv_owned[element * DTypeBytes(dtype) + b] = true;
      }
      for (int32_t d = 0; d < 64; ++d) {
        const int64_t element = cache.ElementOffset(row.request, row.position, 0, d, true);
        ASSERT_EQ(PoolBits(cache.v_pool(), dtype, element), StoredBits(dtype, kpe_row[d] / 2.0f));
        for (int b = 0; b < DTypeBytes(dtype); ++b) kpe_owned[element * DTypeBytes(dtype) + b] = true;
      }
      for (int32_t h = 0; h < 16; ++h) {
        const std::vector<float> q = Rotated(q_pe, r, h, RopeStyle::kInterleaved, inv_freq, row.position);
        for (int32_t d = 0; d < 64; ++d) {
          const uint32_t bits = StoredBits(DType::kBFloat16, q[d]);
          ASSERT_EQ(q_pe_out.At(r, h, d), LoadAsFloat(DType::kBFloat16, &bits, 0));
        }
      }
    }
    for (size_t i = 0; i < ckv_before.size(); ++i)
      if (!ckv_owned[i]) {
        ASSERT_EQ(cache.k_pool()[i], ckv_before[i]) << "ckv byte " << i;
      }
    for (size_t i = 0; i < kpe_before.size(); ++i)
      if (!kpe_owned[i]) {
        ASSERT_EQ(cache.v_pool()[i], kpe_before[i]) << "kpe byte " << i;
      }
  }
}

}  // namespace
}  // namespace attnd::reference
