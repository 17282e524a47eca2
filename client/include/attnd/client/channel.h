// A data-plane channel (DESIGN 3b): memory this process and attnd both map, through which a
// step's per-layer tensors travel with no RPC. Open one on a cache, plan steps with
// PlanRequest.channel_id = channel->id(), then per layer:
//   write the layer's inputs into Slot(layer) -> SetReady(layer, sequence)
//   -> WaitDone(layer, sequence) -> read o (and lse) from Slot(layer)
// where `sequence` is PlanResponse.channel_sequence. Layer l uses slot l % slots(): write
// layer l + slots()'s inputs only after layer l is done. attnd takes layers in order.
//
// HOST_SHM: Slot pointers are host memory (a POSIX shared-memory mapping); SetReady/WaitDone
// are host atomics (WaitDone spins briefly, then sleeps on the word's futex).
// CUDA_IPC (builds with CUDA): Slot pointers are device memory of attnd's GPU mapped into this
// process; signal from a CUDA stream with SetReadyOnStream/WaitDoneOnStream (stream memory
// operations: no host on the path), or from the host with SetReady/WaitDone. Open it with the
// GPU that will write the ring current: Open names that GPU to attnd (client_pci_bus_id), which
// refuses a GPU that cannot reach its own, and maps the ring there (peer access enabled when it
// is not attnd's GPU). NCCL channels are not driven by this class yet (issue 19).
//
// The channel lives as long as this object (its OpenChannel call): destroying it closes the
// channel, and attnd aborts the channel's open steps. Thread-safe for distinct layers.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>

#include <grpcpp/client_context.h>
#include <grpcpp/support/sync_stream.h>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/time/time.h"
#include "attnd/v1/attnd.grpc.pb.h"

namespace attnd::client {

class Client;

struct ChannelOptions {
  attnd::v1::ChannelKind kind = attnd::v1::CHANNEL_KIND_HOST_SHM;
  int32_t max_tokens = 0;  // largest step (rows of q) the channel carries
  int32_t slots = 0;       // 0: the server's default (2)
  bool with_lse = false;
  // WaitDone from the host spins this long on the done word before it sleeps on it (a futex
  // attnd wakes). A layer longer than the spin pays a wake-up (~tens of us); spinning costs a
  // core while it lasts.
  absl::Duration host_spin = absl::Microseconds(200);
};

// Pointers into one slot of the ring (host or device memory, see above). Null where the
// cache kind has no such tensor.
struct ChannelSlot {
  void* q = nullptr;     // MHA q [T, Hq, D]; MLA q_nope [T, H, kv_lora_rank]
  void* k = nullptr;     // MHA [T, Hkv, D]
  void* v = nullptr;     // MHA [T, Hkv, D]
  void* q_pe = nullptr;  // MLA [T, H, rope_dim]
  void* ckv = nullptr;   // MLA [T, kv_lora_rank]
  void* kpe = nullptr;   // MLA [T, rope_dim]
  void* o = nullptr;     // [T, Hq, D] (MLA [T, H, kv_lora_rank])
  float* lse = nullptr;  // [T, Hq] when opened with_lse
};

class Channel {
 public:
  // Opens a channel on `cache` and maps its ring. `client` must outlive the channel.
  static absl::StatusOr<std::unique_ptr<Channel>> Open(Client& client, std::string_view cache,
                                                       const ChannelOptions& options);
  ~Channel();
  Channel(const Channel&) = delete;
  Channel& operator=(const Channel&) = delete;

  uint64_t id() const { return info_.channel_id(); }
  const attnd::v1::ChannelInfo& info() const { return info_; }
  attnd::v1::ChannelKind kind() const { return info_.kind(); }
  int32_t slots() const { return info_.slots(); }
  ChannelSlot Slot(int32_t layer) const;

  // Host-side signalling (either kind).
  void SetReady(int32_t layer, uint32_t sequence);
  // OK once done[layer] reached `sequence`; DEADLINE_EXCEEDED after `timeout`; ABORTED when
  // attnd aborted that step (its o means nothing); UNAVAILABLE once the channel closed.
  absl::Status WaitDone(int32_t layer, uint32_t sequence,
                        absl::Duration timeout = absl::Seconds(60));
  // True when attnd aborted the step of `sequence` (or a later one).
  bool Aborted(uint32_t sequence) const;

  // CUDA_IPC: stream memory operations on `stream` (a cudaStream_t): set ready after the work
  // queued before it; make the stream's later work wait for done. UNIMPLEMENTED without CUDA.
  absl::Status SetReadyOnStream(int32_t layer, uint32_t sequence, void* stream);
  absl::Status WaitDoneOnStream(int32_t layer, uint32_t sequence, void* stream);

  // Copies between this process's host memory and a slot tensor (a ChannelSlot pointer), for
  // either kind: memcpy for HOST_SHM, a synchronous cudaMemcpy for CUDA_IPC.
  absl::Status CopyIn(void* slot_tensor, const void* host, int64_t bytes);
  absl::Status CopyOut(void* host, const void* slot_tensor, int64_t bytes) const;

  // Sequence transfers through the channel (sequence.h's channel variants): region r of the
  // ring (host or device memory, as Slot's pointers; copy with CopyIn/CopyOut), its 32-bit
  // transfer flag word, and the word attnd increments when a transfer ends
  // (ChannelLayout.transfer_*). Flags are read and written from the host.
  int32_t transfer_regions() const { return info_.layout().transfer_region_offsets_size(); }
  int64_t transfer_region_bytes() const { return info_.layout().transfer_region_bytes(); }
  int64_t TransferRegionOffset(int32_t region) const {
    return info_.layout().transfer_region_offsets(region);
  }
  void* TransferRegion(int32_t region) const { return ring_ + TransferRegionOffset(region); }
  uint32_t TransferFlag(int32_t region) const {
    return ReadFlag(info_.layout().transfer_flag_offsets(region));
  }
  void SetTransferFlag(int32_t region, uint32_t value) {
    WriteFlag(info_.layout().transfer_flag_offsets(region), value);
  }
  uint32_t TransfersEnded() const { return ReadFlag(info_.layout().transfer_end_offset()); }

  // Why the server closed the channel ("" while it is open).
  std::string closed_reason() const;

 private:
  Channel() = default;
  absl::Status Map();
  void Unmap();
  uint32_t ReadFlag(int64_t offset) const;
  void WriteFlag(int64_t offset, uint32_t value);
  void ReadUntilClosed();

  attnd::v1::ChannelInfo info_;
  absl::Duration host_spin_ = absl::Microseconds(200);
  uint8_t* ring_ = nullptr;  // host mapping (HOST_SHM) or device pointer (CUDA_IPC)
  int64_t ring_bytes_ = 0;
  int cuda_device_ = -1;     // CUDA_IPC: the device the ring was opened on

  std::unique_ptr<grpc::ClientContext> call_;
  std::unique_ptr<grpc::ClientReader<attnd::v1::OpenChannelResponse>> reader_;
  std::thread reader_thread_;
  mutable std::mutex mu_;
  std::string closed_reason_;
  std::atomic<bool> closed_{false};
};

}  // namespace attnd::client
