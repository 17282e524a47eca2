// The tile kernels for any CPU (baseline ISA of the build).
#define ATTND_TILE_ISA Generic
#include "reference/tile_kernels_impl.h"
