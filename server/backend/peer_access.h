// Whether a client's GPU can reach a CUDA_IPC ring on attnd's GPU (issue 19). Pure logic over a
// DeviceTopology, so the refusals are unit-tested without a GPU; the CUDA backend supplies the
// real topology (cudaDeviceGetByPCIBusId, cudaDeviceCanAccessPeer).
//
// A client names its GPU by PCI bus id because ordinals differ between processes
// (CUDA_VISIBLE_DEVICES); attnd resolves the id among the devices *it* sees. A GPU attnd does
// not see cannot be checked, so it is refused like one without peer access.
#pragma once

#include <optional>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace attnd {

// "0000:3b:00.0" from "3B:00.0", "0000:3B:00.0" or "00000000:3b:00.0" (nvidia-smi's form):
// lower case, a 4-digit domain. INVALID_ARGUMENT naming `field` for anything else (the id comes
// from the wire).
absl::StatusOr<std::string> NormalizePciBusId(std::string_view bus_id, std::string_view field);

class DeviceTopology {
 public:
  virtual ~DeviceTopology() = default;
  // The ordinal (in this process) of the device with this normalised bus id; nullopt when it
  // is not visible here.
  virtual std::optional<int> OrdinalOf(const std::string& pci_bus_id) const = 0;
  // Whether device `from` can map memory of device `to` (cudaDeviceCanAccessPeer).
  virtual bool CanAccessPeer(int from, int to) const = 0;
};

// OK when the GPU `client_pci_bus_id` (normalised) is `ring_device` or can access it as a
// peer; FAILED_PRECONDITION naming client_pci_bus_id and suggesting HOST_SHM otherwise.
absl::Status CheckPeerAccess(const std::string& client_pci_bus_id, int ring_device,
                             const std::string& ring_pci_bus_id, const DeviceTopology& topology);

}  // namespace attnd
