// Device side of GridSignal (attnd/kernels/cuda/grid_signal.h).
#pragma once

#include <cstdint>

#include "attnd/kernels/cuda/grid_signal.h"

namespace attnd::cuda {

// Called by every thread of every CTA once it has stored its results (no thread may have
// exited, and the condition is uniform). The CTA's barrier orders its threads' stores before
// its first thread, which fences them at GPU scope (fences are cumulative) and counts the CTA,
// as a grid-wide barrier does. The last CTA to count itself has then observed every CTA's
// stores; it fences at system scope once and writes the word with a release store, so whoever
// acquires the word (another process on this GPU, a peer GPU, the host) sees them all. One
// system fence per grid, not one per thread: a system fence waits for the thread's stores to be
// visible system-wide, and one in every thread added ~16 us to a 28 us decode layer on an H100.
__device__ __forceinline__ void SignalWhenGridDone(const GridSignal& signal) {
  if (signal.word == nullptr) return;
  __syncthreads();
  if (threadIdx.x + threadIdx.y + threadIdx.z != 0) return;
  __threadfence();
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
