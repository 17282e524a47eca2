// Bodies of the tile kernels (tile_kernels.h), included once per ISA by tile_kernels_generic.cc
// and tile_kernels_avx2.cc (the latter compiled with -mavx2 -mfma). Everything but the
// ISA-suffixed entry points has internal linkage, so the linker can never hand one ISA's copy
// of a helper to the other's callers.
#pragma once

#include <cstdint>
#include <cstring>

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

// Each step of d loads kSpan keys of one kt row and broadcasts one q element per row, so every
// accumulator lane is one (row, key) sum taken over d in order.
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

template void ATTND_TILE_CONCAT(ScoreBlock, ATTND_TILE_ISA)<float>(
    const float* const*, int32_t, const float*, int64_t, int64_t, int64_t, float* const*);
template void ATTND_TILE_CONCAT(ScoreBlock, ATTND_TILE_ISA)<double>(
    const double* const*, int32_t, const double*, int64_t, int64_t, int64_t, double* const*);
template void ATTND_TILE_CONCAT(AccumulateBlock, ATTND_TILE_ISA)<float>(
    int, const float* const*, const float*, int64_t, int64_t, int64_t, int32_t, float* const*);
template void ATTND_TILE_CONCAT(AccumulateBlock, ATTND_TILE_ISA)<double>(
    int, const double* const*, const double*, int64_t, int64_t, int64_t, int32_t, double* const*);

}  // namespace attnd::reference
