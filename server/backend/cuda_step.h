// CudaStep: one planned step of a CudaCache, running on one of the cache's lanes. Its arrays
// (page table, COO append index, decode plan, prefill work list, MLA plan) were uploaded once at
// PrepareStep; each RunLayer stages the layer's q/k/v (MLA: q_nope/ckv/kpe/q_pe) in a free layer slot (copied straight from
// the caller's bytes, e.g. the received message's slices, into pinned memory), enqueues
// H2D -> append -> attention -> D2H on the lane's streams with events between the kernels, and
// posts the slot to the lane's completion thread (see cuda_cache.h). With every slot busy a
// layer waits in the step, and the completion thread enqueues it when a slot frees. The step's
// resources go back to the cache on destruction, which the engine does only once no layer of
// the step is in flight.
#pragma once

#include <deque>
#include <memory>
#include <mutex>
#include <vector>

#include "attnd/kernels/cuda/append.h"
#include "attnd/kernels/cuda/decode.h"
#include "backend/backend.h"
#include "backend/cuda_cache.h"
#include "backend/cuda_step_resources.h"
#include "plan/step_plan.h"

namespace attnd::cuda_backend {

class CudaStep final : public BackendStep {
 public:
  // `plan` was built for `batch`, whose arrays are in resources->device_arrays at
  // plan->offsets, with the prefill work list at `prefill_work_offset`.
  CudaStep(CudaCache* cache, Lane& lane, std::shared_ptr<const StepBatch> batch,
           std::shared_ptr<const plan::StepPlan> plan, std::unique_ptr<StepResources> resources,
           int64_t prefill_work_offset);
  ~CudaStep() override;

  std::string_view KernelName() const override { return plan_->KernelName(); }
  void RunLayer(const LayerIo& io, DoneCallback done) override;

  // For CUDA_IPC channels (cuda_ipc_channel.h): the append and attention kernels of a layer
  // on the step's lane's compute stream, reading and writing `buffers`. `timed`: the kernels'
  // events are recorded (the `started` event is the caller's to record) and `attended` is the
  // one after the last of them; else no event is recorded and `attended` is null. Call with
  // the lane's submit_mu held. ReportChannelLayer reports a timed layer's kernel times once
  // `events` completed. With buffers.done, `*done_signalled` says whether the layer's last
  // kernel sets that word itself (a decode-only MHA layer; else the caller writes it).
  absl::Status EnqueueKernels(LayerEvents& events, bool timed, const LayerBuffers& buffers,
                              int32_t layer, const CudaEvent** attended,
                              bool* done_signalled = nullptr);
  void ReportChannelLayer(const LayerEvents& events) const { ReportTimes(events, false); }
  int64_t num_tokens() const { return batch_->num_tokens; }
  bool returns_lse() const { return batch_->options.return_lse; }
  Lane& lane() { return lane_; }

 private:
  struct PendingLayer {
    LayerIo io;
    DoneCallback done;
  };

  // Stages and enqueues a layer in `slot`, which the caller took.
  void Submit(LayerSlot* slot, const LayerIo& io, DoneCallback done);
  // host_out: the output buffer to copy o | lse into; null for registered io (o, lse direct).
  absl::Status EnqueueLocked(LayerSlot& slot, const LayerIo& io, uint8_t* host_out);
  // `events` null: an untimed channel layer (no event recorded, *attended null).
  absl::Status EnqueueMhaKernels(LayerEvents& slot, bool timed, const LayerBuffers& buffers,
                                 int32_t layer, const CudaEvent** attended, bool* done_signalled);
  // A HOST_SHM decode layer in parts of its rows (parts_), copies overlapping the kernels.
  absl::Status EnqueueInParts(LayerSlot& slot, const LayerIo& io);
  absl::Status EnqueuePartsLocked(LayerSlot& slot, const LayerIo& io);
  bool RunsInParts(const LayerIo& io) const { return io.host_registered && parts_.size() > 1; }
  // The MHA append of rows [row_begin, row_end) of the layer's buffers.
  cuda::AppendKvArgs MhaAppendArgs(const LayerBuffers& buffers, int32_t layer, int64_t row_begin,
                                   int64_t row_end) const;
  // The MHA decode of `work` (the step's plan or a slice of it) over the rotated q rows.
  cuda::BatchDecodeArgs MhaDecodeArgs(const TokenHeadsView& q, const TokenHeadsView& o, float* lse,
                                      int32_t layer, const plan::DecodeWorkView& work) const;
  absl::Status EnqueueMlaKernels(LayerEvents* events, const LayerBuffers& buffers,
                                 int32_t layer, const CudaEvent** attended);
  // On the completion thread: waits, lends or copies out, reports, frees the slot, calls done.
  void Complete(LayerSlot* slot);
  void ReportTimes(const LayerEvents& events, bool copied) const;
  void ReportPartTimes(const LayerSlot& slot) const;
  // Kernel seconds of one layer: the append, the first attention launch (decode, POD, MLA, or
  // prefill alone) and the prefill after a decode.
  struct KernelSeconds {
    double append = 0;
    double first = 0;
    double second = 0;
  };
  void Report(const KernelSeconds& seconds, bool copied) const;

  CudaCache* const cache_;
  Lane& lane_;
  const std::shared_ptr<const StepBatch> batch_;
  const std::shared_ptr<const plan::StepPlan> plan_;
  std::unique_ptr<StepResources> resources_;
  const LayerSizes sizes_;

  // Device views of the uploaded arrays.
  const int32_t* qo_indptr_ = nullptr;
  PageTableView pages_;
  AppendIndexView tokens_;
  plan::DecodeWorkView decode_work_;
  // A decode-only MHA step's rows in parts (--host_shm_parts), for HOST_SHM layers; one part
  // (no split) otherwise.
  std::vector<plan::DecodePlanPart> parts_;
  // A mixed step side by side (StepPlan::side_by_side_prefill_ctas, where the lane has its side
  // stream).
  bool side_by_side_ = false;
  plan::MlaWorkView mla_work_;
  void* prefill_work_ = nullptr;
  int64_t prefill_work_bytes_ = 0;

  std::mutex mu_;
  std::vector<LayerSlot*> free_slots_;
  std::deque<PendingLayer> pending_;
};

}  // namespace attnd::cuda_backend
