// The one CUDA error check of the kernel launchers and the CUDA backend: a failed runtime call
// becomes an absl::Status that names the call, the CUDA error and where it happened.
#pragma once

#include <cuda_runtime_api.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace attnd::cuda {

inline absl::Status CudaErrorToStatus(cudaError_t error, const char* expression, const char* file,
                                      int line) {
  return absl::InternalError(absl::StrCat(file, ":", line, ": ", expression, ": ",
                                          cudaGetErrorName(error), " (",
                                          cudaGetErrorString(error), ")"));
}

}  // namespace attnd::cuda

// Returns an INTERNAL status from the enclosing function when the CUDA call fails.
#define CUDA_RETURN_IF_ERROR(expr)                                                         \
  do {                                                                                     \
    const cudaError_t attnd_cuda_error_ = (expr);                                          \
    if (attnd_cuda_error_ != cudaSuccess)                                                  \
      return ::attnd::cuda::CudaErrorToStatus(attnd_cuda_error_, #expr, __FILE__, __LINE__); \
  } while (false)
