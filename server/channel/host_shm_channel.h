// HostShmChannel: a HOST_SHM channel, the same on every backend. The ring is a POSIX
// shared-memory object (ShmRing); a pump thread watches the ready words of every layer not yet
// started of every started step (layers and steps in any order: a client may signal them as it
// likes), spinning briefly and then sleeping on the futex of the lowest such layer's word, and
// hands each ready layer to the step's RunLayer with pointers into the ring (so the backend
// reads inputs from and writes o/lse into the client's memory; a GPU backend registers the ring
// and copies straight between it and the device). The layer's completion sets done[l] and
// wakes it. Layer l of a step starts only once layer l of every step started before it has
// finished: a step planned on top of an open one (chained, DESIGN 3b) reads the k/v that the
// earlier step's layer appends.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "backend/backend.h"
#include "channel/channel_layout.h"
#include "channel/shm_ring.h"

namespace attnd {

class HostShmChannel final : public BackendChannel {
 public:
  // Registers the ring with the device (`register_ring`, may be empty) and `unregister_ring`
  // undoes it at destruction. with_registered: tell the backend the pointers are registered.
  struct DeviceHooks {
    std::function<absl::Status(void*, int64_t)> register_ring;
    std::function<void(void*)> unregister_ring;
  };
  static absl::StatusOr<std::unique_ptr<HostShmChannel>> Create(const CacheGeometry& geometry,
                                                                const ChannelSpec& spec,
                                                                DeviceHooks hooks);
  ~HostShmChannel() override;

  const ChannelLayout& layout() const override { return layout_; }
  std::string shm_name() const override { return ring_->name(); }
  void StartStep(BackendStep* step, uint32_t sequence, int64_t num_tokens,
                 ChannelLayerDone layer_done) override;
  void CancelStep(uint32_t sequence, bool mark_aborted) override;
  void SignalReady(int32_t layer, uint32_t sequence) override;
  bool ReadyReached(int32_t layer, uint32_t sequence) override;
  uint8_t* host_ring() override { return ring(); }
  absl::Status ReadRing(int64_t offset, std::span<uint8_t> bytes) override;
  absl::Status WriteRing(int64_t offset, std::span<const uint8_t> bytes) override;
  absl::StatusOr<uint32_t> LoadTransferFlag(int64_t offset) override;
  absl::Status StoreTransferFlag(int64_t offset, uint32_t value) override;

  uint8_t* ring() const { return ring_->data(); }

 private:
  struct ActiveStep {
    BackendStep* step = nullptr;
    uint32_t sequence = 0;
    int64_t num_tokens = 0;
    ChannelLayerDone layer_done;
    std::vector<uint8_t> started;  // [num_layers] handed to the backend (or skipped)
    int32_t remaining = 0;         // layers not yet handed over
  };

  HostShmChannel(const CacheGeometry& geometry, ChannelLayout layout,
                 std::unique_ptr<ShmRing> ring, DeviceHooks hooks, bool with_lse);
  void PumpLoop();
  // Hands layer `layer` of `active` to the backend.
  void RunLayer(const ActiveStep& active, int32_t layer);
  // Marks every layer of `active` not yet started as started; returns them.
  std::vector<int32_t> TakeUnstartedLocked(ActiveStep& active);
  // Sets done[layer] and the aborted word for a layer that will not run, and reports it.
  void SkipLayer(const ActiveStep& active, int32_t layer, bool mark_aborted = true);

  const CacheGeometry geometry_;
  const ChannelLayout layout_;
  const std::unique_ptr<ShmRing> ring_;
  const DeviceHooks hooks_;
  const bool with_lse_;
  bool registered_ = false;

  std::mutex mu_;
  std::condition_variable wake_;
  std::deque<std::shared_ptr<ActiveStep>> steps_;  // in start order
  std::vector<int32_t> running_;  // [num_layers] layers handed to the backend, not yet done
  bool stopping_ = false;
  std::thread pump_;
};

}  // namespace attnd
