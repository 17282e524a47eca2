// StreamStepWindow: the step bookkeeping that CudaIpcChannel and NcclChannel share (DESIGN 3b).
// A channel's enqueuer thread puts the layers of its steps, in start order, on the channel's
// stream, at most kStreamStepWindow ahead of their completions: a stream's push buffer is
// finite, and a thread that enqueued thousands of waits only the client can release would block
// inside the enqueue. The window holds the kStreamStepWindow sets of events the layers on the
// stream take turns with, the steps not yet fully enqueued, and every live step (started, with
// a layer on the stream or still to enqueue) with which of its layers are enqueued, on the
// stream and done.
//
// Threads: the window's state is guarded by the owning channel's mutex, which also guards the
// channel's own state (its enqueuer waits on the channel's condition variable for both). The
// window never waits on the device and never holds the mutex while a layer is enqueued or
// skipped: an enqueue can block on the device, or inside an NCCL group that waits for the peer.
// The events themselves belong to the layer that holds them, between its enqueue and its
// completion.
#pragma once

#include <algorithm>
#include <array>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "backend/backend.h"

namespace attnd::cuda_backend {

class CudaStep;

// Layers of a channel enqueued on the device and not yet completed, at most.
inline constexpr int kStreamStepWindow = 8;

// One started step of a channel. A channel may derive from it for its own per-step state.
template <typename EventsT>
struct StreamStep {
  using Events = EventsT;
  CudaStep* step = nullptr;
  uint32_t sequence = 0;
  ChannelLayerDone layer_done;
  int32_t next_layer = 0;               // the first layer not yet enqueued
  std::vector<uint8_t> completed;       // [num_layers]
  std::vector<Events*> in_flight;       // [num_layers] while enqueued and not completed
  int32_t on_stream = 0;                // layers enqueued and not yet completed
  bool cancelled = false;
};

// Which layers record kernel timing events: one in `stride`, drawn at random. A timing event
// costs ~2 us of the stream under MPS, three per layer most of the handoff budget. At random,
// not every stride-th layer: that would time the same layers of every step (layer 0 follows
// the host's Plan and runs slower). Not thread-safe: the enqueuer thread's alone.
class LayerTimingDraw {
 public:
  // Whether the next layer, of a step of `rows` rows, is timed (never a step of no rows).
  bool Next(int32_t stride, int64_t rows);

 private:
  uint64_t state_ = 0x9E3779B97F4A7C15ull;  // xorshift64*
};

template <typename Step>
class StreamStepWindow {
 public:
  using Events = typename Step::Events;
  using StepPtr = std::shared_ptr<Step>;

  // What the enqueuer reads of its channel's state, under the mutex, before each move.
  struct Gate {
    bool stopping = false;
    bool connected = true;                 // NcclChannel: the communicator is up
    const absl::Status* broken = nullptr;  // NcclChannel: why it broke; every step is skipped
  };

  // `mu` guards the window (and the channel's own state); `wake` is what the enqueuer waits on.
  StreamStepWindow(int32_t num_layers, std::mutex& mu, std::condition_variable& wake)
      : num_layers_(num_layers), mu_(mu), wake_(wake) {
    for (Events& events : events_) free_events_.push_back(&events);
  }
  StreamStepWindow(const StreamStepWindow&) = delete;
  StreamStepWindow& operator=(const StreamStepWindow&) = delete;

  // For the channel's Init, before its enqueuer starts (to create them).
  std::array<Events, kStreamStepWindow>& events() { return events_; }

  // Queues a step for the enqueuer. Takes the mutex.
  void Start(CudaStep* step, uint32_t sequence, ChannelLayerDone layer_done) {
    auto active = std::make_shared<Step>();
    active->step = step;
    active->sequence = sequence;
    active->layer_done = std::move(layer_done);
    active->completed.assign(num_layers_, 0);
    active->in_flight.assign(num_layers_, nullptr);
    {
      std::lock_guard lock(mu_);
      live_.push_back(active);
      steps_.push_back(std::move(active));
    }
    wake_.notify_all();
  }

  // Marks every live step of `sequence` cancelled and calls `cancelled(step)` on it, both under
  // the mutex, then wakes the enqueuer. Takes the mutex.
  template <typename OnCancelled>
  void Cancel(uint32_t sequence, OnCancelled cancelled) {
    std::lock_guard lock(mu_);
    for (auto& active : live_) {
      if (active->sequence != sequence) continue;
      active->cancelled = true;
      cancelled(*active);
    }
    wake_.notify_all();
  }

  // The first live step of `sequence`, or null. Under the mutex.
  const Step* FindLiveLocked(uint32_t sequence) const {
    for (const auto& active : live_) {
      if (active->sequence == sequence) return active.get();
    }
    return nullptr;
  }

  // A layer of `active` left the stream: its events go back to the window. The caller then
  // wakes the enqueuer (outside the mutex) and calls the step's layer_done. Under the mutex.
  void CompleteLocked(const StepPtr& active, int32_t layer, Events* events) {
    active->completed[layer] = 1;
    --active->on_stream;
    active->in_flight[layer] = nullptr;
    free_events_.push_back(events);
    ForgetIfDoneLocked(active);
  }

  // The enqueuer thread's loop; returns once the channel stops and no step is left. Takes the
  // mutex and lets go of it around each call of
  //   skip(const Step&, int32_t layer, const absl::Status& why): a layer that will not run (of a
  //     cancelled step, or of any step once the channel stops or broke);
  //   enqueue(const StepPtr&, int32_t layer, Events*, int ahead): a layer to put on the stream,
  //     with `ahead` layers of the channel on it (this one included); its completion must end
  //     in CompleteLocked;
  // and calls gate() (returning a Gate) under it.
  template <typename GateFn, typename SkipFn, typename EnqueueFn>
  void RunEnqueuer(GateFn gate, SkipFn skip, EnqueueFn enqueue) {
    std::unique_lock lock(mu_);
    for (;;) {
      wake_.wait(lock, [&] {
        const Gate open = gate();
        if (open.stopping || steps_.empty()) return open.stopping;
        const Step& front = *steps_.front();
        if (front.cancelled || open.broken != nullptr) return true;
        return open.connected && (front.next_layer >= num_layers_ || !free_events_.empty());
      });
      if (steps_.empty()) return;  // stopping
      const Gate open = gate();
      StepPtr active = steps_.front();
      if (active->cancelled || open.broken != nullptr || open.stopping) {
        const int32_t first = active->next_layer;
        active->next_layer = num_layers_;
        steps_.pop_front();
        ForgetIfDoneLocked(active);
        const absl::Status why = open.broken != nullptr
                                     ? *open.broken
                                     : absl::CancelledError("the step was aborted");
        lock.unlock();
        for (int32_t layer = first; layer < num_layers_; ++layer) skip(*active, layer, why);
        lock.lock();
        continue;
      }
      if (active->next_layer >= num_layers_) {
        steps_.pop_front();
        continue;
      }
      const int32_t layer = active->next_layer++;
      ++active->on_stream;
      Events* events = free_events_.back();
      free_events_.pop_back();
      active->in_flight[layer] = events;
      const int ahead = kStreamStepWindow - static_cast<int>(free_events_.size());
      lock.unlock();
      enqueue(active, layer, events, ahead);
      lock.lock();
    }
  }

 private:
  // Drops `active` from live_ once no layer of it is or will be on the stream. Under the mutex.
  void ForgetIfDoneLocked(const StepPtr& active) {
    if (active->next_layer < num_layers_ || active->on_stream > 0) return;
    live_.erase(std::remove(live_.begin(), live_.end(), active), live_.end());
  }

  const int32_t num_layers_;
  std::mutex& mu_;
  std::condition_variable& wake_;
  std::array<Events, kStreamStepWindow> events_;
  std::vector<Events*> free_events_;
  std::deque<StepPtr> steps_;  // in start order, until fully enqueued
  // Every started step until its last enqueued layer completed: a cancel must reach the
  // layers on the stream also once steps_ let go of their step (all layers enqueued).
  std::vector<StepPtr> live_;
};

}  // namespace attnd::cuda_backend
