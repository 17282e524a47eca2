// Host and device buffers a CUDA step borrows from its cache for its lifetime: the staging of
// its uploaded arrays and kLayerSlotsPerStep layer slots (pinned staging for one layer's inputs,
// its device inputs and outputs, its events). A layer's host outputs come from the cache's
// OutputPool (cuda_output_pool.h), since they may be lent out beyond the step. A cache keeps the resources of ended steps and
// lends them to the next ones, growing them at PrepareStep when a step needs more; nothing is
// allocated per layer. Owned by one step at a time; slots are handed out under the step's lock.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "attnd/kernels/cuda/grid_signal.h"
#include "backend/backend.h"
#include "backend/cuda_memory.h"

namespace attnd::cuda_backend {

// Layers of one step that can be staged and in flight at once: one layer's inputs copy in while
// the previous one computes and the one before copies out. More layers wait in the step.
inline constexpr int kLayerSlotsPerStep = 4;

// Byte sizes and offsets of one layer's tensors for a step of num_tokens rows.
// MLA caches stage q_nope as q, ckv as k, kpe as v, and q_pe after them.
struct LayerSizes {
  int64_t q_bytes = 0;   // [T][Hq][D] q_dtype (MLA q_nope: [T][H][kv_lora_rank])
  int64_t k_bytes = 0;   // [T][Hkv][D] (MLA ckv: [T][kv_lora_rank])
  int64_t v_bytes = 0;   // [T][Hkv][D] (MLA kpe: [T][rope_dim])
  int64_t q_pe_bytes = 0;  // MLA [T][H][rope_dim]; 0 for MHA
  int64_t k_offset = 0;  // inputs staged as q | k | v | q_pe, each kBufferAlignment-aligned
  int64_t v_offset = 0;
  int64_t q_pe_offset = 0;
  int64_t in_bytes = 0;
  int64_t o_bytes = 0;      // [T][Hq][D] q_dtype (MLA: [T][H][kv_lora_rank])
  int64_t lse_bytes = 0;    // [T][Hq] float32 when the step returns lse, else 0
  int64_t lse_offset = 0;   // outputs as o | lse
  int64_t out_bytes = 0;

  static LayerSizes Of(const CacheGeometry& geometry, int64_t num_tokens, bool return_lse);
};

// The events of one layer in flight. Timing events on the lane's compute stream: before the
// append, after it, after the first and the second attention kernel (decode, then prefill, in a
// step that runs both); `finished` after the layer's last work (its output copy, or for a
// channel layer its done word).
struct LayerEvents {
  CudaEvent started;
  CudaEvent appended;
  CudaEvent attended_first;
  CudaEvent attended_second;
  CudaEvent finished;
  // A mixed step side by side (CudaStep::EnqueueMhaKernels): the side stream starts after the
  // append (fork) and the compute stream continues once the prefill is done (join), then
  // `attended` follows both kernels. Not timing events.
  CudaEvent fork;
  CudaEvent join;
  CudaEvent attended;

  // blocking_sync: see CudaEvent::Create (for `finished`, which a completion thread waits on).
  absl::Status Create(bool blocking_sync);
};

// Device pointers of one layer's tensors for the append and attention kernels. MLA: k is ckv,
// v is kpe. lse null when the step returns none.
struct LayerBuffers {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  const void* q_pe = nullptr;
  void* o = nullptr;
  float* lse = nullptr;
  // Optional: a word the layer's last kernel sets itself once o and lse are stored, where that
  // kernel can (CudaStep::EnqueueKernels says whether it took it).
  cuda::GridSignal done;
};

// One part of a layer run in parts (CudaStep::EnqueueInParts): its inputs copied (H2D stream),
// and its kernels' start, append and attention ends (compute stream; timing events).
struct PartEvents {
  CudaEvent copied;
  CudaEvent started;
  CudaEvent appended;
  CudaEvent attended;

  absl::Status Create();
};

struct LayerSlot : LayerEvents {
  PinnedBuffer host_in;     // q | k | v (| q_pe) as the caller sent them
  DeviceBuffer device_in;   // host_in's layout
  DeviceBuffer device_out;  // o | lse, LayerSizes layout; per slot so that the copy of one
                            // layer's outputs overlaps the next layer's kernels
  CudaEvent inputs_copied;  // on the lane's H2D stream, after host_in -> device_in
  // Parts of a layer run in parts (a HOST_SHM decode layer), created on first use.
  std::vector<std::unique_ptr<PartEvents>> parts;

  // The layer in flight in this slot (set by Submit, cleared by Complete).
  LayerIo io;
  DoneCallback done;
  absl::Status status;
  void* output = nullptr;  // OutputPool::Buffer* the outputs land in
};

struct StepResources {
  PinnedBuffer host_arrays;     // the step's arrays, staged for their one upload
  DeviceBuffer device_arrays;   // page table, COO index, decode plan, prefill work list
  CudaEvent arrays_uploaded;    // host_arrays may be rewritten once this completed
  std::array<LayerSlot, kLayerSlotsPerStep> slots;

  // Creates the events; once. blocking_sync: see CudaEvent::Create.
  absl::Status Init(bool blocking_sync);
  // Grows every buffer to hold a step with these layer sizes and `array_bytes` of arrays.
  // Only while no work of a previous owner is queued (the caller waited on arrays_uploaded,
  // and every layer of the previous step had completed before it ended).
  // `retired_device` / `retired_pinned` given: outgrown buffers are detached into them instead
  // of freed (a cudaFree or cudaFreeHost waits for the whole device, and a channel's stream may
  // be waiting on its client: an NCCL receive kernel would never let it return).
  absl::Status Reserve(const LayerSizes& sizes, int64_t array_bytes,
                       std::vector<uint8_t*>* retired_device = nullptr,
                       std::vector<uint8_t*>* retired_pinned = nullptr);
};

}  // namespace attnd::cuda_backend
