#include "channel/host_shm_channel.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <utility>
#include <vector>
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
      with_lse_(with_lse),
      running_(geometry.num_layers, 0) {}

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
  active->started.assign(geometry_.num_layers, 0);
  active->remaining = geometry_.num_layers;
  {
    std::lock_guard lock(mu_);
    steps_.push_back(std::move(active));
  }
  wake_.notify_all();
}

std::vector<int32_t> HostShmChannel::TakeUnstartedLocked(ActiveStep& active) {
  std::vector<int32_t> unstarted;
  for (int32_t layer = 0; layer < geometry_.num_layers; ++layer) {
    if (!active.started[layer]) unstarted.push_back(layer);
    active.started[layer] = 1;
  }
  active.remaining = 0;
  return unstarted;
}

void HostShmChannel::CancelStep(uint32_t sequence, bool mark_aborted) {
  // Skipped here, on the caller's thread, rather than by the pump: the step's layers that never
  // started are reported before this returns, so an abort's rollback lands with it (a layer
  // already handed to the backend reports when it finishes, as any running layer).
  std::shared_ptr<ActiveStep> cancelled;
  std::vector<int32_t> skipped;
  {
    std::lock_guard lock(mu_);
    auto it = std::find_if(steps_.begin(), steps_.end(),
                           [&](const auto& active) { return active->sequence == sequence; });
    if (it != steps_.end()) {
      cancelled = *it;
      steps_.erase(it);
      skipped = TakeUnstartedLocked(*cancelled);
    }
  }
  for (const int32_t layer : skipped) SkipLayer(*cancelled, layer, mark_aborted);
  // The pump may be asleep on a ready word that will never be set.
  wake_.notify_all();
  for (const int64_t offset : layout_.ready) WakeFlag(ring(), offset);
}

bool HostShmChannel::ReadyReached(int32_t layer, uint32_t sequence) {
  return SequenceReached(LoadFlag(ring(), layout_.ready[layer]), sequence);
}

void HostShmChannel::SignalReady(int32_t layer, uint32_t sequence) {
  StoreFlagAndWake(ring(), layout_.ready[layer], sequence);
}

absl::Status HostShmChannel::ReadRing(int64_t offset, std::span<uint8_t> bytes) {
  std::memcpy(bytes.data(), ring() + offset, bytes.size());
  return absl::OkStatus();
}

absl::Status HostShmChannel::WriteRing(int64_t offset, std::span<const uint8_t> bytes) {
  std::memcpy(ring() + offset, bytes.data(), bytes.size());
  return absl::OkStatus();
}

absl::StatusOr<uint32_t> HostShmChannel::LoadTransferFlag(int64_t offset) {
  return LoadFlag(ring(), offset);
}

absl::Status HostShmChannel::StoreTransferFlag(int64_t offset, uint32_t value) {
  StoreFlagAndWake(ring(), offset, value);
  return absl::OkStatus();
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
  io.done_word = reinterpret_cast<uint32_t*>(base + done_offset);
  io.done_value = sequence;
  ChannelLayerDone layer_done = active.layer_done;
  // The engine frees the channel only once no layer of it is in flight: `this` outlives this.
  active.step->RunLayer(io, [this, base, done_offset, sequence, layer,
                             layer_done = std::move(layer_done)](absl::Status status) {
    {
      std::lock_guard lock(mu_);
      --running_[layer];
    }
    wake_.notify_all();
    StoreFlagAndWake(base, done_offset, sequence);
    layer_done(layer, std::move(status));
  });
}

void HostShmChannel::SkipLayer(const ActiveStep& active, int32_t layer, bool mark_aborted) {
  if (mark_aborted) StoreFlagAndWake(ring(), layout_.aborted, active.sequence);
  StoreFlagAndWake(ring(), layout_.done[layer], active.sequence);
  active.layer_done(layer, absl::CancelledError(absl::StrCat(
                               "layer ", layer, " of channel step ", active.sequence,
                               " did not run: the step was aborted")));
}

void HostShmChannel::PumpLoop() {
  const int32_t num_layers = geometry_.num_layers;
  std::unique_lock lock(mu_);
  auto idle_since = std::chrono::steady_clock::now();
  std::vector<uint8_t> claimed(num_layers);  // layers an earlier step has not started
  for (;;) {
    wake_.wait(lock, [&] { return stopping_ || !steps_.empty(); });
    if (stopping_) {
      // The engine frees a channel only with no step left; anything still here never runs.
      std::vector<std::pair<std::shared_ptr<ActiveStep>, std::vector<int32_t>>> left;
      for (const auto& active : steps_) left.emplace_back(active, TakeUnstartedLocked(*active));
      steps_.clear();
      lock.unlock();
      for (const auto& [active, skipped] : left) {
        for (const int32_t layer : skipped) SkipLayer(*active, layer);
      }
      return;
    }
    // Ready layers of any started step, in step and layer order; layer l of a later step only
    // once no earlier step's layer l is still running (or waiting to).
    std::shared_ptr<ActiveStep> ready_step;
    int32_t ready_layer = -1;
    int64_t watch_offset = -1;  // the first pending layer's ready word, to sleep on
    uint32_t watch_seen = 0;
    bool held = false;  // a ready layer waits for an earlier step's same layer
    std::fill(claimed.begin(), claimed.end(), 0);
    for (const auto& active : steps_) {
      for (int32_t layer = 0; layer < num_layers && ready_layer < 0; ++layer) {
        if (active->started[layer]) continue;
        const bool blocked = claimed[layer] || running_[layer] > 0;
        claimed[layer] = 1;
        const uint32_t seen = LoadFlag(ring(), layout_.ready[layer]);
        if (SequenceReached(seen, active->sequence)) {
          if (blocked) {
            held = true;
            continue;
          }
          ready_step = active;
          ready_layer = layer;
        } else if (watch_offset < 0) {
          watch_offset = layout_.ready[layer];
          watch_seen = seen;
        }
      }
      if (ready_layer >= 0) break;
    }
    if (ready_layer >= 0) {
      ready_step->started[ready_layer] = 1;
      ++running_[ready_layer];
      if (--ready_step->remaining == 0) {
        steps_.erase(std::find(steps_.begin(), steps_.end(), ready_step));
      }
      lock.unlock();
      RunLayer(*ready_step, ready_layer);
      lock.lock();
      idle_since = std::chrono::steady_clock::now();
      continue;
    }
    if (held) {
      // Woken when a running layer finishes (or a step is started or cancelled).
      wake_.wait_for(lock, std::chrono::milliseconds(1));
      continue;
    }
    lock.unlock();
    if (std::chrono::steady_clock::now() - idle_since < kSpin) {
#if defined(__x86_64__)
      __builtin_ia32_pause();
#endif
    } else if (watch_offset >= 0) {
      SleepOnFlag(ring(), watch_offset, watch_seen, kSleepSlice);
    }
    lock.lock();
  }
}

}  // namespace attnd
