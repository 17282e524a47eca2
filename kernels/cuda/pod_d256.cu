// POD kernel instantiations for head_dim 256: prefill role of 64 rows (the largest prefill tile
// at this head_dim), decode role of 16, six dtype pairs.
#include "pod.cuh"

namespace attnd::cuda::pod {

cudaError_t LaunchPodD256(const PodKernelParams& params, int32_t prefill_tile_rows, DType q_dtype, DType kv_dtype,
                          int32_t num_ctas, cudaStream_t stream, int* ctas_per_sm) {
  if (prefill_tile_rows != 64) return cudaErrorInvalidValue;
  return LaunchPodForTypes<64, 256>(params, q_dtype, kv_dtype, num_ctas, stream, ctas_per_sm);
}

}  // namespace attnd::cuda::pod
