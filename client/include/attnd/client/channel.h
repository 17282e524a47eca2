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
// is not attnd's GPU).
// NCCL (builds with CUDA, libnccl.so.2 loadable): nothing is shared; per layer the inputs go to
// attnd and o comes back with ncclSend/ncclRecv on the caller's stream (ExchangeOnStream), and
// there are no flag words. Open joins attnd's communicator as rank 1 from the GPU current on
// the calling thread (it blocks until joined; NCCL cannot put two ranks on one GPU, so that is
// another GPU than attnd's, or another host's), and keeps a ring of the same layout in that
// GPU's memory so that Slot, CopyIn and CopyOut work as for CUDA_IPC. An aborted step, or attnd
// closing the channel, ends the communicator: later exchanges answer UNAVAILABLE.
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
#include "attnd/v1/attnd.grpc.pb.h"

namespace attnd::client {

class Client;
namespace internal {
class NcclPeer;
}

struct ChannelOptions {
  attnd::v1::ChannelKind kind = attnd::v1::CHANNEL_KIND_HOST_SHM;
  int32_t max_tokens = 0;  // largest step (rows of q) the channel carries
  int32_t slots = 0;       // 0: the server's default (2)
  bool with_lse = false;
  // CUDA_IPC, NCCL: the GPU (this process's CUDA ordinal) to open the channel from, instead of
  // the calling thread's current one (-1): where the ring is mapped and the client's kernels
  // write it (CUDA_IPC, named to attnd as client_pci_bus_id), or where the NCCL rank lives.
  // The thread's current GPU is the same after Open.
  int32_t cuda_device = -1;
  // WaitDone from the host spins this long on the done word before it sleeps on it (a futex
  // attnd wakes). A layer longer than the spin pays a wake-up (~tens of us); spinning costs a
  // core while it lasts.
  absl::Duration host_spin = absl::Microseconds(200);
  // How SetReadyOnStream / WaitDoneOnStream signal and wait on a CUDA_IPC stream:
  // kMemoryOperations (the default): cuStreamWriteValue32 / cuStreamWaitValue32.
  // kKernels: one-thread kernels (attnd/kernels/cuda/flag_gate.h): the wait polls the done
  // word and lets a kernel launched after it as a programmatic dependent start as soon as it
  // sees it (cudaLaunchAttributeProgrammaticStreamSerialization; that kernel calls
  // cudaGridDependencySynchronize() before it reads o); the ready write is launched as a
  // programmatic dependent of the kernel before it. Measured on an H100 under MPS
  // (docs/benchmarks.md): a decode layer's done handoff ~12 -> ~6 us, yet chained steps/s did
  // not move (attnd's kernels ran longer beside the poller). The poller is running work: it
  // holds a CTA slot of one SM while attnd's kernels run (attnd's prefill, which wants every
  // SM, ran 1.3x longer: wait with memory operations for steps with prompt rows), and this
  // process's implicitly synchronizing CUDA calls (cudaFree, ...) wait for it. Without MPS a
  // spinning kernel holds the GPU against attnd's context until its time slice ends: use it
  // under MPS only. kDefault (WaitDoneOnStream's `flags`): the channel's choice.
  enum class StreamFlags { kDefault, kMemoryOperations, kKernels };
  StreamFlags stream_flags = StreamFlags::kMemoryOperations;
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
  // Whether SetReadyOnStream / WaitDoneOnStream use kernels (ChannelOptions::stream_flags):
  // then a kernel launched right after WaitDoneOnStream may be a programmatic dependent.
  bool stream_flag_kernels() const { return flag_kernels_; }
  ChannelSlot Slot(int32_t layer) const;

  // The CUDA device (this process's ordinal) the ring was opened on: CUDA_IPC and NCCL; -1 for
  // HOST_SHM.
  int cuda_device() const { return cuda_device_; }

  // Host-side signalling (HOST_SHM and CUDA_IPC; NCCL channels have no flag words: SetReady does
  // nothing and WaitDone answers FAILED_PRECONDITION).
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
  // CUDA_IPC: the device address of ready[layer] (this process's mapping of the ring), for a
  // kernel of the caller's that sets it itself once its writes of the slot are visible (a
  // system-scope fence, then a release store of the step's sequence number), as the last kernel
  // before attention can instead of a separate SetReadyOnStream. Null for other kinds.
  uint32_t* ReadyWord(int32_t layer) const;
  absl::Status WaitDoneOnStream(int32_t layer, uint32_t sequence, void* stream);
  // The same with the wait's kind chosen for this call (kDefault: the channel's).
  absl::Status WaitDoneOnStream(int32_t layer, uint32_t sequence, void* stream,
                                ChannelOptions::StreamFlags flags);

  // NCCL: enqueues layer `layer` of a step of `rows` rows (PlanResponse.num_tokens) on `stream`
  // (a cudaStream_t of cuda_device()): one NCCL group sending the inputs in `tensors` (q, k, v;
  // MLA q, q_pe, ckv, kpe; `rows` rows of each, after the work enqueued before on `stream`),
  // then one receiving o, and lse when the step was planned with return_lse. `tensors` are
  // device memory of cuda_device(): Slot(layer)'s or the caller's own. attnd runs a channel's
  // layers in order, and the two ranks pair sends with receives in order, so the calls must
  // come in that order too: layers 0..num_layers-1 of each step, steps in Plan order
  // (FAILED_PRECONDITION, nothing enqueued, otherwise). No host wait: work enqueued after it
  // on `stream` sees o. A step of 0 rows moves nothing. UNAVAILABLE once the channel closed.
  absl::Status ExchangeOnStream(int32_t layer, int64_t rows, bool return_lse,
                                const ChannelSlot& tensors, void* stream);

  // Copies between this process's host memory and a slot tensor (a ChannelSlot pointer), for
  // any kind: memcpy for HOST_SHM; for CUDA_IPC and NCCL a copy on the legacy default stream
  // (after the work of every blocking stream, as cudaMemcpy's) that has landed when it returns.
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

  // The ring lives in device memory (CUDA_IPC: attnd's, mapped; NCCL: this process's own).
  bool device_ring() const;

  attnd::v1::ChannelInfo info_;
  absl::Duration host_spin_ = absl::Microseconds(200);
  bool flag_kernels_ = false;  // stream_flags resolved: the stream signals with kernels
  uint8_t* ring_ = nullptr;  // host mapping (HOST_SHM) or device pointer (CUDA_IPC, NCCL)
  int64_t ring_bytes_ = 0;
  int cuda_device_ = -1;     // CUDA_IPC, NCCL: the device the ring was opened on
  std::unique_ptr<internal::NcclPeer> nccl_;  // NCCL: rank 1 and the local ring
  int32_t next_exchange_layer_ = 0;           // NCCL: the layer ExchangeOnStream takes next

  std::unique_ptr<grpc::ClientContext> call_;
  std::unique_ptr<grpc::ClientReader<attnd::v1::OpenChannelResponse>> reader_;
  std::thread reader_thread_;
  mutable std::mutex mu_;
  std::string closed_reason_;
  std::atomic<bool> closed_{false};
  std::mutex exchange_mu_;  // orders ExchangeOnStream calls (next_exchange_layer_)
};

}  // namespace attnd::client
