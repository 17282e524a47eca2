// CUDA stream memory operations on 32-bit flag words (the channels' ready/done words, DESIGN
// 3b): a stream waits until a word reaches a value, or writes one after its earlier work. They
// are driver API calls (cuStreamWaitValue32 / cuStreamWriteValue32), looked up through the
// runtime's driver entry points so that nothing links libcuda: binaries still start, and tests
// still skip, on machines with no GPU driver. Header-only, for the server and the client alike.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

#include "absl/status/status.h"

namespace attnd::cuda {

namespace stream_flags_internal {

// CUresult / CUstream / CUdeviceptr as the driver API spells them (cuda.h not needed).
using DriverResult = int;
using WaitOrWrite = DriverResult (*)(cudaStream_t, unsigned long long, unsigned int, unsigned int);
inline constexpr unsigned int kWaitGeq = 0x0;       // CU_STREAM_WAIT_VALUE_GEQ (0x1 is EQ)
inline constexpr unsigned int kWriteDefault = 0x0;  // CU_STREAM_WRITE_VALUE_DEFAULT (a barrier)

inline WaitOrWrite Lookup(const char* symbol) {
  void* function = nullptr;
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
  if (cudaGetDriverEntryPointByVersion(symbol, &function, 12000, cudaEnableDefault, &found) !=
          cudaSuccess ||
      found != cudaDriverEntryPointSuccess) {
    cudaGetLastError();
    return nullptr;
  }
  return reinterpret_cast<WaitOrWrite>(function);
}

inline absl::Status Call(const char* symbol, WaitOrWrite function, cudaStream_t stream,
                         void* address, uint32_t value, unsigned int flags) {
  if (function == nullptr) {
    return absl::FailedPreconditionError(
        std::string(symbol) + ": not available from this driver (stream memory operations)");
  }
  const DriverResult result =
      function(stream, reinterpret_cast<unsigned long long>(address), value, flags);
  if (result != 0) {
    return absl::InternalError(std::string(symbol) + " failed: CUresult " +
                               std::to_string(result));
  }
  return absl::OkStatus();
}

}  // namespace stream_flags_internal

// `stream`'s later work waits until the word at `address` (device memory, or host memory
// registered with CUDA) reaches `value` as a serial number: (int32_t)(*address - value) >= 0.
inline absl::Status StreamWaitFlag(cudaStream_t stream, void* address, uint32_t value) {
  using namespace stream_flags_internal;
  static const WaitOrWrite wait = Lookup("cuStreamWaitValue32");
  return Call("cuStreamWaitValue32", wait, stream, address, value, kWaitGeq);
}

// Writes `value` to the word once `stream`'s earlier work is done, after a memory barrier (so
// whatever that work wrote is visible before the word changes).
inline absl::Status StreamWriteFlag(cudaStream_t stream, void* address, uint32_t value) {
  using namespace stream_flags_internal;
  static const WaitOrWrite write = Lookup("cuStreamWriteValue32");
  return Call("cuStreamWriteValue32", write, stream, address, value, kWriteDefault);
}

}  // namespace attnd::cuda
