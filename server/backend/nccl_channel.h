// NcclChannel: a CHANNEL_KIND_NCCL channel (issue 19; DESIGN 3b's "later kinds"). For a client
// on another host, or on a GPU without peer access to attnd's: nothing is shared, the layer's
// tensors travel over a 2-rank NCCL communicator (attnd rank 0, the client rank 1) that attnd
// creates; OpenChannel hands out its ncclUniqueId.
//
// The ring is attnd's own device memory in the channel layout (ChannelLayout's slots; its flag
// words are unused): per layer l of a step of T rows, on the channel's compute stream,
//   group{ncclRecv q, k, v (MLA q_nope, q_pe, ckv, kpe) into slot l mod slots}
//   -> append + attention from the slot into its o (lse)
//   -> group{ncclSend o (, lse)}
// so the receive is the ready word and the send the done word, ordered with the step's kernels
// on one stream; no host on the per-layer path. A step of 0 rows moves nothing.
//
// Threads: the watcher creates the communicator without blocking OpenChannel (a blocking
// communicator, joined on a thread of its own and given up after `init_timeout`: see Join),
// then polls it for asynchronous errors (a peer that died); either failure aborts the
// communicator (NCCL's kernels waiting on the stream then exit) and calls
// ChannelSpec::on_broken, and the engine closes the channel.
// The enqueuer puts layers on the stream (at most kStreamStepWindow ahead of their completions,
// as CudaIpcChannel: StreamStepWindow) once the communicator is up; the completion thread
// reports them. A step cancelled with layers on the stream breaks the channel the same way: the
// peer's sends and attnd's receives no longer pair up.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "backend/backend.h"
#include "backend/cuda_cache.h"
#include "backend/cuda_memory.h"
#include "backend/cuda_step_resources.h"
#include "backend/stream_step_window.h"
#include "attnd/nccl/nccl_loader.h"
#include "channel/channel_layout.h"

namespace attnd::cuda_backend {

class CudaStep;

class NcclChannel final : public BackendChannel {
 public:
  static constexpr int kAttndRank = nccl::kAttndRank;
  static constexpr int kClientRank = nccl::kClientRank;

  static absl::StatusOr<std::unique_ptr<NcclChannel>> Create(CudaCache* cache,
                                                             const ChannelSpec& spec, int device,
                                                             const nccl::NcclLibrary* nccl,
                                                             absl::Duration init_timeout);
  ~NcclChannel() override;

  const ChannelLayout& layout() const override { return layout_; }
  std::string nccl_unique_id() const override { return unique_id_; }
  std::string pci_bus_id() const override { return pci_bus_id_; }
  int32_t device() const override { return device_; }
  void StartStep(BackendStep* step, uint32_t sequence, int64_t num_tokens,
                 ChannelLayerDone layer_done) override;
  void CancelStep(uint32_t sequence, bool mark_aborted) override;
  // Forward{use_channel} is refused for NCCL channels by the engine: nothing to signal.
  void SignalReady(int32_t /*layer*/, uint32_t /*sequence*/) override {}
  // Whether the layer's inputs have arrived (its receive completed on the device).
  bool ReadyReached(int32_t layer, uint32_t sequence) override;

  Lane& lane() { return lane_; }

 private:
  struct WindowEvents {
    LayerEvents layer;
    CudaEvent received;  // after the layer's receive group
    // Timed layers only (timing events): before the receive group and after the send group;
    // `attended` is the kernels' last event. What the wire took on the GPU, for Profile.
    CudaEvent posted;
    CudaEvent sent;
    const CudaEvent* attended = nullptr;
  };
  // Where a layer's time goes, kept for the channel's closing log line, over the last kSamples
  // timed layers (LayerTimingDraw: one in the cache's channel timing stride, so the untimed
  // ones pay nothing for it): the enqueuer's host time per part and how many layers were on
  // the stream when it enqueued one (written by the enqueuer thread alone); the GPU time of the
  // receive (the wait for the client's send included) and of the send (written by the
  // completion thread alone). Read once both threads are gone.
  struct Profile {
    static constexpr size_t kSamples = 4096;
    std::vector<double> recv_host_us, kernels_host_us, send_host_us, ahead;
    std::vector<double> recv_gpu_us, send_gpu_us;
    static void Add(std::vector<double>& samples, double value);
    std::string Summary() const;
  };
  using ActiveStep = StreamStep<WindowEvents>;

  NcclChannel(CudaCache* cache, const ChannelSpec& spec, int device,
              const nccl::NcclLibrary* nccl, absl::Duration init_timeout);
  absl::Status Init();
  void WatchLoop();
  // Creates the communicator as rank 0 (blocking, on a thread of its own, given up after
  // init_timeout_ or when the channel breaks or closes first). Sets comm_ on success.
  absl::Status Join();
  // Aborts the communicator (once the watcher is done with it); see the .cc for the lock.
  void Abort();
  void EnqueueLoop();
  // ahead: layers of the channel on the stream with this one (the profile's).
  void Enqueue(const std::shared_ptr<ActiveStep>& active, int32_t layer, WindowEvents* events,
               int ahead);
  void Complete(const std::shared_ptr<ActiveStep>& active, int32_t layer, WindowEvents* events,
                bool timed, absl::Status status);
  void Skip(const ActiveStep& active, int32_t layer, const absl::Status& why);
  // Asks the watcher to abort the communicator and report the channel broken (once).
  void BreakLocked(absl::Status why);
  // One group of sends or receives of `buffers` (pointer, bytes) with the client, under
  // nccl_mu_ (a connection's first use waits there for the peer's matching group).
  absl::Status Group(bool send, const std::vector<std::pair<uint8_t*, int64_t>>& buffers);

  CudaCache* const cache_;
  const CacheGeometry geometry_;
  const ChannelLayout layout_;
  const int device_;
  const nccl::NcclLibrary* const nccl_;
  const absl::Duration init_timeout_;
  const std::function<void(absl::Status)> on_broken_;
  DeviceBuffer ring_;
  std::string unique_id_;
  std::string pci_bus_id_;
  Lane lane_;

  // Serialises calls on the communicator (NCCL's rule for one communicator) and guards it.
  std::mutex nccl_mu_;
  nccl::ncclComm_t comm_ = nullptr;
  // comm_ as Join set it, for an abort that cannot wait for nccl_mu_; aborted_ is set before
  // any abort, and no call is made on the communicator after it.
  std::atomic<nccl::ncclComm_t> comm_seen_{nullptr};
  std::atomic<bool> aborted_{false};

  std::mutex mu_;
  std::condition_variable wake_;
  StreamStepWindow<ActiveStep> window_;  // its steps and free events under mu_
  bool connected_ = false;
  bool broken_ = false;        // the communicator was (or is being) aborted
  absl::Status break_reason_;  // set once; the watcher acts on it
  bool stopping_ = false;
  LayerTimingDraw timing_draw_;  // the enqueuer's: which layers are timed
  Profile profile_;
  std::thread watcher_;
  std::thread enqueuer_;
};

}  // namespace attnd::cuda_backend
