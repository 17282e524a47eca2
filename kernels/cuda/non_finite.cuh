// The bit pattern the kernels' non-finite rule tests (0 x NaN in P V must not reach a row that
// never saw the key): the exponent bits, all ones for infinity or NaN, of two packed 16-bit values.
#pragma once

#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

namespace attnd::cuda {

template <typename T>
inline constexpr uint32_t kNonFiniteExponent2 = std::is_same_v<T, __half> ? 0x7c007c00u : 0x7f807f80u;

}  // namespace attnd::cuda
