// Device-side helpers of the benchmarks: pseudo-random fills (benchmarks move tens of gigabytes;
// filling them from the host would dominate the run) and a plain copy kernel, a second measure
// of the copy bandwidth beside cudaMemcpy.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "attnd/kernels/dtype.h"

namespace attnd::bench {

// `count` elements of `dtype`, uniform in [-range, range), a pure function of (seed, index).
cudaError_t FillRandom(void* data, DType dtype, int64_t count, uint64_t seed, float range,
                       cudaStream_t stream);

// Copies `bytes` (a multiple of 16, both pointers 16-byte aligned) with 16-byte loads and
// stores, four in flight per thread.
cudaError_t CopyWithKernel(void* target, const void* source, size_t bytes, cudaStream_t stream);

// Holds `ctas` SMs (one CTA each: all of an SM's shared memory) for about `microseconds`, then
// exits: a diagnostic of how a kernel launched beside it runs on the SMs left.
cudaError_t OccupySms(int ctas, int microseconds, cudaStream_t stream);

}  // namespace attnd::bench
