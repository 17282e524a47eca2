// The CUDA part of client channels (channel_cuda.cc with CUDA, channel_no_cuda.cc without):
// mapping a CUDA_IPC ring and flag operations on device memory.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"

namespace attnd::client::internal {

// Opens the 64-byte cudaIpcMemHandle on the device with this PCI bus id; `device` is set.
absl::StatusOr<uint8_t*> OpenIpcRing(const std::string& handle, const std::string& pci_bus_id,
                                     int* device);
void CloseIpcRing(uint8_t* ring, int device);
uint32_t ReadDeviceFlag(const uint8_t* flag);
void WriteDeviceFlag(uint8_t* flag, uint32_t value);
absl::Status StreamWriteFlag(void* stream, uint8_t* flag, uint32_t value);
absl::Status StreamWaitFlag(void* stream, uint8_t* flag, uint32_t value);

}  // namespace attnd::client::internal
