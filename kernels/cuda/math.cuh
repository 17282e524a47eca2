// Scalar math of the attention kernels: the log2-domain constants, the MUFU exp2/log2 (what
// FlashAttention-style softmax runs on) and a tanh accurate enough for soft-capped logits.
// kLog2e and kLn2 are host constants too (launchers fold them into kernel parameters).
#pragma once

namespace attnd::cuda {

inline constexpr float kLog2e = 1.4426950408889634f;
inline constexpr float kLn2 = 0.6931471805599453f;

#ifdef __CUDACC__
__device__ __forceinline__ float FastExp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float FastLog2(float x) {
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// tanh(x) = 1 - 2 / (e^{2x} + 1): relative error ~1e-6, unlike tanh.approx (~5e-4), which a
// soft cap of 30-50 would turn into logit errors of a few percent.
__device__ __forceinline__ float AccurateTanh(float x) {
  return 1.0f - __fdividef(2.0f, __expf(2.0f * x) + 1.0f);
}
#endif  // __CUDACC__

}  // namespace attnd::cuda
