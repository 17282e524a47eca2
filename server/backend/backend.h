// The seam between the engine and the compute device. The engine decides what runs (which
// slots each token takes, which layer, when a step commits); a Backend owns device memory and
// runs the kernels. CudaBackend is used when a GPU is present, CpuBackend (the reference
// implementation, not a mock) otherwise.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "attnd/kernels/attention_params.h"
#include "attnd/kernels/cache_geometry.h"  // CacheGeometry
#include "attnd/kernels/rope.h"
#include "attnd/kernels/step_batch.h"  // StepBatch, StepOptions, StepPhase
#include "attnd/kernels/views.h"
#include "backend/layer_trace.h"

namespace attnd {

// Bytes of one input tensor: contiguous at `data`, or, when `pieces` is not empty, the
// concatenation of the pieces (the slices of a received gRPC message, which a backend copies
// straight into its staging memory).
struct InputBytes {
  const void* data = nullptr;
  std::span<const std::string_view> pieces = {};

  bool empty() const { return data == nullptr && pieces.empty(); }
  // Copies `bytes` bytes to `destination` (which holds them).
  void CopyTo(void* destination, int64_t bytes) const;
  // The bytes contiguous: `data` itself, or the pieces gathered into `scratch`.
  const void* Contiguous(int64_t bytes, std::vector<uint8_t>& scratch) const;
};

// Outputs a backend lends instead of copying them into the caller's buffers: valid until
// `release(release_arg)` runs, which the borrower calls exactly once, from any thread, at any
// time (the step and even the cache may be gone by then).
struct OutputLease {
  const uint8_t* o = nullptr;   // [T][Hq][D] q_dtype
  const float* lse = nullptr;   // [T][Hq] when the step returns lse
  void (*release)(void*) = nullptr;
  void* release_arg = nullptr;

  void Release() {
    if (release != nullptr) release(release_arg);
    release = nullptr;
  }
};

// One layer's inputs and outputs, in host memory owned by the caller until `done` runs.
// Row-major, q_dtype unless noted. Inputs are given either as pointers (q, k, ...) or as
// InputBytes (q_bytes, k_bytes, ...); a non-empty InputBytes wins.
struct LayerIo {
  int32_t layer = 0;
  const void* q = nullptr;     // MHA [T][Hq][D]; MLA q_nope [T][H][kv_lora_rank]
  const void* k = nullptr;     // MHA [T][Hkv][D]
  const void* v = nullptr;     // MHA [T][Hkv][D]
  const void* q_pe = nullptr;  // MLA [T][H][rope_dim]
  const void* ckv = nullptr;   // MLA [T][kv_lora_rank]
  const void* kpe = nullptr;   // MLA [T][rope_dim]
  InputBytes q_bytes, k_bytes, v_bytes, q_pe_bytes, ckv_bytes, kpe_bytes;
  // Outputs: copied to o (and lse) when o is set; otherwise lent through *lease, which the
  // backend fills before `done` runs with OK.
  void* o = nullptr;           // [T][Hq][D] (MLA: [T][H][kv_lora_rank])
  float* lse = nullptr;        // [T][Hq] when the step returns lse, else null
  OutputLease* lease = nullptr;
  LayerTrace* trace = nullptr;  // benchmarks only: stages the backend marks
  // The pointers above (inputs and o/lse) are in host memory the backend registered for
  // direct device access (a HOST_SHM channel's ring): copy straight to and from it, no staging.
  bool host_registered = false;
  // With host_registered, a HOST_SHM channel's done word for this layer: the device may write
  // done_value there once the outputs are in place (the channel writes it again on completion).
  uint32_t* done_word = nullptr;
  uint32_t done_value = 0;

  // The input as InputBytes, whichever way it was given.
  static InputBytes Input(const void* pointer, const InputBytes& bytes) {
    if (!bytes.empty()) return bytes;
    InputBytes in;
    in.data = pointer;
    return in;
  }
};

using DoneCallback = std::function<void(absl::Status)>;

// Receives device timings and transfer volumes; implemented by the metrics module. Called from
// backend threads; must be thread-safe and cheap.
class BackendObserver {
 public:
  virtual ~BackendObserver() = default;
  // kernel: append, decode, prefill, pod, mla_decode, mla_prefill, merge. device: the ordinal
  // (as GetServerInfoResponse.devices lists it) of the cache's device the kernel ran on.
  virtual void OnKernel(std::string_view kernel, std::string_view phase, double seconds,
                        int32_t device) = 0;
  // direction: h2d or d2h; device as above.
  virtual void OnTransfer(std::string_view direction, int64_t bytes, int32_t device) = 0;
};

// Per-step device state (the uploaded plan). Layers of one step may be run concurrently from
// different threads; the backend orders each layer's append before its attention.
class BackendStep {
 public:
  virtual ~BackendStep() = default;
  // The kernel that will run attention for this step ("decode", "prefill", "pod", ...).
  virtual std::string_view KernelName() const = 0;
  // Appends the layer's k/v and computes its attention into io.o / io.lse. Returns at once;
  // `done` runs on a backend thread when the outputs are in place (or with the error). An
  // error other than a validation error means the device faulted. `done` may destroy this
  // BackendStep: the backend must not touch the step after calling it.
  virtual void RunLayer(const LayerIo& io, DoneCallback done) = 0;
};

enum class ChannelKind { kHostShm, kCudaIpc, kNccl };
const char* ChannelKindName(ChannelKind kind);  // "HOST_SHM", "CUDA_IPC", "NCCL"

struct ChannelSpec {
  ChannelKind kind = ChannelKind::kHostShm;
  uint64_t id = 0;  // the engine's channel id (names the shared-memory object)
  int32_t max_tokens = 0;
  int32_t num_slots = 0;
  bool with_lse = false;
  // CUDA_IPC: the client's GPU (PCI bus id, normalised by NormalizePciBusId; empty: unchecked).
  // The backend refuses the channel (FAILED_PRECONDITION) when that GPU cannot reach the ring.
  std::string client_pci_bus_id;
  // Called at most once, on a backend thread with none of the channel's locks held, when the
  // channel can carry no more steps (an NCCL peer that never joined or failed): the engine
  // closes the channel. Its destruction may start on another thread meanwhile (and joins
  // the calling thread), so the caller touches nothing shared after it returns.
  std::function<void(absl::Status why)> on_broken;
};

struct ChannelLayout;

// One layer of a channel step reached its end: its done word is set. `status` is OK when the
// layer ran (also when it ran after CancelStep released its wait: its output then means
// nothing), CANCELLED when it never ran, another error when the device failed.
using ChannelLayerDone = std::function<void(int32_t layer, absl::Status status)>;

// A channel's ring and the machinery that runs steps through it (DESIGN 3b). Created by the
// backend for one cache; destroyed by the engine once no step of it has a layer in flight.
// Thread-safe.
class BackendChannel {
 public:
  virtual ~BackendChannel() = default;
  virtual const ChannelLayout& layout() const = 0;
  // What a client needs to map the ring: the shared-memory object's name (HOST_SHM), or the
  // cudaIpcMemHandle_t bytes, PCI bus id and device ordinal (CUDA_IPC), or the ncclUniqueId
  // bytes to join the channel's communicator (NCCL). peer_access: CUDA_IPC opened with a
  // client_pci_bus_id that reaches the ring.
  virtual std::string shm_name() const { return {}; }
  virtual std::string cuda_ipc_handle() const { return {}; }
  virtual std::string pci_bus_id() const { return {}; }
  virtual int32_t device() const { return 0; }
  virtual bool peer_access() const { return false; }
  virtual std::string nccl_unique_id() const { return {}; }
  // Runs every layer of `step` (prepared with this channel) in layer order: waits for
  // ready[l] to reach `sequence`, runs the layer from slot l mod slots into the same slot, sets
  // done[l] = sequence, then calls layer_done(l, status) on a backend thread. Steps run in the
  // order they are started. Returns at once; never waits for a flag on the caller's thread.
  virtual void StartStep(BackendStep* step, uint32_t sequence, int64_t num_tokens,
                         ChannelLayerDone layer_done) = 0;
  // Ends the waits of the step started with `sequence`: layers not yet started complete as
  // CANCELLED (or, where their wait is already on the device, run on whatever the slot holds);
  // every remaining done word is set and, with `mark_aborted`, the aborted word is set to
  // `sequence` (it reads as "every step up to here aborted": not for a step the client aborted
  // on top of one that still runs, see Engine::EndStep).
  virtual void CancelStep(uint32_t sequence, bool mark_aborted) = 0;
  // Sets ready[layer] to `sequence` for the client (Forward with use_channel). Not called for
  // NCCL channels (their inputs arrive only from the peer).
  virtual void SignalReady(int32_t layer, uint32_t sequence) = 0;
  // Whether ready[layer] has reached `sequence` (the client signalled that layer). May read
  // device memory: never call it under a daemon-wide lock.
  virtual bool ReadyReached(int32_t layer, uint32_t sequence) = 0;

  // Sequence transfers (ExportSequence/ImportSequence through the channel, engine
  // ChannelTransfer): attnd's own access to the ring's bytes and transfer flag words, from the
  // host, synchronous. Offsets and sizes come from the layout (the caller checked them).
  // host_ring: the ring's host mapping (HOST_SHM; null where the ring is device memory), so
  // that pages are copied straight between it and the pool.
  virtual uint8_t* host_ring() { return nullptr; }
  virtual absl::Status ReadRing(int64_t offset, std::span<uint8_t> bytes) {
    (void)offset, (void)bytes;
    return absl::FailedPreconditionError("channel_id: this kind of channel has no ring");
  }
  virtual absl::Status WriteRing(int64_t offset, std::span<const uint8_t> bytes) {
    (void)offset, (void)bytes;
    return absl::FailedPreconditionError("channel_id: this kind of channel has no ring");
  }
  // A flag word's value (acquire), and a store (release; wakes futex waiters on HOST_SHM).
  virtual absl::StatusOr<uint32_t> LoadTransferFlag(int64_t offset) {
    (void)offset;
    return absl::FailedPreconditionError("channel_id: this kind of channel has no ring");
  }
  virtual absl::Status StoreTransferFlag(int64_t offset, uint32_t value) {
    (void)offset, (void)value;
    return absl::FailedPreconditionError("channel_id: this kind of channel has no ring");
  }
};

// A cache's pools. Destroyed only when no step of it has a layer in flight.
class BackendCache {
 public:
  virtual ~BackendCache() = default;
  virtual const CacheGeometry& geometry() const = 0;
  // The ordinal of the device holding the pools.
  virtual int32_t device() const { return 0; }
  // Builds the kernel plan of a step and uploads it. The batch outlives the returned step.
  virtual absl::StatusOr<std::unique_ptr<BackendStep>> PrepareStep(
      std::shared_ptr<const StepBatch> batch) = 0;
  // A step whose layers run through `channel` (one of this cache's channels).
  virtual absl::StatusOr<std::unique_ptr<BackendStep>> PrepareChannelStep(
      std::shared_ptr<const StepBatch> batch, BackendChannel* channel) {
    (void)channel;
    return PrepareStep(std::move(batch));
  }
  // A channel on this cache (the ring sized by its layout); RESOURCE_EXHAUSTED when the memory
  // cannot be had, UNIMPLEMENTED for a kind this backend does not have.
  virtual absl::StatusOr<std::unique_ptr<BackendChannel>> CreateChannel(
      const ChannelSpec& spec) {
    (void)spec;
    return absl::UnimplementedError("kind: this backend has no channels");
  }
  // Copies raw bytes of one layer's pool (K when !v_pool) pages [first_page, first_page +
  // bytes.size() / page bytes) to host. Waits for queued work. For tests and diagnostics.
  virtual absl::Status ReadPages(int32_t layer, bool v_pool, int64_t first_page,
                                 std::span<uint8_t> bytes) = 0;

  // Sequence lifecycle (ForkSequence, ExportSequence, ImportSequence). Synchronous: each returns
  // once the bytes are in place. The engine guarantees that no step writes these pages
  // meanwhile; page ids are checked against the pool. Both backends implement them (the
  // defaults are for test doubles).
  //
  // Copies layer `layer`'s K and V regions of each copy's source page to its destination: the
  // copy-on-write of a step that committed before running this layer (called without the
  // engine's lock; the engine keeps the step's sequences out of reach until it returns).
  virtual absl::Status CopyPages(int32_t layer, std::span<const PageCopy> copies) {
    (void)layer, (void)copies;
    return absl::UnimplementedError("this backend cannot copy pages");
  }
  // Gathers one layer's pool (K when !v_pool) pages `pages`, in that order, into `bytes`
  // (pages.size() pages of KPageBytes/VPageBytes each, the cache's dtype and layout). Waits for
  // nothing else: the engine reads only pages no running step writes.
  virtual absl::Status ReadPageList(int32_t layer, bool v_pool, std::span<const int32_t> pages,
                                    std::span<uint8_t> bytes) {
    (void)layer, (void)v_pool, (void)pages, (void)bytes;
    return absl::UnimplementedError("this backend cannot export pages");
  }
  // The inverse: scatters `bytes` into those pages (visible to every later step on return).
  virtual absl::Status WritePageList(int32_t layer, bool v_pool, std::span<const int32_t> pages,
                                     std::span<const uint8_t> bytes) {
    (void)layer, (void)v_pool, (void)pages, (void)bytes;
    return absl::UnimplementedError("this backend cannot import pages");
  }
};

// One device a backend places caches on. The CPU backend can pretend to have several (each
// with its own KV budget) so that multi-device placement is testable without GPUs.
struct DeviceInfo {
  int32_t ordinal = 0;  // the CUDA device ordinal (--devices); the CPU backend's own numbering
  std::string name;
  int32_t num_sms = 0;
  int64_t memory_bytes = 0;
  int64_t kv_budget_bytes = 0;
};

struct BackendInfo {
  std::string name;    // "cuda" or "cpu"
  std::string device;  // device or CPU model name (the first device's)
  int32_t num_sms = 0;            // the first device's
  int64_t device_memory_bytes = 0;  // the first device's
  int64_t kv_budget_bytes = 0;    // over every device
  std::vector<std::string> extensions;
  std::vector<DeviceInfo> devices;  // every device served, in --devices order; at least one
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual BackendInfo Info() const = 0;
  // Bytes of the KV budget not held by any cache, over every device.
  virtual int64_t KvFreeBytes() const = 0;
  // The same on one device (an ordinal of Info().devices); 0 for one that is not served.
  virtual int64_t KvFreeBytesOn(int32_t device) const {
    return device == 0 ? KvFreeBytes() : 0;
  }
  // Carves a cache's pools out of the KV budget of `device` (an ordinal of Info().devices), or
  // with kAnyDevice of the device with the most free KV budget; RESOURCE_EXHAUSTED when it
  // does not fit, INVALID_ARGUMENT for a device not served.
  static constexpr int32_t kAnyDevice = -1;
  virtual absl::StatusOr<std::unique_ptr<BackendCache>> CreateCache(
      const CacheGeometry& geometry, int32_t device) = 0;
  absl::StatusOr<std::unique_ptr<BackendCache>> CreateCache(const CacheGeometry& geometry) {
    return CreateCache(geometry, kAnyDevice);
  }
};

}  // namespace attnd
