#include "channel/host_shm_channel.h"

#include <chrono>
#include <utility>

#include "absl/strings/str_cat.h"
#include "attnd/status_macros.h"
#include "channel/flag_word.h"

namespace attnd {
namespace {

// A ready word is polled this long before the pump sleeps on its futex; a client that sets
// ready without waking the futex is seen within kSleepSlice.
constexpr auto kSpin = std::chrono::microseconds(200);
constexpr absl::Duration kSleepSlice = absl::Milliseconds(1);

}  // namespace

absl::StatusOr<std::unique_ptr<HostShmChannel>> HostShmChannel::Create(
    const CacheGeometry& geometry, const ChannelSpec& spec, DeviceHooks hooks) {
  ChannelLayout layout = MakeChannelLayout(geometry, spec.max_tokens, spec.num_slots,
                                           spec.with_lse);
  ASSIGN_OR_RETURN(std::unique_ptr<ShmRing> ring,
                   ShmRing::Create(absl::StrCat(spec.id), layout.ring_bytes));
  std::unique_ptr<HostShmChannel> channel(new HostShmChannel(
      geometry, std::move(layout), std::move(ring), std::move(hooks), spec.with_lse));
  if (channel->hooks_.register_ring) {
    RETURN_IF_ERROR(channel->hooks_.register_ring(channel->ring(), channel->layout_.ring_bytes));
    channel->registered_ = true;
  }
  channel->pump_ = std::thread([raw = channel.get()] { raw->PumpLoop(); });
  return channel;
}

HostShmChannel::HostShmChannel(const CacheGeometry& geometry, ChannelLayout layout,
                               std::unique_ptr<ShmRing> ring, DeviceHooks hooks, bool with_lse)
    : geometry_(geometry),
      layout_(std::move(layout)),
      ring_(std::move(ring)),
      hooks_(std::move(hooks)),
      with_lse_(with_lse) {}

HostShmChannel::~HostShmChannel() {
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
  }
  wake_.notify_all();
  if (pump_.joinable()) pump_.join();
  if (registered_ && hooks_.unregister_ring) hooks_.unregister_ring(ring());
}

void HostShmChannel::StartStep(BackendStep* step, uint32_t sequence, int64_t num_tokens,
                               ChannelLayerDone layer_done) {
  auto active = std::make_shared<ActiveStep>();
  active->step = step;
  active->sequence = sequence;
  active->num_tokens = num_tokens;
  active->layer_done = std::move(layer_done);
  {
    std::lock_guard lock(mu_);
    steps_.push_back(std::move(active));
  }
  wake_.notify_all();
}

void HostShmChannel::CancelStep(uint32_t sequence) {
  {
    std::lock_guard lock(mu_);
    for (auto& active : steps_) {
      if (active->sequence == sequence) active->cancelled = true;
    }
  }
  wake_.notify_all();
  // The pump may be asleep on a ready word that will never be set.
  for (const int64_t offset : layout_.ready) WakeFlag(ring(), offset);
}

void HostShmChannel::SignalReady(int32_t layer, uint32_t sequence) {
  StoreFlagAndWake(ring(), layout_.ready[layer], sequence);
}

void HostShmChannel::RunLayer(const ActiveStep& active, int32_t layer) {
  const ChannelSlotLayout& slot = layout_.slots[layout_.SlotOf(layer)];
  uint8_t* base = ring();
  LayerIo io;
  io.layer = layer;
  io.host_registered = registered_;
  if (geometry_.mla) {
    io.q = base + slot.q;
    io.q_pe = base + slot.q_pe;
    io.ckv = base + slot.ckv;
    io.kpe = base + slot.kpe;
  } else {
    io.q = base + slot.q;
    io.k = base + slot.k;
    io.v = base + slot.v;
  }
  io.o = base + slot.o;
  io.lse = with_lse_ ? reinterpret_cast<float*>(base + slot.lse) : nullptr;
  const int64_t done_offset = layout_.done[layer];
  const uint32_t sequence = active.sequence;
  ChannelLayerDone layer_done = active.layer_done;
  active.step->RunLayer(io, [base, done_offset, sequence, layer,
                             layer_done = std::move(layer_done)](absl::Status status) {
    StoreFlagAndWake(base, done_offset, sequence);
    layer_done(layer, std::move(status));
  });
}

void HostShmChannel::SkipLayer(const ActiveStep& active, int32_t layer) {
  StoreFlagAndWake(ring(), layout_.aborted, active.sequence);
  StoreFlagAndWake(ring(), layout_.done[layer], active.sequence);
  active.layer_done(layer, absl::CancelledError(absl::StrCat(
                               "layer ", layer, " of channel step ", active.sequence,
                               " did not run: the step was aborted")));
}

void HostShmChannel::PumpLoop() {
  const int32_t num_layers = geometry_.num_layers;
  std::unique_lock lock(mu_);
  auto spin_started = std::chrono::steady_clock::now();
  int32_t spinning_for = -1;  // layer (of the front step) the spin budget belongs to
  for (;;) {
    wake_.wait(lock, [&] { return stopping_ || !steps_.empty(); });
    if (steps_.empty()) return;  // stopping with nothing started
    std::shared_ptr<ActiveStep> active = steps_.front();
    if (active->cancelled || stopping_) {
      const int32_t first = active->next_layer;
      active->next_layer = num_layers;
      steps_.pop_front();
      lock.unlock();
      for (int32_t layer = first; layer < num_layers; ++layer) SkipLayer(*active, layer);
      lock.lock();
      continue;
    }
    const int32_t layer = active->next_layer;
    if (layer >= num_layers) {
      steps_.pop_front();
      continue;
    }
    const int64_t ready_offset = layout_.ready[layer];
    const uint32_t seen = LoadFlag(ring(), ready_offset);
    if (SequenceReached(seen, active->sequence)) {
      ++active->next_layer;
      spinning_for = -1;
      lock.unlock();
      RunLayer(*active, layer);
      lock.lock();
      continue;
    }
    if (spinning_for != layer) {
      spinning_for = layer;
      spin_started = std::chrono::steady_clock::now();
    }
    lock.unlock();
    if (std::chrono::steady_clock::now() - spin_started < kSpin) {
#if defined(__x86_64__)
      __builtin_ia32_pause();
#endif
    } else {
      SleepOnFlag(ring(), ready_offset, seen, kSleepSlice);
    }
    lock.lock();
  }
}

}  // namespace attnd
