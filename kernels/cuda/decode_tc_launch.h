// Host side of the tensor-core decode kernel (decode_tc.cu), private to the kernels: BatchDecode
// (decode.cu) validates the arguments and lays out the workspace, then launches the plan's kernel
// through this, and merges the partials itself.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "absl/status/status.h"
#include "attnd/kernels/cuda/decode.h"

namespace attnd::cuda {

// Launches the tensor-core decode kernel over args.work on `stream` (no merge). `partial_o` and
// `partial_lse` are the workspace's partial arrays (null when the plan does not split).
// INVALID_ARGUMENT when TensorCoreDecodeSupports is false for the arguments' dtypes and shape.
absl::Status LaunchTensorCoreDecode(const BatchDecodeArgs& args, int32_t log2_page_size,
                                    float* partial_o, float* partial_lse, cudaStream_t stream);

}  // namespace attnd::cuda
