// Bodies of the tile kernels (tile_kernels.h), included once per ISA by tile_kernels_generic.cc
// and tile_kernels_avx2.cc (the latter compiled with -mavx2 -mfma -mf16c). Everything but the
// ISA-suffixed entry points has internal linkage, so the linker can never hand one ISA's copy
// of a helper to the other's callers.
#pragma once

#include <math.h>  // C functions only: no inline std:: overloads in a per-ISA file

#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "attnd/kernels/dtype.h"
#include "reference/tile_kernels.h"

// The including file names its kernels with this suffix.
#ifndef ATTND_TILE_ISA
#error "define ATTND_TILE_ISA before including tile_kernels_impl.h"
#endif

namespace attnd::reference {
namespace {

#define ATTND_ALWAYS_INLINE inline __attribute__((always_inline))

// 32-byte vectors: one AVX register, or two SSE registers on the generic path.
template <typename T>
struct Lanes {
  typedef T Vec __attribute__((vector_size(32)));
  static constexpr int kCount = 32 / sizeof(T);
};

// By reference: passing a 32-byte vector by value has an ISA-dependent ABI (-Wpsabi).
template <typename T>
ATTND_ALWAYS_INLINE void Load(typename Lanes<T>::Vec& value, const T* from) {
  std::memcpy(&value, from, sizeof value);
}

// -0 + x is exactly x for every x (+0 + x is not, for x = -0), so the compiler emits a bare
// broadcast.
template <typename T>
ATTND_ALWAYS_INLINE void Broadcast(typename Lanes<T>::Vec& value, T scalar) {
  value = -typename Lanes<T>::Vec{} + scalar;
}

template <typename T>
ATTND_ALWAYS_INLINE void Store(T* to, const typename Lanes<T>::Vec& value) {
  std::memcpy(to, &value, sizeof value);
}

// Each step of d loads kTileKeyQuantum keys of one kt row and broadcasts one q element per row,
// so every accumulator lane is one (row, key) sum taken over d in order.
template <typename T>
ATTND_ALWAYS_INLINE void ScoreBlockImpl(const T* const* q, int32_t qk_dim, const T* kt,
                                        int64_t kt_stride, int64_t key_begin, int64_t key_end,
                                        T* const* scores) {
  using Vec = typename Lanes<T>::Vec;
  constexpr int kLanes = Lanes<T>::kCount;
  constexpr int kVecs = kTileKeyQuantum / kLanes;
  const T* q_rows[kBlockRows];
  for (int r = 0; r < kBlockRows; ++r) q_rows[r] = q[r];
  // The fixed-size loops are unrolled so that the accumulators live in registers.
  for (int64_t j0 = key_begin; j0 < key_end; j0 += kTileKeyQuantum) {
    Vec acc[kBlockRows][kVecs] = {};
    const T* column = kt + j0;
    for (int32_t d = 0; d < qk_dim; ++d, column += kt_stride) {
      Vec keys[kVecs];
#pragma GCC unroll 4
      for (int u = 0; u < kVecs; ++u) Load<T>(keys[u], column + u * kLanes);
#pragma GCC unroll 4
      for (int r = 0; r < kBlockRows; ++r) {
        Vec q_lane;
        Broadcast<T>(q_lane, q_rows[r][d]);
#pragma GCC unroll 4
        for (int u = 0; u < kVecs; ++u) acc[r][u] += q_lane * keys[u];
      }
    }
    for (int r = 0; r < kBlockRows; ++r)
      for (int u = 0; u < kVecs; ++u) Store<T>(scores[r] + j0 + u * kLanes, acc[r][u]);
  }
}

// Two vectors of output dims per pass keep rows x vectors accumulators plus the loaded values
// within the 16 AVX registers.
template <typename T, int kRows>
ATTND_ALWAYS_INLINE void AccumulateBlockImpl(const T* const* p, const T* v, int64_t v_stride,
                                             int64_t key_begin, int64_t key_end,
                                             int32_t v_dim_padded, T* const* o) {
  using Vec = typename Lanes<T>::Vec;
  constexpr int kLanes = Lanes<T>::kCount;
  constexpr int kSpan = 2 * kLanes;
  const T* p_rows[kRows];
  T* o_rows[kRows];
  for (int r = 0; r < kRows; ++r) {
    p_rows[r] = p[r];
    o_rows[r] = o[r];
  }
  for (int32_t d0 = 0; d0 < v_dim_padded; d0 += kSpan) {
    Vec acc[kRows][2];
#pragma GCC unroll 4
    for (int r = 0; r < kRows; ++r) {
      Load<T>(acc[r][0], o_rows[r] + d0);
      Load<T>(acc[r][1], o_rows[r] + d0 + kLanes);
    }
    const T* row = v + key_begin * v_stride + d0;
    for (int64_t j = key_begin; j < key_end; ++j, row += v_stride) {
      Vec values0, values1;
      Load<T>(values0, row);
      Load<T>(values1, row + kLanes);
#pragma GCC unroll 4
      for (int r = 0; r < kRows; ++r) {
        Vec weight;
        Broadcast<T>(weight, p_rows[r][j]);
        acc[r][0] += weight * values0;
        acc[r][1] += weight * values1;
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < kRows; ++r) {
      Store<T>(o_rows[r] + d0, acc[r][0]);
      Store<T>(o_rows[r] + d0 + kLanes, acc[r][1]);
    }
  }
}

template <typename T>
ATTND_ALWAYS_INLINE void AccumulateDispatch(int rows, const T* const* p, const T* v,
                                            int64_t v_stride, int64_t key_begin, int64_t key_end,
                                            int32_t v_dim_padded, T* const* o) {
  if (rows == kBlockRows) {
    AccumulateBlockImpl<T, kBlockRows>(p, v, v_stride, key_begin, key_end, v_dim_padded, o);
  } else {
    for (int r = 0; r < rows; ++r)
      AccumulateBlockImpl<T, 1>(p + r, v, v_stride, key_begin, key_end, v_dim_padded, o + r);
  }
}

static_assert(kTileDimQuantum % (2 * Lanes<float>::kCount) == 0);
static_assert(kTileKeyQuantum % Lanes<float>::kCount == 0);


#if defined(__AVX2__)
// Eight rows of eight floats, transposed in registers (the standard unpack/shuffle/permute
// network).
ATTND_ALWAYS_INLINE void Transpose8x8(const float* from, int64_t from_stride, float* to,
                                      int64_t to_stride) {
  __m256 r[8], t[8], s[8];
  for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(from + i * from_stride);
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    s[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
    s[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
    s[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    s[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {
    _mm256_storeu_ps(to + i * to_stride, _mm256_permute2f128_ps(s[i], s[i + 4], 0x20));
    _mm256_storeu_ps(to + (i + 4) * to_stride, _mm256_permute2f128_ps(s[i], s[i + 4], 0x31));
  }
}
#endif

// kt[d * kt_stride + k] = rows[k * row_stride + d]. Converting rows contiguously and then
// transposing in blocks is several times faster than converting straight into columns, whose
// scattered stores dominated decode.
template <typename T>
ATTND_ALWAYS_INLINE void TransposeKeysImpl(const T* rows, int64_t row_stride, int64_t num_keys,
                                           int32_t dim, T* kt, int64_t kt_stride) {
  int64_t k0 = 0;
#if defined(__AVX2__)
  if constexpr (std::is_same_v<T, float>) {
    for (; k0 + 8 <= num_keys; k0 += 8) {
      int32_t d0 = 0;
      for (; d0 + 8 <= dim; d0 += 8)
        Transpose8x8(rows + k0 * row_stride + d0, row_stride, kt + d0 * kt_stride + k0, kt_stride);
      for (; d0 < dim; ++d0)
        for (int k = 0; k < 8; ++k) kt[d0 * kt_stride + k0 + k] = rows[(k0 + k) * row_stride + d0];
    }
  }
#endif
  // Eight keys at a time: eight source rows stay in L1 while d advances.
  for (; k0 < num_keys; k0 += 8) {
    const int keys = static_cast<int>(num_keys - k0 < 8 ? num_keys - k0 : 8);
    for (int32_t d = 0; d < dim; ++d)
      for (int k = 0; k < keys; ++k) kt[d * kt_stride + k0 + k] = rows[(k0 + k) * row_stride + d];
  }
}


// ---- Row conversion ---------------------------------------------------------------------------
// Local copies of the decoders (not dtype.h's inline functions: an out-of-line copy compiled
// here with AVX2 could be picked by the linker for every caller). They are exact, and
// dtype_test checks them against dtype.h on every code.

ATTND_ALWAYS_INLINE float DecodeBFloat16(uint16_t bits) {
  const uint32_t word = uint32_t{bits} << 16;
  float value;
  std::memcpy(&value, &word, sizeof value);
  return value;
}

// The 15 magnitude bits shifted into a float's position give the value times 2^-112, normals
// and subnormals alike; only inf/NaN need their exponent set.
ATTND_ALWAYS_INLINE float DecodeFloat16(uint16_t bits) {
  const uint32_t magnitude = uint32_t{bits & 0x7fffu} << 13;
  const uint32_t sign = uint32_t{bits & 0x8000u} << 16;
  float scaled;
  std::memcpy(&scaled, &magnitude, sizeof scaled);
  scaled *= 0x1p112f;
  uint32_t word;
  std::memcpy(&word, &scaled, sizeof word);
  if ((bits & 0x7c00u) == 0x7c00u) word = 0x7f800000u | magnitude;
  word |= sign;
  float value;
  std::memcpy(&value, &word, sizeof value);
  return value;
}

// dst[i] = T(element i of src) * scale. The AVX2 build widens eight elements per instruction,
// which also keeps enough cache-line loads in flight: decode reads scattered 256-byte rows and
// was latency-bound with a scalar loop.
template <typename T>
ATTND_ALWAYS_INLINE void ConvertRowImpl(DType dtype, const void* src, int64_t count, T scale,
                                        T* dst, const float* fp8_table) {
  int64_t i = 0;
  switch (dtype) {
    case DType::kBFloat16: {
      const auto* in = static_cast<const uint16_t*>(src);
#if defined(__AVX2__)
      if constexpr (std::is_same_v<T, float>) {
        const __m256 factor = _mm256_set1_ps(scale);
        for (; i + 8 <= count; i += 8) {
          const __m256i wide =
              _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i)));
          _mm256_storeu_ps(dst + i,
                           _mm256_mul_ps(_mm256_castsi256_ps(_mm256_slli_epi32(wide, 16)), factor));
        }
      }
#endif
      for (; i < count; ++i) dst[i] = static_cast<T>(DecodeBFloat16(in[i])) * scale;
      return;
    }
    case DType::kFloat16: {
      const auto* in = static_cast<const uint16_t*>(src);
#if defined(__AVX2__) && defined(__F16C__)
      if constexpr (std::is_same_v<T, float>) {
        const __m256 factor = _mm256_set1_ps(scale);
        for (; i + 8 <= count; i += 8) {
          const __m256 wide =
              _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i)));
          _mm256_storeu_ps(dst + i, _mm256_mul_ps(wide, factor));
        }
      }
#endif
      for (; i < count; ++i) dst[i] = static_cast<T>(DecodeFloat16(in[i])) * scale;
      return;
    }
    case DType::kFloat8E4M3: {
      const auto* in = static_cast<const uint8_t*>(src);
      for (; i < count; ++i) dst[i] = static_cast<T>(fp8_table[in[i]]) * scale;
      return;
    }
    case DType::kFloat32: {
      const auto* in = static_cast<const float*>(src);
      for (; i < count; ++i) dst[i] = static_cast<T>(in[i]) * scale;
      return;
    }
  }
}


// ---- Softmax pieces ---------------------------------------------------------------------------

ATTND_ALWAYS_INLINE float CTanh(float x) { return tanhf(x); }
ATTND_ALWAYS_INLINE double CTanh(double x) { return tanh(x); }
ATTND_ALWAYS_INLINE float CExp(float x) { return expf(x); }
ATTND_ALWAYS_INLINE double CExp(double x) { return exp(x); }

// scores[j] = cap * tanh(scores[j] * sm_scale / cap) (cap > 0) or scores[j] * sm_scale, in
// place over [begin, end); returns the largest (-inf for an empty range). The maximum does not
// depend on the order it is taken in, so the vector path changes no result.
template <typename T>
ATTND_ALWAYS_INLINE T ScaleScoresImpl(T* scores, int64_t begin, int64_t end, T sm_scale,
                                      T soft_cap) {
  T max_score = -static_cast<T>(INFINITY);
  int64_t j = begin;
  if (soft_cap > 0) {
    for (; j < end; ++j) {
      scores[j] = soft_cap * CTanh(scores[j] * sm_scale / soft_cap);
      max_score = scores[j] > max_score ? scores[j] : max_score;
    }
    return max_score;
  }
#if defined(__AVX2__)
  if constexpr (std::is_same_v<T, float>) {
    const __m256 factor = _mm256_set1_ps(sm_scale);
    __m256 running = _mm256_set1_ps(-INFINITY);
    for (; j + 8 <= end; j += 8) {
      const __m256 scaled = _mm256_mul_ps(_mm256_loadu_ps(scores + j), factor);
      _mm256_storeu_ps(scores + j, scaled);
      running = _mm256_max_ps(running, scaled);
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, running);
    for (float lane : lanes) max_score = lane > max_score ? lane : max_score;
  }
#endif
  for (; j < end; ++j) {
    scores[j] *= sm_scale;
    max_score = scores[j] > max_score ? scores[j] : max_score;
  }
  return max_score;
}

#if defined(__AVX2__)
// e^x for x <= 0, eight at a time (Cephes expf: x = n ln2 + r, |r| <= ln2/2, degree-6
// polynomial; within 2 ulp of expf). Below -87.3 the result would be subnormal: it is 0, which
// changes a softmax sum of at least 1 by less than 1e-37.
ATTND_ALWAYS_INLINE __m256 ExpNonPositive(__m256 x) {
  const __m256 underflow = _mm256_cmp_ps(x, _mm256_set1_ps(-87.3f), _CMP_LT_OQ);
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 poly = _mm256_set1_ps(1.9875691500e-4f);
  poly = _mm256_fmadd_ps(poly, r, _mm256_set1_ps(1.3981999507e-3f));
  poly = _mm256_fmadd_ps(poly, r, _mm256_set1_ps(8.3334519073e-3f));
  poly = _mm256_fmadd_ps(poly, r, _mm256_set1_ps(4.1665795894e-2f));
  poly = _mm256_fmadd_ps(poly, r, _mm256_set1_ps(1.6666665459e-1f));
  poly = _mm256_fmadd_ps(poly, r, _mm256_set1_ps(5.0000001201e-1f));
  poly = _mm256_fmadd_ps(poly, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i exponent = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  const __m256 result = _mm256_mul_ps(poly, _mm256_castsi256_ps(exponent));
  return _mm256_andnot_ps(underflow, result);
}
#endif

// probs[j] = exp(scores[j] - max_score) over [begin, end); returns their sum. Lanes are
// assigned from `begin`, so the summation order depends only on the row's own key range.
template <typename T>
ATTND_ALWAYS_INLINE T ExponentiateImpl(const T* scores, int64_t begin, int64_t end, T max_score,
                                       T* probs) {
  T sum = 0;
  int64_t j = begin;
#if defined(__AVX2__)
  if constexpr (std::is_same_v<T, float>) {
    const __m256 shift = _mm256_set1_ps(max_score);
    __m256 partial = _mm256_setzero_ps();
    for (; j + 8 <= end; j += 8) {
      const __m256 p = ExpNonPositive(_mm256_sub_ps(_mm256_loadu_ps(scores + j), shift));
      _mm256_storeu_ps(probs + j, p);
      partial = _mm256_add_ps(partial, p);
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, partial);
    for (float lane : lanes) sum += lane;
  }
#endif
  for (; j < end; ++j) {
    probs[j] = CExp(scores[j] - max_score);
    sum += probs[j];
  }
  return sum;
}

}  // namespace

#define ATTND_TILE_CONCAT_INNER(a, b) a##b
#define ATTND_TILE_CONCAT(a, b) ATTND_TILE_CONCAT_INNER(a, b)

template <typename T>
void ATTND_TILE_CONCAT(ScoreBlock, ATTND_TILE_ISA)(const T* const* q, int32_t qk_dim, const T* kt,
                                                   int64_t kt_stride, int64_t key_begin,
                                                   int64_t key_end, T* const* scores) {
  ScoreBlockImpl<T>(q, qk_dim, kt, kt_stride, key_begin, key_end, scores);
}

template <typename T>
void ATTND_TILE_CONCAT(AccumulateBlock, ATTND_TILE_ISA)(int rows, const T* const* p, const T* v,
                                                        int64_t v_stride, int64_t key_begin,
                                                        int64_t key_end, int32_t v_dim_padded,
                                                        T* const* o) {
  AccumulateDispatch<T>(rows, p, v, v_stride, key_begin, key_end, v_dim_padded, o);
}

template <typename T>
void ATTND_TILE_CONCAT(TransposeKeys, ATTND_TILE_ISA)(const T* rows, int64_t row_stride,
                                                      int64_t num_keys, int32_t dim, T* kt,
                                                      int64_t kt_stride) {
  TransposeKeysImpl<T>(rows, row_stride, num_keys, dim, kt, kt_stride);
}

template <typename T>
void ATTND_TILE_CONCAT(ConvertRow, ATTND_TILE_ISA)(DType dtype, const void* src, int64_t count,
                                                   T scale, T* dst, const float* fp8_table) {
  ConvertRowImpl<T>(dtype, src, count, scale, dst, fp8_table);
}

template <typename T>
T ATTND_TILE_CONCAT(ScaleScores, ATTND_TILE_ISA)(T* scores, int64_t begin, int64_t end,
                                                 T sm_scale, T soft_cap) {
  return ScaleScoresImpl<T>(scores, begin, end, sm_scale, soft_cap);
}

template <typename T>
T ATTND_TILE_CONCAT(Exponentiate, ATTND_TILE_ISA)(const T* scores, int64_t begin, int64_t end,
                                                 T max_score, T* probs) {
  return ExponentiateImpl<T>(scores, begin, end, max_score, probs);
}

template float ATTND_TILE_CONCAT(ScaleScores, ATTND_TILE_ISA)<float>(float*, int64_t, int64_t,
                                                                      float, float);
template double ATTND_TILE_CONCAT(ScaleScores, ATTND_TILE_ISA)<double>(double*, int64_t, int64_t,
                                                                        double, double);
template float ATTND_TILE_CONCAT(Exponentiate, ATTND_TILE_ISA)<float>(const float*, int64_t,
                                                                       int64_t, float, float*);
template double ATTND_TILE_CONCAT(Exponentiate, ATTND_TILE_ISA)<double>(const double*, int64_t,
                                                                         int64_t, double,
                                                                         double*);
template void ATTND_TILE_CONCAT(ConvertRow, ATTND_TILE_ISA)<float>(DType, const void*, int64_t,
                                                                    float, float*, const float*);
template void ATTND_TILE_CONCAT(ConvertRow, ATTND_TILE_ISA)<double>(DType, const void*, int64_t,
                                                                     double, double*,
                                                                     const float*);
template void ATTND_TILE_CONCAT(TransposeKeys, ATTND_TILE_ISA)<float>(const float*, int64_t,
                                                                       int64_t, int32_t, float*,
                                                                       int64_t);
template void ATTND_TILE_CONCAT(TransposeKeys, ATTND_TILE_ISA)<double>(const double*, int64_t,
                                                                        int64_t, int32_t,
                                                                        double*, int64_t);
template void ATTND_TILE_CONCAT(ScoreBlock, ATTND_TILE_ISA)<float>(
    const float* const*, int32_t, const float*, int64_t, int64_t, int64_t, float* const*);
template void ATTND_TILE_CONCAT(ScoreBlock, ATTND_TILE_ISA)<double>(
    const double* const*, int32_t, const double*, int64_t, int64_t, int64_t, double* const*);
template void ATTND_TILE_CONCAT(AccumulateBlock, ATTND_TILE_ISA)<float>(
    int, const float* const*, const float*, int64_t, int64_t, int64_t, int32_t, float* const*);
template void ATTND_TILE_CONCAT(AccumulateBlock, ATTND_TILE_ISA)<double>(
    int, const double* const*, const double*, int64_t, int64_t, int64_t, int32_t, double* const*);

}  // namespace attnd::reference
