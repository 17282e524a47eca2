// The CUDA part of client channels (channel_cuda.cc with CUDA, channel_no_cuda.cc without):
// mapping a CUDA_IPC ring and flag operations on device memory.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"

namespace attnd::client::internal {

// The PCI bus id of this thread's current CUDA device ("" without CUDA or on any error): what
// OpenChannelRequest.client_pci_bus_id says for a CUDA_IPC channel.
std::string CurrentPciBusId();
// This thread's current CUDA device (-1 on error), and making `device` current.
int CurrentDevice();
absl::Status SetCurrentDevice(int device);
// Opens the 64-byte cudaIpcMemHandle of a ring on the device with this PCI bus id. From the
// current device: directly when it is that device, else with peer access enabled (the current
// device must reach it). `device` is set to the device the mapping was opened on.
absl::StatusOr<uint8_t*> OpenIpcRing(const std::string& handle, const std::string& pci_bus_id,
                                     int* device);
void CloseIpcRing(uint8_t* ring, int device);
uint32_t ReadDeviceFlag(const uint8_t* flag);
void WriteDeviceFlag(uint8_t* flag, uint32_t value);
absl::Status CopyDevice(void* destination, const void* source, int64_t bytes, bool to_device);
absl::Status StreamWriteFlag(void* stream, uint8_t* flag, uint32_t value);
absl::Status StreamWaitFlag(void* stream, uint8_t* flag, uint32_t value);
// The same wait as a one-thread kernel polling the word (attnd/kernels/cuda/flag_gate.h).
absl::Status StreamPollFlag(void* stream, uint8_t* flag, uint32_t value);
// The write as a one-thread kernel launched as a programmatic dependent of the kernel before it.
absl::Status StreamSignalFlag(void* stream, uint8_t* flag, uint32_t value);

}  // namespace attnd::client::internal
