// The orchestrator emulator of `attnctl bench --transport=shm|cuda_ipc`: the q/k/v an engine's
// projections would produce, as deterministic bf16/fp16 values in [-1, 1) from (seed, index),
// computed the same way on the host (for the reference check and HOST_SHM) and by a kernel on
// the bench's own CUDA stream (CUDA_IPC), writing straight into the channel's slot.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#if defined(__CUDACC__)
#define ATTND_HOST_DEVICE __host__ __device__
#else
#define ATTND_HOST_DEVICE
#endif

namespace attnd::attnctl {

// A 16-bit element (bf16 when bf16, else fp16) of value in [-1, 1) with 7 random bits. One
// 64-bit hash of (seed, index / 4) gives four elements (a byte each): the fill kernel computes
// two hashes per eight elements and stores them as one 16-byte word.
ATTND_HOST_DEVICE inline uint64_t EmulatedHash(uint64_t seed, uint64_t group) {
  uint64_t z = seed * 0x9E3779B97F4A7C15ull + group;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// The element of random byte `byte`.
ATTND_HOST_DEVICE inline uint16_t EmulatedValue(uint32_t byte, bool bf16) {
  // m / 128 for m in [-128, 128): exact in both formats.
  const int32_t m = static_cast<int32_t>(byte & 0xFF) - 128;
  if (m == 0) return 0;
  const uint32_t sign = m < 0 ? 1u : 0u;
  const uint32_t magnitude = static_cast<uint32_t>(m < 0 ? -m : m);  // 1..128
#if defined(__CUDA_ARCH__)
  const int32_t top = 31 - __clz(magnitude);
#else
  const int32_t top = 31 - __builtin_clz(magnitude);
#endif
  // magnitude = 1.xxxxxxx * 2^top; value = magnitude / 128 = 1.xxxxxxx * 2^(top - 7).
  const int32_t exponent = top - 7;
  const uint32_t mantissa7 = (magnitude << (7 - top)) - 128;
  if (bf16) {
    return static_cast<uint16_t>((sign << 15) | (static_cast<uint32_t>(exponent + 127) << 7) |
                                 mantissa7);
  }
  return static_cast<uint16_t>((sign << 15) | (static_cast<uint32_t>(exponent + 15) << 10) |
                               (mantissa7 << 3));
}

ATTND_HOST_DEVICE inline uint16_t EmulatedElement(uint64_t seed, uint64_t index, bool bf16) {
  const uint64_t z = EmulatedHash(seed, index >> 2);
  return EmulatedValue(static_cast<uint32_t>(z >> (8 * (index & 3))), bf16);
}

// One region of FillRegionsOnStream: `count` elements at `device` (device memory) from `seed`.
struct FillRegion {
  void* device = nullptr;
  int64_t count = 0;
  uint64_t seed = 0;
};
inline constexpr int kMaxFillRegions = 3;

// Where a traced fill leaves the GPU's global timer (%globaltimer, ns; one clock for every
// process on the device): when its block 0 started and when its last block finished.
// `finished_blocks` must be 0 before the launch (device memory, see StampBuffer).
struct FillStamps {
  uint64_t start_ns = 0;
  uint64_t end_ns = 0;
  uint64_t finished_blocks = 0;
};

// A flag word the fill sets once its writes are visible (system scope): `word` (device memory
// of the fill's device, e.g. Channel::ReadyWord) to `value`, by the last block to finish, as
// counted in `counter` (device memory, 0 before the first fill; the last block zeroes it again,
// so fills in one stream may share it). EmulatorStream::signal_counter is one.
struct FillSignal {
  uint32_t* word = nullptr;
  uint32_t value = 0;
  uint32_t* counter = nullptr;
};

// Fills up to kMaxFillRegions regions on `stream` (a cudaStream_t) in one launch, as an engine's
// fused QKV projection writes q, k and v with one kernel; with `stamps` (device memory) the
// kernel also records when it ran. UNIMPLEMENTED in a build without CUDA.
// With `after_preceding_grid` it is launched as a programmatic dependent of the kernel before it
// (a channel's done wait with flag kernels), and lets the kernel after it (the ready write)
// start early.
// With `signal` the kernel also sets a flag word when it is done (FillSignal).
absl::Status FillRegionsOnStream(const FillRegion* regions, int num_regions, bool bf16,
                                 void* stream, FillStamps* stamps = nullptr,
                                 bool after_preceding_grid = false,
                                 const FillSignal* signal = nullptr);

// Zeroed device memory for `count` FillStamps, read back once the fills have run.
class StampBuffer {
 public:
  static absl::StatusOr<std::unique_ptr<StampBuffer>> Create(int64_t count);
  ~StampBuffer();
  FillStamps* at(int64_t i) const { return device_ + i; }
  absl::StatusOr<std::vector<FillStamps>> Read() const;

 private:
  StampBuffer() = default;
  FillStamps* device_ = nullptr;
  int64_t count_ = 0;
};

}  // namespace attnd::attnctl

namespace attnd::attnctl {

// The bench's own CUDA stream and timing events (CUDA builds; UNIMPLEMENTED otherwise).
class EmulatorStream {
 public:
  static absl::StatusOr<std::unique_ptr<EmulatorStream>> Create(int device, int num_events);
  ~EmulatorStream();
  void* stream() const { return stream_; }
  absl::Status Record(int event);
  absl::Status Synchronize();
  // Holds the stream on the GPU for about `microseconds`.
  absl::Status Sleep(int64_t microseconds);
  // Waits on the host until the work before `event`'s last record has run.
  absl::Status WaitEvent(int event);
  // Milliseconds between two recorded (and completed) events.
  double ElapsedMs(int from, int to) const;
  // A zeroed device word for the FillSignal of fills on this stream, and a word of its own for
  // a fill to signal that nobody reads (to time a fill with its signal).
  uint32_t* signal_counter() const { return signal_counter_; }
  uint32_t* scratch_word() const { return signal_counter_ + 1; }

 private:
  EmulatorStream() = default;
  void* stream_ = nullptr;
  uint32_t* signal_counter_ = nullptr;
  std::vector<void*> events_;
};

}  // namespace attnd::attnctl
