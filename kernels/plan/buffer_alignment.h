// How the CUDA backend packs sub-buffers (the step's uploaded arrays, staging, workspaces) into
// one allocation. Here, beside the step plan that lays out its arrays by it.
#pragma once

#include <cstdint>

namespace attnd::plan {

// Round `bytes` up to a multiple of `alignment` (a power of two).
constexpr int64_t AlignUp(int64_t bytes, int64_t alignment) {
  return (bytes + alignment - 1) & ~(alignment - 1);
}

// Offsets of sub-buffers are aligned to this: the kernels want 16 bytes, decode workspaces 256.
inline constexpr int64_t kBufferAlignment = 256;

}  // namespace attnd::plan
