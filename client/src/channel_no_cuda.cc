// Client channels in a build without CUDA: CUDA_IPC and NCCL are not available (both run on
// this process's GPU).
#include "channel_cuda.h"
#include "channel_nccl.h"

namespace attnd::client::internal {

std::string CurrentPciBusId() { return {}; }
int CurrentDevice() { return -1; }
absl::Status SetCurrentDevice(int) {
  return absl::UnimplementedError(
      "ChannelOptions::cuda_device needs a client built with CUDA (this one was not)");
}
absl::StatusOr<uint8_t*> OpenIpcRing(const std::string&, const std::string&, int*) {
  return absl::UnimplementedError(
      "CUDA_IPC channels need a client built with CUDA (this one was not); use HOST_SHM");
}
void CloseIpcRing(uint8_t*, int) {}
uint32_t ReadDeviceFlag(const uint8_t*) { return 0; }
void WriteDeviceFlag(uint8_t*, uint32_t) {}
absl::Status CopyDevice(void*, const void*, int64_t, bool) {
  return absl::UnimplementedError("CUDA_IPC channels need a client built with CUDA");
}
absl::Status StreamWriteFlag(void*, uint8_t*, uint32_t) {
  return absl::UnimplementedError("CUDA_IPC channels need a client built with CUDA");
}
absl::Status StreamWaitFlag(void*, uint8_t*, uint32_t) {
  return absl::UnimplementedError("CUDA_IPC channels need a client built with CUDA");
}
absl::Status StreamSignalFlag(void*, uint8_t*, uint32_t) {
  return absl::UnimplementedError("CUDA_IPC channels need a client built with CUDA");
}
absl::Status StreamPollFlag(void*, uint8_t*, uint32_t) {
  return absl::UnimplementedError("CUDA_IPC channels need a client built with CUDA");
}

absl::Status NcclAvailable() {
  return absl::UnimplementedError(
      "CHANNEL_KIND_NCCL channels need a client built with CUDA (this one was not); use "
      "HOST_SHM");
}
absl::StatusOr<std::unique_ptr<NcclPeer>> JoinNcclChannel(const std::string&, const std::string&,
                                                          int64_t) {
  return NcclAvailable();
}

}  // namespace attnd::client::internal
