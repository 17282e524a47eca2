// Merge of attention partials (DESIGN 4.4): each output row combines the (o, lse) pairs of the
// KV chunks it was split into, in one CTA, in slot order, without atomics, so the result is a
// function of the row's partials alone. Used by split-KV decode and prefill alike.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "absl/status/status.h"
#include "attnd/kernels/cuda/grid_signal.h"
#include "attnd/kernels/views.h"

namespace attnd::cuda {

// All pointers are device memory.
struct MergeStatesArgs {
  // [num_partials][num_heads][head_dim] fp32 (16-byte aligned); each partial normalised by its
  // own denominator.
  const float* partial_o = nullptr;
  // [num_partials][num_heads] natural-log sum of exp(score); -inf: the chunk saw no key.
  const float* partial_lse = nullptr;
  // [num_rows + 1]: output row r merges partial slots [indptr[r], indptr[r + 1]).
  const int32_t* indptr = nullptr;
  // [num_rows]: the row of o and lse that row r writes; null writes row r.
  const int32_t* out_rows = nullptr;
  int32_t num_rows = 0;  // host-known: sets the grid
  int32_t num_heads = 0;
  int32_t head_dim = 0;  // multiple of 4, at most 512
  TokenHeadsView o;      // [*][num_heads][head_dim], fp16, bf16 or fp32
  float* lse = nullptr;  // [*][num_heads] natural log, or null
  // Optional: set by the last CTA once o and lse are stored (grid_signal.h). With no row to
  // merge nothing is launched and the word is not written: the caller signals.
  GridSignal done;
};

// Rows with no partial, or whose partials all saw no key, get o = 0 and lse = -inf. Launches
// on `stream`; allocates nothing.
absl::Status MergeStates(const MergeStatesArgs& args, cudaStream_t stream);

}  // namespace attnd::cuda
