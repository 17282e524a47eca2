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
// most kStreamStepWindow ahead of their completions (StreamStepWindow).
// The completion thread waits for each layer's last event, reports its kernel times and calls
// the engine's ChannelLayerDone.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "backend/backend.h"
#include "backend/cuda_cache.h"
#include "backend/cuda_memory.h"
#include "backend/cuda_step_resources.h"
#include "backend/stream_step_window.h"
#include "channel/channel_layout.h"

namespace attnd::cuda_backend {

class CudaStep;

class CudaIpcChannel final : public BackendChannel {
 public:
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
  struct ActiveStep : StreamStep<LayerEvents> {
    bool mark_aborted = true;
  };

  CudaIpcChannel(CudaCache* cache, const ChannelSpec& spec, int device);
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
  // The CTA counter of the kernels that set a layer's done word themselves (cuda::GridSignal):
  // one word, zero between launches; the channel's layers run one at a time on its stream.
  DeviceBuffer done_counter_;
  std::string ipc_handle_;
  std::string pci_bus_id_;
  Lane lane_;
  CudaStream signal_;  // attnd's own flag writes (SignalReady, CancelStep, skipped layers)
  // A benchmark aid (ATTND_CHANNEL_STAMPS=1 in attnd's environment): per layer, the global timer
  // when the ready wait passed and when the kernels were done, written by one-thread kernels
  // into mapped host memory ([num_layers][2]) and printed to stderr as each layer completes, to
  // put attnd's part on one time line with the client's (scripts/channel_stamps.py). Each stamp
  // costs a kernel launch on the stream. Null when off.
  uint64_t* stamps_ = nullptr;
  uint64_t* stamps_device_ = nullptr;

  std::mutex mu_;
  std::condition_variable wake_;
  StreamStepWindow<ActiveStep> window_;  // its steps and free events under mu_
  LayerTimingDraw timing_draw_;          // the enqueuer thread's: which layers are timed
  bool stopping_ = false;
  std::thread enqueuer_;
};

}  // namespace attnd::cuda_backend
