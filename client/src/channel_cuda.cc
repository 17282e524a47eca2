// Client channels with CUDA: the ring is opened with cudaIpcOpenMemHandle on the device whose
// PCI bus id attnd reported; flags are read and written from the host with small synchronous
// copies, or on a stream with the driver's stream memory operations.
#include "channel_cuda.h"

#include <cuda_runtime_api.h>

#include <cstring>

#include "absl/strings/str_cat.h"
#include "attnd/kernels/cuda/flag_gate.h"
#include "attnd/kernels/cuda/stream_flags.h"

namespace attnd::client::internal {
namespace {

absl::Status CudaStatus(cudaError_t error, const char* call) {
  if (error == cudaSuccess) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(call, ": ", cudaGetErrorString(error)));
}

// A copy between this process's (pageable) host memory and the ring that has landed when it
// returns. A plain cudaMemcpy from pageable memory to the device returns once the bytes are
// staged, before the DMA has written them (CUDA's API synchronization rules): attnd, told right
// after, could read the old bytes. (Likely what was seen once on two H200s: a sequence import
// through a peer CUDA_IPC channel failed attnd's CRC check of a chunk the client had just copied
// in.) So the copy is enqueued and then waited for. It goes on the legacy default stream, as
// cudaMemcpy's does: that stream is ordered after the work of every blocking stream, which a
// caller relies on to read o that its ExchangeOnStream (or other work) put on one. (On the
// thread's per-thread stream instead, which has no such ordering, CopyOut read o before the NCCL
// receive wrote it: NcclClientOnAnotherGpuMatchesForwardBitwise failed on 2 x H200.)
cudaError_t CopyAndWait(void* destination, const void* source, size_t bytes, cudaMemcpyKind kind) {
  cudaError_t error = cudaMemcpyAsync(destination, source, bytes, kind, cudaStreamLegacy);
  if (error == cudaSuccess) error = cudaStreamSynchronize(cudaStreamLegacy);
  return error;
}

}  // namespace

std::string CurrentPciBusId() {
  int current = 0;
  char bus_id[64] = {};
  if (cudaGetDevice(&current) != cudaSuccess ||
      cudaDeviceGetPCIBusId(bus_id, sizeof(bus_id), current) != cudaSuccess) {
    cudaGetLastError();
    return {};
  }
  return bus_id;
}

int CurrentDevice() {
  int current = 0;
  if (cudaGetDevice(&current) != cudaSuccess) {
    cudaGetLastError();
    return -1;
  }
  return current;
}

absl::Status SetCurrentDevice(int device) {
  if (const cudaError_t error = cudaSetDevice(device); error != cudaSuccess) {
    cudaGetLastError();
    return absl::FailedPreconditionError(absl::StrCat(
        "ChannelOptions::cuda_device ", device, ": ", cudaGetErrorString(error)));
  }
  return absl::OkStatus();
}

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
  // The mapping is opened on the device whose kernels write the ring: this thread's current
  // one. On another GPU than attnd's, cudaIpcMemLazyEnablePeerAccess enables peer access to
  // attnd's (its kernels then write over NVLink or PCIe); attnd already refused the channel if
  // the two cannot reach each other (ChannelInfo.peer_access), but check here too for a
  // server that was not asked.
  int current = 0;
  if (absl::Status got = CudaStatus(cudaGetDevice(&current), "cudaGetDevice"); !got.ok()) {
    return got;
  }
  if (current != ordinal) {
    int can_access = 0;
    if (cudaDeviceCanAccessPeer(&can_access, current, ordinal) != cudaSuccess || !can_access) {
      cudaGetLastError();
      return absl::FailedPreconditionError(absl::StrCat(
          "this process's current GPU (ordinal ", current, ") has no peer access to attnd's GPU ",
          pci_bus_id, "; use HOST_SHM, or NCCL"));
    }
  }
  cudaIpcMemHandle_t ipc;
  std::memcpy(&ipc, handle.data(), sizeof(ipc));
  void* ring = nullptr;
  const cudaError_t opened = cudaIpcOpenMemHandle(&ring, ipc, cudaIpcMemLazyEnablePeerAccess);
  if (opened != cudaSuccess) return CudaStatus(opened, "cudaIpcOpenMemHandle");
  *device = current;
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
  CopyAndWait(&value, flag, sizeof(value), cudaMemcpyDeviceToHost);
  return value;
}

void WriteDeviceFlag(uint8_t* flag, uint32_t value) {
  CopyAndWait(flag, &value, sizeof(value), cudaMemcpyHostToDevice);
}

absl::Status CopyDevice(void* destination, const void* source, int64_t bytes, bool to_device) {
  return CudaStatus(CopyAndWait(destination, source, static_cast<size_t>(bytes),
                                to_device ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToHost),
                    "cudaMemcpy");
}

absl::Status StreamWriteFlag(void* stream, uint8_t* flag, uint32_t value) {
  return cuda::StreamWriteFlag(static_cast<cudaStream_t>(stream), flag, value);
}

absl::Status StreamWaitFlag(void* stream, uint8_t* flag, uint32_t value) {
  return cuda::StreamWaitFlag(static_cast<cudaStream_t>(stream), flag, value);
}

absl::Status StreamSignalFlag(void* stream, uint8_t* flag, uint32_t value) {
  return cuda::LaunchFlagSignal(static_cast<cudaStream_t>(stream), flag, value);
}

absl::Status StreamPollFlag(void* stream, uint8_t* flag, uint32_t value) {
  return cuda::LaunchFlagGate(static_cast<cudaStream_t>(stream), flag, value);
}

}  // namespace attnd::client::internal
