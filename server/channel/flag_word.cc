#include "channel/flag_word.h"

#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <climits>

namespace attnd {

void StoreFlagAndWake(uint8_t* ring, int64_t offset, uint32_t value) {
  FlagAt(ring, offset).store(value, std::memory_order_release);
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(ring + offset), FUTEX_WAKE, INT_MAX, nullptr,
          nullptr, 0);
}

void WakeFlag(uint8_t* ring, int64_t offset) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(ring + offset), FUTEX_WAKE, INT_MAX, nullptr,
          nullptr, 0);
}

void SleepOnFlag(uint8_t* ring, int64_t offset, uint32_t seen, absl::Duration timeout) {
  const timespec limit = absl::ToTimespec(timeout);
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(ring + offset), FUTEX_WAIT, seen, &limit,
          nullptr, 0);
}

}  // namespace attnd
