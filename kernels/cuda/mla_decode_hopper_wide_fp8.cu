// MLA decode, wide-tile Hopper kernel instantiations for fp8 e4m3 caches (sm_90a only):
// kv_lora_rank 512 and 256, q (the tensor cores' type) bf16 or fp16 (4 kernels).
#include "mla_decode_hopper_wide.cuh"

namespace attnd::cuda::mla {

cudaError_t LaunchMlaHopperWideFp8(const MlaParams& params, int32_t rank, DType q_dtype, int32_t num_ctas,
                                   cudaStream_t stream, int* ctas_per_sm) {
  return hopper_wide::LaunchMlaHopperWideFor<__nv_fp8_e4m3>(params, rank, q_dtype == DType::kBFloat16, num_ctas,
                                                            stream, ctas_per_sm);
}

}  // namespace attnd::cuda::mla
