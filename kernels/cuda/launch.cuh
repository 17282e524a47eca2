// Programmatic dependent launch (Hopper): a kernel launched this way may be scheduled while the
// kernel before it on the stream still runs, once every CTA of that one has executed
// `griddepcontrol.launch_dependents` (or exited); it must execute `griddepcontrol.wait` before it
// reads anything the earlier kernel writes, which returns once that grid has completed and its
// writes are visible. It hides the second kernel's launch latency behind the first one's tail.
// Before a non-kernel stream operation, or on devices before compute capability 9.0, the launch
// is an ordinary one and the wait passes straight through.
#pragma once

#include <cuda_runtime.h>

namespace attnd::cuda {

inline cudaError_t LaunchAfterPrecedingGrid(const void* kernel, dim3 grid, dim3 block,
                                            size_t dynamic_smem_bytes, cudaStream_t stream,
                                            void** args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = dynamic_smem_bytes;
  config.stream = stream;
  cudaLaunchAttribute attribute;
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  config.attrs = &attribute;
  config.numAttrs = 1;
  return cudaLaunchKernelExC(&config, kernel, args);
}

}  // namespace attnd::cuda
