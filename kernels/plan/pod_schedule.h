// The role rule of the POD kernel's scheduler (DESIGN 4.5), shared by the kernel (pod.cuh) and
// host tests. Dependency-free so that nvcc compiles it without Abseil.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define ATTND_POD_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define ATTND_POD_HOST_DEVICE inline
#endif

namespace attnd::plan {

// The n-th CTA (n = 0, 1, ...) that starts on an SM takes the prefill role when the SM's
// running count of prefill CTAs, ceil(n * P / (P + D)) among its first n, steps up at n: over
// any run of CTAs an SM holds both roles in the global ratio P : D (prefill, decode CTAs),
// interleaved, and its first CTA is a prefill one (the plan orders prefill blocks heaviest
// first, so the longest tiles start at once on every SM). A CTA whose role has run out of
// blocks takes the other one (the kernel's job).
ATTND_POD_HOST_DEVICE bool PodTakesPrefillRole(int64_t n, int64_t num_prefill_ctas, int64_t num_decode_ctas) {
  const int64_t total = num_prefill_ctas + num_decode_ctas;
  if (total <= 0) return false;
  return ((n + 1) * num_prefill_ctas + total - 1) / total > (n * num_prefill_ctas + total - 1) / total;
}

}  // namespace attnd::plan
