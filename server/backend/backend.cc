#include "backend/backend.h"

#include <algorithm>
#include <cstring>

namespace attnd {

const char* ChannelKindName(ChannelKind kind) {
  switch (kind) {
    case ChannelKind::kCudaIpc:
      return "CUDA_IPC";
    case ChannelKind::kNccl:
      return "NCCL";
    case ChannelKind::kHostShm:
      break;
  }
  return "HOST_SHM";
}

void InputBytes::CopyTo(void* destination, int64_t bytes) const {
  auto* out = static_cast<uint8_t*>(destination);
  if (pieces.empty()) {
    if (bytes > 0) std::memcpy(out, data, static_cast<size_t>(bytes));
    return;
  }
  for (const std::string_view piece : pieces) {
    const int64_t n = std::min<int64_t>(bytes, static_cast<int64_t>(piece.size()));
    if (n <= 0) break;
    std::memcpy(out, piece.data(), static_cast<size_t>(n));
    out += n;
    bytes -= n;
  }
}

const void* InputBytes::Contiguous(int64_t bytes, std::vector<uint8_t>& scratch) const {
  if (pieces.empty()) return data;
  if (pieces.size() == 1) return pieces.front().data();
  scratch.resize(static_cast<size_t>(bytes));
  CopyTo(scratch.data(), bytes);
  return scratch.data();
}

}  // namespace attnd
