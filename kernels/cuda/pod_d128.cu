// POD kernel instantiations for head_dim 128 (one file per head_dim so builds run them in
// parallel): prefill role of 64 or 128 rows, decode role of 16, six dtype pairs.
#include "pod.cuh"

namespace attnd::cuda::pod {

cudaError_t LaunchPodD128(const PodKernelParams& params, int32_t prefill_tile_rows, DType q_dtype, DType kv_dtype,
                         int32_t num_ctas, cudaStream_t stream, int* ctas_per_sm) {
  switch (prefill_tile_rows) {
    case 64: return LaunchPodForTypes<64, 128>(params, q_dtype, kv_dtype, num_ctas, stream, ctas_per_sm);
    case 128: return LaunchPodForTypes<128, 128>(params, q_dtype, kv_dtype, num_ctas, stream, ctas_per_sm);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace attnd::cuda::pod
