// Conversions of contiguous cache/tensor rows to float or double (reference internals).
#pragma once

#include <array>
#include <cstdint>

#include "attnd/kernels/dtype.h"
#include "reference/tile_kernels.h"

namespace attnd::reference {

// The 256 values of E4M3, indexed by code.
const std::array<float, 256>& Fp8E4M3Table();

// dst[i] = T(element i of src) * scale for i in [0, count): exactly LoadAsFloat's value, with
// the product taken in T (so the float64 oracle dequantises in double). Runs the CPU's best
// variant (tile_kernels.h).
template <typename T>
void ConvertRow(DType dtype, const void* src, int64_t count, T scale, T* dst) {
  GetTileKernels<T>().convert_row(dtype, src, count, scale, dst, Fp8E4M3Table().data());
}

// Asks the memory system for a row that will be read soon (cache rows of a paged tile are
// scattered, so the hardware prefetcher cannot guess them).
inline void PrefetchRow(const void* row, int64_t bytes) {
  const auto* address = static_cast<const char*>(row);
  for (int64_t offset = 0; offset < bytes; offset += 64) __builtin_prefetch(address + offset);
}

}  // namespace attnd::reference
