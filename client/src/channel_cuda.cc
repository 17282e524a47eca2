// Client channels with CUDA: the ring is opened with cudaIpcOpenMemHandle on the device whose
// PCI bus id attnd reported; flags are read and written from the host with small synchronous
// copies, or on a stream with the driver's stream memory operations.
#include "channel_cuda.h"

#include <cuda_runtime_api.h>

#include <cstring>

#include "absl/strings/str_cat.h"
#include "attnd/kernels/cuda/stream_flags.h"

namespace attnd::client::internal {
namespace {

absl::Status CudaStatus(cudaError_t error, const char* call) {
  if (error == cudaSuccess) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(call, ": ", cudaGetErrorString(error)));
}


}  // namespace

absl::StatusOr<uint8_t*> OpenIpcRing(const std::string& handle, const std::string& pci_bus_id,
                                     int* device) {
  if (handle.size() != sizeof(cudaIpcMemHandle_t)) {
    return absl::InvalidArgumentError(absl::StrCat("cuda_ipc_handle: expected ",
                                                   sizeof(cudaIpcMemHandle_t), " bytes, got ",
                                                   handle.size()));
  }
  int ordinal = 0;
  if (cudaDeviceGetByPCIBusId(&ordinal, pci_bus_id.c_str()) != cudaSuccess) {
    cudaGetLastError();
    return absl::FailedPreconditionError(absl::StrCat(
        "attnd's GPU (PCI bus id ", pci_bus_id,
        ") is not visible to this process (CUDA_VISIBLE_DEVICES?); use HOST_SHM"));
  }
  int current = 0;
  cudaGetDevice(&current);
  if (absl::Status set = CudaStatus(cudaSetDevice(ordinal), "cudaSetDevice"); !set.ok()) {
    return set;
  }
  cudaIpcMemHandle_t ipc;
  std::memcpy(&ipc, handle.data(), sizeof(ipc));
  void* ring = nullptr;
  const cudaError_t opened = cudaIpcOpenMemHandle(&ring, ipc, cudaIpcMemLazyEnablePeerAccess);
  cudaSetDevice(current);
  if (opened != cudaSuccess) return CudaStatus(opened, "cudaIpcOpenMemHandle");
  *device = ordinal;
  return static_cast<uint8_t*>(ring);
}

void CloseIpcRing(uint8_t* ring, int device) {
  int current = 0;
  cudaGetDevice(&current);
  cudaSetDevice(device);
  cudaIpcCloseMemHandle(ring);
  cudaSetDevice(current);
}

uint32_t ReadDeviceFlag(const uint8_t* flag) {
  uint32_t value = 0;
  cudaMemcpy(&value, flag, sizeof(value), cudaMemcpyDeviceToHost);
  return value;
}

void WriteDeviceFlag(uint8_t* flag, uint32_t value) {
  cudaMemcpy(flag, &value, sizeof(value), cudaMemcpyHostToDevice);
}

absl::Status StreamWriteFlag(void* stream, uint8_t* flag, uint32_t value) {
  return cuda::StreamWriteFlag(static_cast<cudaStream_t>(stream), flag, value);
}

absl::Status StreamWaitFlag(void* stream, uint8_t* flag, uint32_t value) {
  return cuda::StreamWaitFlag(static_cast<cudaStream_t>(stream), flag, value);
}

}  // namespace attnd::client::internal
