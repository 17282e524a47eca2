// MLA decode, wide-tile Hopper kernel instantiations (sm_90a only): kv_lora_rank 512 and 256, q
// and cache bf16 or fp16 (4 kernels).
#include "mla_decode_hopper_wide.cuh"

namespace attnd::cuda::mla {

cudaError_t LaunchMlaHopperWide(const MlaParams& params, int32_t rank, DType dtype, int32_t num_ctas,
                                cudaStream_t stream, int* ctas_per_sm) {
  const bool bf16 = dtype == DType::kBFloat16;
  if (rank == 512) {
    return bf16 ? hopper_wide::LaunchMlaHopperWide<512, __nv_bfloat16>(params, num_ctas, stream, ctas_per_sm)
                : hopper_wide::LaunchMlaHopperWide<512, __half>(params, num_ctas, stream, ctas_per_sm);
  }
  return bf16 ? hopper_wide::LaunchMlaHopperWide<256, __nv_bfloat16>(params, num_ctas, stream, ctas_per_sm)
              : hopper_wide::LaunchMlaHopperWide<256, __half>(params, num_ctas, stream, ctas_per_sm);
}

}  // namespace attnd::cuda::mla
