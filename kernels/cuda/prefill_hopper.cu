// Batch prefill on Hopper (sm_90a): instantiations and the launcher of the warp-specialised wgmma
// kernel (prefill_hopper_kernel.cuh). Built only for compute_90a/sm_90a (prefill.cmake), when 90
// is among ATTND_CUDA_ARCHITECTURES; 28 kernels: head_dim 64, 128 and 256 x bf16 and fp16 x
// with and without a soft cap x the fixed layout's and works on demand, and at head_dim 128 the
// fixed layout's pipelined across works (4 more).
#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "launch.cuh"
#include "prefill_hopper_kernel.cuh"

namespace attnd::cuda::prefill {
namespace {

// Two stages each of K and V: with two Q buffers, 192 KB of shared memory at head_dim 128 (one Q
// buffer and 64-key tiles at 256: 192 KB too), one CTA per SM.
constexpr int kStages = 2;

// The fixed layout's kernel, pipelined across works or not (ConsumeWorks's kAcrossWorks): at
// head_dim 128 both, elsewhere only the one that drains after each work.
template <typename Shape, typename T, bool kSoftCap>
auto FixedLayoutKernel(bool across_works) {
  if constexpr (Shape::kHeadDim == 128) {
    if (across_works) return &hopper::HopperPrefillKernel<Shape, T, kSoftCap, true>;
  }
  return &hopper::HopperPrefillKernel<Shape, T, kSoftCap, false>;
}

template <int kHeadDim, typename T>
cudaError_t LaunchHopperTile(const KernelParams& params, int32_t num_ctas, int32_t grid_ctas, cudaStream_t stream,
                             int* ctas_per_sm, bool short_works) {
  using Shape = hopper::HopperShape<kHeadDim, kStages>;
  // A launch with a soft cap runs the kernel compiled with it (its tile loop is ~700 instructions
  // longer); the one without keeps the loop short for the instruction cache.
  const bool soft_cap = SoftmaxParams::Of(params.score_scale, params.soft_cap).soft_cap;  // the kernel's own rule
  // Works on demand (params.work_counter) run a kernel of their own.
  auto* kernel = params.work_counter != nullptr
                     ? (soft_cap ? &hopper::HopperPrefillOnDemandKernel<Shape, T, true>
                                 : &hopper::HopperPrefillOnDemandKernel<Shape, T, false>)
                     : (soft_cap ? FixedLayoutKernel<Shape, T, true>(short_works)
                                 : FixedLayoutKernel<Shape, T, false>(short_works));
  cudaError_t error = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Shape::kSmemBytes);
  if (error != cudaSuccess) return error;
  if (ctas_per_sm != nullptr) {
    return cudaOccupancyMaxActiveBlocksPerMultiprocessor(ctas_per_sm, kernel, hopper::kThreads, Shape::kSmemBytes);
  }
  // Persistent: `grid_ctas` CTAs (the plan's one wave) snake through the work (see the kernel).
  KernelParams persistent = params;
  persistent.num_work = num_ctas;
  const int32_t grid = grid_ctas > 0 ? std::min(num_ctas, grid_ctas) : num_ctas;
  // A programmatic dependent launch (launch.cuh): the kernel waits for the preceding grid before
  // it reads q or the cache. ATTND_PREFILL_PDL=0 launches it the ordinary way (measurements).
  static const bool programmatic = [] {
    const char* value = std::getenv("ATTND_PREFILL_PDL");
    return value == nullptr || std::strcmp(value, "0") != 0;
  }();
  if (!programmatic) {
    kernel<<<grid, hopper::kThreads, Shape::kSmemBytes, stream>>>(persistent);
    return cudaGetLastError();
  }
  void* args[] = {&persistent};
  return LaunchAfterPrecedingGrid(reinterpret_cast<const void*>(kernel), dim3(grid), dim3(hopper::kThreads),
                                  Shape::kSmemBytes, stream, args);
}

}  // namespace

cudaError_t LaunchPrefillHopper(const KernelParams& params, int32_t head_dim, DType dtype, int32_t num_ctas,
                                int32_t grid_ctas, cudaStream_t stream, int* ctas_per_sm, bool short_works) {
  if (!HopperPrefillSupports(head_dim, dtype, dtype)) return cudaErrorInvalidValue;
  const bool bf16 = dtype == DType::kBFloat16;
  if (head_dim == 128) {
    return bf16 ? LaunchHopperTile<128, __nv_bfloat16>(params, num_ctas, grid_ctas, stream, ctas_per_sm, short_works)
                : LaunchHopperTile<128, __half>(params, num_ctas, grid_ctas, stream, ctas_per_sm, short_works);
  }
  if (head_dim == 256) {
    return bf16 ? LaunchHopperTile<256, __nv_bfloat16>(params, num_ctas, grid_ctas, stream, ctas_per_sm, short_works)
                : LaunchHopperTile<256, __half>(params, num_ctas, grid_ctas, stream, ctas_per_sm, short_works);
  }
  return bf16 ? LaunchHopperTile<64, __nv_bfloat16>(params, num_ctas, grid_ctas, stream, ctas_per_sm, short_works)
              : LaunchHopperTile<64, __half>(params, num_ctas, grid_ctas, stream, ctas_per_sm, short_works);
}

}  // namespace attnd::cuda::prefill
