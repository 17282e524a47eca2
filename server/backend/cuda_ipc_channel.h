// CudaIpcChannel: a CUDA_IPC channel (DESIGN 3b). The ring is plain cudaMalloc'd device memory
// shared through a legacy IPC handle, so a client process on the same GPU (or a peer GPU)
// maps it and writes a layer's inputs with its own kernels or copies.
//
// Every step of the channel runs on the channel's own lane (streams, rotated-q buffer, split-KV
// workspace, completion thread), never on the cache's lanes: a stream that waits for a client's
// ready word blocks only this channel. Per layer, on the lane's compute stream:
//   cuStreamWaitValue32(ready[l] >= seq) -> append + attention reading and writing the slot
//   -> cuStreamWriteValue32(done[l] = seq) (a write with a memory barrier: o is visible first)
// so no host is on a layer's critical path. An enqueuer thread puts layers on the stream at
// most kWindow ahead of their completions: a stream's push buffer is finite, and a thread that
// enqueued thousands of waits only the client can release would block inside the enqueue.
// The completion thread waits for each layer's last event, reports its kernel times and calls
// the engine's ChannelLayerDone.
#pragma once

#include <array>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "backend/backend.h"
#include "backend/cuda_cache.h"
#include "backend/cuda_memory.h"
#include "backend/cuda_step_resources.h"
#include "channel/channel_layout.h"

namespace attnd::cuda_backend {

class CudaStep;

class CudaIpcChannel final : public BackendChannel {
 public:
  // Layers of the channel enqueued on the device and not yet completed, at most.
  static constexpr int kWindow = 8;

  static absl::StatusOr<std::unique_ptr<CudaIpcChannel>> Create(CudaCache* cache,
                                                                const ChannelSpec& spec,
                                                                int device);
  ~CudaIpcChannel() override;

  const ChannelLayout& layout() const override { return layout_; }
  std::string cuda_ipc_handle() const override { return ipc_handle_; }
  std::string pci_bus_id() const override { return pci_bus_id_; }
  int32_t device() const override { return device_; }
  bool peer_access() const override { return peer_access_; }
  void StartStep(BackendStep* step, uint32_t sequence, int64_t num_tokens,
                 ChannelLayerDone layer_done) override;
  void CancelStep(uint32_t sequence, bool mark_aborted) override;
  void SignalReady(int32_t layer, uint32_t sequence) override;
  bool ReadyReached(int32_t layer, uint32_t sequence) override;
  // Transfers: synchronous copies on the signal stream (which carries only attnd's own short
  // flag writes, never a wait on the client).
  absl::Status ReadRing(int64_t offset, std::span<uint8_t> bytes) override;
  absl::Status WriteRing(int64_t offset, std::span<const uint8_t> bytes) override;
  absl::StatusOr<uint32_t> LoadTransferFlag(int64_t offset) override;
  absl::Status StoreTransferFlag(int64_t offset, uint32_t value) override;

  Lane& lane() { return lane_; }

 private:
  struct ActiveStep {
    CudaStep* step = nullptr;
    uint32_t sequence = 0;
    ChannelLayerDone layer_done;
    int32_t next_layer = 0;          // the first layer not yet enqueued
    std::vector<uint8_t> completed;  // [num_layers]
    int32_t on_stream = 0;           // layers enqueued and not yet completed
    bool cancelled = false;
    bool mark_aborted = true;
  };

  CudaIpcChannel(CudaCache* cache, const ChannelSpec& spec, int device);
  // Drops `active` from live_ once no layer of it is or will be on the stream. Under mu_.
  void ForgetIfDoneLocked(const std::shared_ptr<ActiveStep>& active);
  absl::Status Init();
  void EnqueueLoop();
  // Enqueues one layer (wait, kernels, done write) and posts its completion.
  void Enqueue(const std::shared_ptr<ActiveStep>& active, int32_t layer, LayerEvents* events);
  void Complete(const std::shared_ptr<ActiveStep>& active, int32_t layer, LayerEvents* events,
                bool timed, absl::Status status);
  // A layer that will not run: done[l] and the aborted word written (on the signal stream).
  void Skip(const ActiveStep& active, int32_t layer);
  absl::Status WriteFlag(int64_t offset, uint32_t value);

  CudaCache* const cache_;
  const CacheGeometry geometry_;
  const ChannelLayout layout_;
  const int device_;
  const bool with_lse_;
  // Opened with a client_pci_bus_id, which CudaCache::CreateChannel found able to reach it.
  const bool peer_access_;
  DeviceBuffer ring_;
  std::string ipc_handle_;
  std::string pci_bus_id_;
  Lane lane_;
  CudaStream signal_;  // attnd's own flag writes (SignalReady, CancelStep, skipped layers)
  std::array<LayerEvents, kWindow> events_;
  // A benchmark aid (ATTND_CHANNEL_STAMPS=1 in attnd's environment): per layer, the global timer
  // when the ready wait passed and when the kernels were done, written by one-thread kernels
  // into mapped host memory ([num_layers][2]) and printed to stderr as each layer completes, to
  // put attnd's part on one time line with the client's (scripts/channel_stamps.py). Each stamp
  // costs a kernel launch on the stream. Null when off.
  uint64_t* stamps_ = nullptr;
  uint64_t* stamps_device_ = nullptr;

  std::mutex mu_;
  std::condition_variable wake_;
  std::vector<LayerEvents*> free_events_;
  uint64_t timing_rng_ = 0x9E3779B97F4A7C15ull;  // the enqueuer thread's: which layers are timed
  std::deque<std::shared_ptr<ActiveStep>> steps_;  // in start order, until fully enqueued
  // Every started step until its last enqueued layer completed: CancelStep must reach the
  // layers on the stream also once steps_ let go of their step (all layers enqueued).
  std::vector<std::shared_ptr<ActiveStep>> live_;
  bool stopping_ = false;
  std::thread enqueuer_;
};

}  // namespace attnd::cuda_backend
