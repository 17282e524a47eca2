#include "backend/peer_access.h"

#include <cctype>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"

namespace attnd {
namespace {

bool AllHex(std::string_view text, size_t min_size, size_t max_size) {
  if (text.size() < min_size || text.size() > max_size) return false;
  for (const char c : text) {
    if (!std::isxdigit(static_cast<unsigned char>(c))) return false;
  }
  return true;
}

}  // namespace

absl::StatusOr<std::string> NormalizePciBusId(std::string_view bus_id, std::string_view field) {
  // [domain:]bus:device.function, hex; domain up to 8 digits (nvidia-smi writes 8).
  std::vector<std::string> parts;
  size_t begin = 0;
  for (size_t colon = bus_id.find(':'); parts.size() < 4; colon = bus_id.find(':', begin)) {
    parts.emplace_back(bus_id.substr(begin, colon - begin));
    if (colon == std::string_view::npos) break;
    begin = colon + 1;
  }
  std::string domain = "0000";
  std::string bus;
  std::string rest;
  if (parts.size() == 3) {
    domain = parts[0];
    bus = parts[1];
    rest = parts[2];
  } else if (parts.size() == 2) {
    bus = parts[0];
    rest = parts[1];
  }
  const size_t dot = rest.find('.');
  const std::string device = rest.substr(0, dot);
  const std::string function = dot == std::string::npos ? "" : rest.substr(dot + 1);
  const bool ok = (parts.size() == 2 || parts.size() == 3) && AllHex(domain, 1, 8) &&
                  AllHex(bus, 1, 2) && AllHex(device, 1, 2) && AllHex(function, 1, 1);
  if (!ok) {
    return absl::InvalidArgumentError(absl::StrCat(
        std::string(field), ": expected a PCI bus id [domain:]bus:device.function in hex (as "
        "cudaDeviceGetPCIBusId writes it, e.g. 0000:3b:00.0), got '",
        std::string(bus_id.substr(0, 64)), "'"));
  }
  // Domains above 0xffff do not occur on the hosts CUDA supports: keep the last 4 digits.
  if (domain.size() > 4) domain = domain.substr(domain.size() - 4);
  std::string normal = absl::StrCat(std::string(4 - domain.size(), '0'), domain, ":",
                                    std::string(2 - bus.size(), '0'), bus, ":",
                                    std::string(2 - device.size(), '0'), device, ".", function);
  absl::AsciiStrToLower(&normal);
  return normal;
}

absl::Status CheckPeerAccess(const std::string& client_pci_bus_id, int ring_device,
                             const std::string& ring_pci_bus_id, const DeviceTopology& topology) {
  const std::optional<int> client = topology.OrdinalOf(client_pci_bus_id);
  if (!client.has_value()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "client_pci_bus_id: GPU ", client_pci_bus_id,
        " is not visible to attnd (its CUDA_VISIBLE_DEVICES), so whether it reaches the ring on ",
        ring_pci_bus_id, " cannot be checked; open a HOST_SHM (or NCCL) channel instead"));
  }
  if (*client == ring_device || topology.CanAccessPeer(*client, ring_device)) {
    return absl::OkStatus();
  }
  return absl::FailedPreconditionError(absl::StrCat(
      "client_pci_bus_id: GPU ", client_pci_bus_id, " has no peer access to attnd's GPU ",
      ring_pci_bus_id, " (cudaDeviceCanAccessPeer), so it cannot map the CUDA_IPC ring; open a "
      "HOST_SHM (or NCCL) channel instead"));
}

}  // namespace attnd
