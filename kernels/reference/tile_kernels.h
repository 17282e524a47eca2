// The inner loops of CPU attention, in float or double: converting cache rows, transposing a
// tile of keys, the two products on one tile of keys and a block of query rows, and the
// softmax's scaling and exponentiation. They are written with explicit SIMD lanes (no reassociation of any single
// sum), so each score and each output element is accumulated in a fixed order whatever the
// block size: a row's result does not depend on the rows batched with it. On x86-64 an
// AVX2+FMA variant is chosen at run time when the CPU has it (its fused multiply-adds round
// differently from the generic path, so results are reproducible per machine, not across ISAs).
#pragma once

#include <cstdint>

#include "attnd/kernels/dtype.h"

namespace attnd::reference {

// Keys of a tile are padded to a multiple of this (both float and double kernels use it).
inline constexpr int kTileKeyQuantum = 16;
// Output dims are padded to a multiple of this.
inline constexpr int kTileDimQuantum = 16;
// Query rows per block.
inline constexpr int kBlockRows = 4;

template <typename T>
struct TileKernels {
  // scores[r][j] = sum_d q[r][d] * kt[d * kt_stride + j] for r < kBlockRows, j in
  // [key_begin, key_end) (both multiples of kTileKeyQuantum), d in [0, qk_dim) in order.
  void (*score_block)(const T* const* q, int32_t qk_dim, const T* kt, int64_t kt_stride,
                      int64_t key_begin, int64_t key_end, T* const* scores);
  // o[r][d] += sum_j p[r][j] * v[j * v_stride + d] for r < rows (1 or kBlockRows), j in
  // [key_begin, key_end) in order, d in [0, v_dim_padded) (a multiple of kTileDimQuantum).
  void (*accumulate_block)(int rows, const T* const* p, const T* v, int64_t v_stride,
                           int64_t key_begin, int64_t key_end, int32_t v_dim_padded, T* const* o);
  // kt[d * kt_stride + k] = rows[k * row_stride + d] for k < num_keys, d < dim.
  void (*transpose_keys)(const T* rows, int64_t row_stride, int64_t num_keys, int32_t dim, T* kt,
                         int64_t kt_stride);
  // dst[i] = T(element i of src, a dense array of dtype) * scale for i < count; exact decode.
  // fp8_table: the 256 E4M3 values (convert.h's Fp8E4M3Table).
  void (*convert_row)(DType dtype, const void* src, int64_t count, T scale, T* dst,
                      const float* fp8_table);
  // scores[j] = sm_scale * scores[j], then cap * tanh(score / cap) when soft_cap > 0, in place
  // for j in [begin, end); returns the maximum (-inf when empty).
  T (*scale_scores)(T* scores, int64_t begin, int64_t end, T sm_scale, T soft_cap);
  // probs[j] = exp(scores[j] - max_score) for j in [begin, end); returns their sum. The AVX2
  // float variant uses its own vector exp (within 2 ulp); double always uses libm.
  T (*exponentiate)(const T* scores, int64_t begin, int64_t end, T max_score, T* probs);
  const char* isa;  // "avx2" or "generic"
};

// The best kernels this CPU runs; chosen once.
const TileKernels<float>& FloatTileKernels();
const TileKernels<double>& DoubleTileKernels();

// The portable kernels, whatever the CPU; for tests that compare the two variants.
const TileKernels<float>& GenericFloatTileKernels();
const TileKernels<double>& GenericDoubleTileKernels();

template <typename T>
const TileKernels<T>& GetTileKernels();
template <>
inline const TileKernels<float>& GetTileKernels<float>() { return FloatTileKernels(); }
template <>
inline const TileKernels<double>& GetTileKernels<double>() { return DoubleTileKernels(); }

}  // namespace attnd::reference
