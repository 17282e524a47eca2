#include "emulator.h"

namespace attnd::attnctl {

absl::Status FillRegionsOnStream(const FillRegion*, int, bool, void*, FillStamps*, bool,
                                 const FillSignal*) {
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

absl::StatusOr<std::unique_ptr<StampBuffer>> StampBuffer::Create(int64_t) {
  return absl::UnimplementedError("attnctl was built without CUDA: stamps need it");
}
StampBuffer::~StampBuffer() = default;
absl::StatusOr<std::vector<FillStamps>> StampBuffer::Read() const {
  return absl::UnimplementedError("no CUDA");
}

}  // namespace attnd::attnctl
