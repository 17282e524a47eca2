// The 32-bit flag words of a channel in memory shared between processes (HOST_SHM), read and
// written with acquire/release atomics; a waiter may sleep on a word with a futex (a shared,
// not a private, futex: the word is in a mapping of another process too).
//
// Sequences wrap at 2^32, so "reached" is a serial-number comparison:
// (int32_t)(flag - sequence) >= 0, the same as CU_STREAM_WAIT_VALUE_GEQ.
#pragma once

#include <atomic>
#include <cstdint>

#include "absl/time/time.h"

namespace attnd {

inline bool SequenceReached(uint32_t flag, uint32_t sequence) {
  return static_cast<int32_t>(flag - sequence) >= 0;
}

inline std::atomic_ref<uint32_t> FlagAt(uint8_t* ring, int64_t offset) {
  return std::atomic_ref<uint32_t>(*reinterpret_cast<uint32_t*>(ring + offset));
}

inline uint32_t LoadFlag(uint8_t* ring, int64_t offset) {
  return FlagAt(ring, offset).load(std::memory_order_acquire);
}

// Stores `value` with release order and wakes every futex waiter on the word.
void StoreFlagAndWake(uint8_t* ring, int64_t offset, uint32_t value);

// Wakes every futex waiter on the word without changing it.
void WakeFlag(uint8_t* ring, int64_t offset);

// Sleeps while the word still holds `seen`, at most `timeout` (spurious wake-ups happen: the
// caller re-reads the word).
void SleepOnFlag(uint8_t* ring, int64_t offset, uint32_t seen, absl::Duration timeout);

}  // namespace attnd
