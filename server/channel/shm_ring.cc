#include "channel/shm_ring.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <random>

#include "absl/strings/str_cat.h"

namespace attnd {

absl::StatusOr<std::unique_ptr<ShmRing>> ShmRing::Create(const std::string& tag, int64_t bytes) {
  std::random_device random;
  const std::string name =
      absl::StrCat("/attnd-", getpid(), "-", tag, "-", absl::Hex(random(), absl::kZeroPad8));
  // Owner read/write only: the client runs as the same user (or root) on this host.
  const int fd = shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
  if (fd < 0) {
    return absl::ResourceExhaustedError(
        absl::StrCat("shm_open(", name, "): ", std::strerror(errno)));
  }
  // posix_fallocate reserves the tmpfs pages now: a full /dev/shm fails here with ENOSPC
  // instead of a SIGBUS on first touch.
  if (const int error = posix_fallocate(fd, 0, bytes); error != 0) {
    close(fd);
    shm_unlink(name.c_str());
    return absl::ResourceExhaustedError(absl::StrCat("posix_fallocate(", name, ", ", bytes,
                                                     " bytes): ", std::strerror(error)));
  }
  void* mapped = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int error = errno;
  close(fd);
  if (mapped == MAP_FAILED) {
    shm_unlink(name.c_str());
    return absl::ResourceExhaustedError(
        absl::StrCat("mmap(", name, ", ", bytes, "): ", std::strerror(error)));
  }
  return std::unique_ptr<ShmRing>(new ShmRing(name, static_cast<uint8_t*>(mapped), bytes));
}

ShmRing::~ShmRing() {
  munmap(data_, size_);
  shm_unlink(name_.c_str());
}

}  // namespace attnd
