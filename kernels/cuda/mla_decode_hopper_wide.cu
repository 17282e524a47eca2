// MLA decode, wide-tile Hopper kernel instantiations (sm_90a only): kv_lora_rank 512 and 256, q
// and cache bf16 or fp16 (4 kernels); fp8 caches in mla_decode_hopper_wide_fp8.cu.
#include "mla_decode_hopper_wide.cuh"

namespace attnd::cuda::mla {

cudaError_t LaunchMlaHopperWide(const MlaParams& params, int32_t rank, DType q_dtype, DType kv_dtype, int32_t num_ctas,
                                cudaStream_t stream, int* ctas_per_sm) {
  if (kv_dtype == DType::kFloat8E4M3) {
    return LaunchMlaHopperWideFp8(params, rank, q_dtype, num_ctas, stream, ctas_per_sm);
  }
  return hopper_wide::LaunchMlaHopperWideFor<void>(params, rank, q_dtype == DType::kBFloat16, num_ctas, stream,
                                                   ctas_per_sm);
}

}  // namespace attnd::cuda::mla
