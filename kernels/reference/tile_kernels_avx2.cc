// The tile kernels for x86-64 CPUs with AVX2, FMA and F16C; this file alone is compiled with
// -mavx2 -mfma -mf16c, and is only called after a run-time CPU check (tile_kernels.cc).
#define ATTND_TILE_ISA Avx2
#include "reference/tile_kernels_impl.h"
