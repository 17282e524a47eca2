// What a KV tile hides from the query rows that read it, for the kernels' masks and their
// non-finite rule (0 x NaN in P V must not reach a row that never saw the key): keys past a row's
// causal diagonal and keys before its sliding window.
#pragma once

#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

namespace attnd::cuda {

// Whether the tile of keys [tile_start, min(tile_end, kv_end)) hides a key from some row of the
// positions [first_position, last_position]: past the first row's causal diagonal, or before the
// last row's window of window_left keys (window_left < 0: no window).
__device__ __forceinline__ bool TileHidesKeys(bool causal, int window_left, int tile_start, int tile_end,
                                              int kv_end, int first_position, int last_position) {
  return (causal && min(tile_end, kv_end) - 1 > first_position) ||
         (window_left >= 0 && tile_start < last_position - window_left);
}

// The exponent bits (all ones: infinity or NaN) of two packed 16-bit values of type T.
template <typename T>
inline constexpr uint32_t kNonFiniteExponent2 = std::is_same_v<T, __half> ? 0x7c007c00u : 0x7f807f80u;

}  // namespace attnd::cuda
