// Host and device buffers a CUDA step borrows from its cache for its lifetime: the staging of
// its uploaded arrays and kLayerSlotsPerStep layer slots (pinned staging for one layer's inputs
// and outputs, its device inputs, its events). A cache keeps the resources of ended steps and
// lends them to the next ones, growing them at PrepareStep when a step needs more; nothing is
// allocated per layer. Owned by one step at a time; slots are handed out under the step's lock.
#pragma once

#include <array>
#include <cstdint>

#include "absl/status/status.h"
#include "backend/backend.h"
#include "backend/cuda_memory.h"

namespace attnd::cuda_backend {

// Layers of one step that can be staged and in flight at once: while one layer's outputs are
// copied out, the next one's inputs are already on the device. More layers wait in the step.
inline constexpr int kLayerSlotsPerStep = 2;

// Byte sizes and offsets of one layer's tensors for a step of num_tokens rows.
struct LayerSizes {
  int64_t q_bytes = 0;   // [T][Hq][D] q_dtype
  int64_t k_bytes = 0;   // [T][Hkv][D]
  int64_t v_bytes = 0;   // [T][Hkv][D]
  int64_t k_offset = 0;  // inputs staged as q | k | v, each kBufferAlignment-aligned
  int64_t v_offset = 0;
  int64_t in_bytes = 0;
  int64_t o_bytes = 0;      // [T][Hq][D] q_dtype
  int64_t lse_bytes = 0;    // [T][Hq] float32 when the step returns lse, else 0
  int64_t lse_offset = 0;   // outputs as o | lse
  int64_t out_bytes = 0;

  static LayerSizes Of(const CacheGeometry& geometry, int64_t num_tokens, bool return_lse);
};

struct LayerSlot {
  PinnedBuffer host_in;     // q | k | v as the caller sent them
  PinnedBuffer host_out;    // o | lse as they go back
  DeviceBuffer device_in;   // host_in's layout
  CudaEvent inputs_copied;  // on the copy stream, after host_in -> device_in
  // Timing events on the compute stream: before the append, after it, after the first and
  // the second attention kernel (decode, then prefill, in a step that runs both).
  CudaEvent started;
  CudaEvent appended;
  CudaEvent attended_first;
  CudaEvent attended_second;
  CudaEvent finished;  // after device -> host_out: the layer's outputs are on the host
};

struct StepResources {
  PinnedBuffer host_arrays;     // the step's arrays, staged for their one upload
  DeviceBuffer device_arrays;   // page table, COO index, decode plan, prefill work list
  CudaEvent arrays_uploaded;    // host_arrays may be rewritten once this completed
  std::array<LayerSlot, kLayerSlotsPerStep> slots;

  // Creates the events; once.
  absl::Status Init();
  // Grows every buffer to hold a step with these layer sizes and `array_bytes` of arrays.
  // Only while no work of a previous owner is queued (the caller waited on arrays_uploaded,
  // and every layer of the previous step had completed before it ended).
  absl::Status Reserve(const LayerSizes& sizes, int64_t array_bytes);
};

}  // namespace attnd::cuda_backend
