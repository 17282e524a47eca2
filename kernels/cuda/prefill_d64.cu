// Batch prefill instantiations for head_dim 64 (one file per head_dim so builds run them in
// parallel).
#include "prefill_kernel.cuh"

namespace attnd::cuda::prefill {

cudaError_t LaunchPrefillD64(const KernelParams& params, int32_t tile_rows, DType q_dtype,
                             DType kv_dtype, int32_t num_ctas, cudaStream_t stream,
                             int* ctas_per_sm) {
  switch (tile_rows) {
    case 16:
      return LaunchTileForTypes<16, 64>(params, q_dtype, kv_dtype, num_ctas, stream, ctas_per_sm);
    case 64:
      return LaunchTileForTypes<64, 64>(params, q_dtype, kv_dtype, num_ctas, stream, ctas_per_sm);
    case 128:
      return LaunchTileForTypes<128, 64>(params, q_dtype, kv_dtype, num_ctas, stream, ctas_per_sm);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace attnd::cuda::prefill
