// MLA decode instantiations for kv_lora_rank 512 (4 kernels: bf16, fp16, fp8 -> bf16, fp8 -> fp16).
#include "mla_decode_kernel.cuh"

namespace attnd::cuda::mla {

cudaError_t LaunchMlaR512(const MlaParams& params, DType q_dtype, DType kv_dtype, int32_t num_ctas,
                          cudaStream_t stream, int* ctas_per_sm) {
  return LaunchMlaForTypes<512>(params, q_dtype, kv_dtype, num_ctas, stream, ctas_per_sm);
}

}  // namespace attnd::cuda::mla
