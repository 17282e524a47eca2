// Which keys a query row sees (DESIGN 4.3), the one rule the prefill kernels (mma.sync,
// prefill_kernel.cuh, and Hopper, prefill_hopper_kernel.cuh) mask by: below the request's
// kv_end, up to the row's position when causal, from position - window_left with a window.
// Device-only; no state.
#pragma once

#include <climits>

#include "prefill_params.h"

namespace attnd::cuda::prefill {

// The keys [low, high) a row at key position `position` sees, as offsets from `base` (a thread's
// first key of a tile), so that masking an element at a constant offset is two compares.
struct KeyRange {
  int low;
  int high;
};

__device__ __forceinline__ KeyRange VisibleKeys(const KernelParams& params, int kv_end, int position, int base) {
  KeyRange range;
  range.high = (params.causal ? min(kv_end, position + 1) : kv_end) - base;
  range.low = params.window_left >= 0 ? position - params.window_left - base : INT_MIN / 2;
  return range;
}

}  // namespace attnd::cuda::prefill
