// Picks the tile kernels for this CPU once.
#include "reference/tile_kernels.h"

#if ATTND_REFERENCE_AVX2
#include <cpuid.h>
#endif

namespace attnd::reference {

// Defined per ISA in tile_kernels_<isa>.cc.
#define ATTND_DECLARE_TILE_KERNELS(suffix)                                                     \
  template <typename T>                                                                        \
  void ScoreBlock##suffix(const T* const* q, int32_t qk_dim, const T* kt, int64_t kt_stride,    \
                          int64_t key_begin, int64_t key_end, T* const* scores);               \
  template <typename T>                                                                        \
  void AccumulateBlock##suffix(int rows, const T* const* p, const T* v, int64_t v_stride,       \
                               int64_t key_begin, int64_t key_end, int32_t v_dim_padded,       \
                               T* const* o);                                                   \
  template <typename T>                                                                        \
  void ConvertRow##suffix(DType dtype, const void* src, int64_t count, T scale, T* dst,         \
                          const float* fp8_table);                                             \
  extern template void ConvertRow##suffix<float>(DType, const void*, int64_t, float, float*,   \
                                                 const float*);                                \
  extern template void ConvertRow##suffix<double>(DType, const void*, int64_t, double, double*, \
                                                  const float*);                               \
  template <typename T>                                                                        \
  T ScaleScores##suffix(T* scores, int64_t begin, int64_t end, T sm_scale, T soft_cap);        \
  extern template float ScaleScores##suffix<float>(float*, int64_t, int64_t, float, float);    \
  extern template double ScaleScores##suffix<double>(double*, int64_t, int64_t, double,        \
                                                     double);                                  \
  template <typename T>                                                                        \
  T Exponentiate##suffix(const T* scores, int64_t begin, int64_t end, T max_score, T* probs);   \
  extern template float Exponentiate##suffix<float>(const float*, int64_t, int64_t, float,     \
                                                    float*);                                   \
  extern template double Exponentiate##suffix<double>(const double*, int64_t, int64_t, double, \
                                                      double*);                                \
  template <typename T>                                                                        \
  void TransposeKeys##suffix(const T* rows, int64_t row_stride, int64_t num_keys, int32_t dim,  \
                             T* kt, int64_t kt_stride);                                        \
  extern template void TransposeKeys##suffix<float>(const float*, int64_t, int64_t, int32_t,   \
                                                    float*, int64_t);                          \
  extern template void TransposeKeys##suffix<double>(const double*, int64_t, int64_t, int32_t, \
                                                     double*, int64_t);                        \
  extern template void ScoreBlock##suffix<float>(const float* const*, int32_t, const float*,   \
                                                 int64_t, int64_t, int64_t, float* const*);    \
  extern template void ScoreBlock##suffix<double>(const double* const*, int32_t,               \
                                                  const double*, int64_t, int64_t, int64_t,    \
                                                  double* const*);                             \
  extern template void AccumulateBlock##suffix<float>(int, const float* const*, const float*,  \
                                                      int64_t, int64_t, int64_t, int32_t,      \
                                                      float* const*);                          \
  extern template void AccumulateBlock##suffix<double>(int, const double* const*,              \
                                                       const double*, int64_t, int64_t,        \
                                                       int64_t, int32_t, double* const*);

ATTND_DECLARE_TILE_KERNELS(Generic)
#if ATTND_REFERENCE_AVX2
ATTND_DECLARE_TILE_KERNELS(Avx2)
#endif

namespace {

template <typename T>
TileKernels<T> Generic() {
  return {&ScoreBlockGeneric<T>,  &AccumulateBlockGeneric<T>, &TransposeKeysGeneric<T>,
          &ConvertRowGeneric<T>,  &ScaleScoresGeneric<T>,     &ExponentiateGeneric<T>,
          "generic"};
}

#if ATTND_REFERENCE_AVX2
// F16C from CPUID leaf 1 (ECX bit 29): clang 14's __builtin_cpu_supports does not know "f16c".
bool CpuHasF16c() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  return __get_cpuid(1, &eax, &ebx, &ecx, &edx) != 0 && (ecx & bit_F16C) != 0;
}
#endif

template <typename T>
TileKernels<T> ChooseKernels() {
#if ATTND_REFERENCE_AVX2
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && CpuHasF16c()) {
    return {&ScoreBlockAvx2<T>,  &AccumulateBlockAvx2<T>, &TransposeKeysAvx2<T>,
            &ConvertRowAvx2<T>,  &ScaleScoresAvx2<T>,     &ExponentiateAvx2<T>,
            "avx2"};
  }
#endif
  return Generic<T>();
}

}  // namespace

const TileKernels<float>& FloatTileKernels() {
  static const TileKernels<float> kernels = ChooseKernels<float>();
  return kernels;
}

const TileKernels<double>& DoubleTileKernels() {
  static const TileKernels<double> kernels = ChooseKernels<double>();
  return kernels;
}

const TileKernels<float>& GenericFloatTileKernels() {
  static const TileKernels<float> kernels = Generic<float>();
  return kernels;
}

const TileKernels<double>& GenericDoubleTileKernels() {
  static const TileKernels<double> kernels = Generic<double>();
  return kernels;
}

}  // namespace attnd::reference
