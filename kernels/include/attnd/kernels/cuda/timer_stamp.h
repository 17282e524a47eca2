// A one-thread kernel that writes the GPU's global timer (%globaltimer, nanoseconds, the same
// clock for every process on the device) to a word: a benchmark aid that puts points of a
// stream's progress on one time line with another process's (docs/benchmarks.md, the channel
// stamps). It costs a kernel launch on the stream, so traced runs are not the timed ones.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "absl/status/status.h"

namespace attnd::cuda {

// Enqueues on `stream` a write of the global timer to `where` (device memory or mapped host
// memory) once the stream's earlier work is done.
absl::Status LaunchTimerStamp(uint64_t* where, cudaStream_t stream);

}  // namespace attnd::cuda
