// Device side of GridSignal (attnd/kernels/cuda/grid_signal.h).
#pragma once

#include <cstdint>

#include "attnd/kernels/cuda/grid_signal.h"

namespace attnd::cuda {

// Called by every thread of every CTA once it has stored its results (no thread may have
// exited, and the condition is uniform). Each thread fences its own stores at system scope; the
// CTA's first thread counts the CTA; the last CTA's first thread resets the counter and writes
// the word with a release store, so that whoever acquires the word sees every CTA's stores.
__device__ __forceinline__ void SignalWhenGridDone(const GridSignal& signal) {
  if (signal.word == nullptr) return;
  __threadfence_system();
  __syncthreads();
  if (threadIdx.x + threadIdx.y + threadIdx.z != 0) return;
  const uint32_t ctas = gridDim.x * gridDim.y * gridDim.z;
  if (atomicAdd(signal.counter, 1u) != ctas - 1) return;
  // Every other CTA has counted itself: the next launch that uses the counter is ordered after
  // this grid on its stream.
  *signal.counter = 0;
  __threadfence_system();
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(signal.word), "r"(signal.value)
               : "memory");
}

}  // namespace attnd::cuda
