#include "emulator.h"

namespace attnd::attnctl {

absl::Status FillRegionsOnStream(const FillRegion*, int, bool, void*) {
  return absl::UnimplementedError("attnctl was built without CUDA: --transport=cuda_ipc|nccl needs it");
}

}  // namespace attnd::attnctl

namespace attnd::attnctl {

absl::StatusOr<std::unique_ptr<EmulatorStream>> EmulatorStream::Create(int, int) {
  return absl::UnimplementedError("attnctl was built without CUDA: --transport=cuda_ipc|nccl needs it");
}
EmulatorStream::~EmulatorStream() = default;
absl::Status EmulatorStream::Record(int) { return absl::UnimplementedError("no CUDA"); }
absl::Status EmulatorStream::Synchronize() { return absl::UnimplementedError("no CUDA"); }
absl::Status EmulatorStream::WaitEvent(int) { return absl::UnimplementedError("no CUDA"); }
absl::Status EmulatorStream::Sleep(int64_t) { return absl::UnimplementedError("no CUDA"); }
double EmulatorStream::ElapsedMs(int, int) const { return 0; }

}  // namespace attnd::attnctl
