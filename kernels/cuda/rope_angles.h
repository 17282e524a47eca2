// cos and sin of a rotary angle in float32 arithmetic, for the fused append (DESIGN 4.1, issue
// 15). Plain C++ that also compiles as CUDA device code, so a CPU unit test bounds exactly what
// the kernel computes (tests/unit/reference/rope_angles_test.cc).
//
// The angle is float(position) * inv_freq, rounded to float as the reference rounds it. The
// kernel used to take double sincos of it (correctly rounded results, a few hundred double
// instructions and a local-memory slow path per pair); here the reduction by pi/2 runs in double
// (one multiply, one round, two FMAs: exact enough for any float angle below 2^30) and cos/sin
// of the reduced argument (|r| <= pi/4) are float minimax polynomials. Every step is an explicit
// fma or a lone product, so no compiler can contract it differently on host and device; the
// result is within 2^-23 of the true cos/sin (the test's bound; 2^-23.4 seen), where the
// reference's correctly rounded float values are within 2^-24.9: the rotated values differ from
// the reference's by far less than half a bf16 or fp8 code, so a stored code moves only when the
// exact value sits that close to a rounding boundary.
#pragma once

#include <cmath>

#if defined(__CUDACC__)
#define ATTND_ROPE_FUNCTION __host__ __device__ __forceinline__
#else
#define ATTND_ROPE_FUNCTION inline
#endif

namespace attnd::rope {

struct CosSin {
  float cos;
  float sin;
};

ATTND_ROPE_FUNCTION CosSin RopeCosSin(float angle) {
  constexpr double kTwoOverPi = 0.63661977236758134308;
  constexpr double kHalfPiHigh = 1.5707963267948966192;      // pi/2 rounded to double
  constexpr double kHalfPiLow = 6.123233995736766036e-17;    // pi/2 - kHalfPiHigh
  const double a = angle;
  const double quadrant_real = rint(a * kTwoOverPi);
  double reduced = fma(-quadrant_real, kHalfPiHigh, a);
  reduced = fma(-quadrant_real, kHalfPiLow, reduced);
  const float x = static_cast<float>(reduced);
  const float z = x * x;
  // sin x = x + x^3 P(z), cos x = 1 - z/2 + z^2 Q(z) on [-pi/4, pi/4] (Cephes' sinf/cosf
  // coefficients).
  const float sin_poly = fmaf(fmaf(-1.9515295891e-4f, z, 8.3321608736e-3f), z, -1.6666654611e-1f);
  const float x_cubed = z * x;
  const float sin_x = fmaf(sin_poly, x_cubed, x);
  const float cos_poly = fmaf(fmaf(2.443315711809948e-5f, z, -1.388731625493765e-3f), z, 4.166664568298827e-2f);
  const float z_squared = z * z;
  const float cos_x = fmaf(cos_poly, z_squared, fmaf(-0.5f, z, 1.0f));
  // angle = r + q pi/2: rotate (cos r, sin r) by the quadrant q mod 4.
  const int quadrant = static_cast<int>(static_cast<long long>(quadrant_real) & 3);
  CosSin result;
  switch (quadrant) {
    case 0:
      result = {cos_x, sin_x};
      break;
    case 1:
      result = {-sin_x, cos_x};
      break;
    case 2:
      result = {-cos_x, -sin_x};
      break;
    default:
      result = {sin_x, -cos_x};
      break;
  }
  return result;
}

}  // namespace attnd::rope

#undef ATTND_ROPE_FUNCTION
