#include "backend/cuda_step.h"

#include <cstring>
#include <utility>

#include <cuda_runtime_api.h>

#include "attnd/kernels/cuda/append.h"
#include "attnd/kernels/cuda/cuda_check.h"
#include "attnd/kernels/cuda/decode.h"
#include "attnd/kernels/cuda/mla_decode.h"
#include "attnd/kernels/cuda/pod.h"
#include "attnd/kernels/cuda/prefill.h"
#include "attnd/kernels/cuda/stream_flags.h"
#include "attnd/status_macros.h"

namespace attnd::cuda_backend {
namespace {

template <typename T>
const T* At(const DeviceBuffer& buffer, int64_t offset) {
  return reinterpret_cast<const T*>(buffer.data() + offset);
}

}  // namespace

CudaStep::CudaStep(CudaCache* cache, Lane& lane, std::shared_ptr<const StepBatch> batch,
                   std::shared_ptr<const plan::StepPlan> plan, std::unique_ptr<StepResources> resources,
                   int64_t prefill_work_offset)
    : cache_(cache),
      lane_(lane),
      batch_(std::move(batch)),
      plan_(std::move(plan)),
      resources_(std::move(resources)),
      sizes_(LayerSizes::Of(cache->geometry(), batch_->num_tokens, batch_->options.return_lse)) {
  const DeviceBuffer& arrays = resources_->device_arrays;
  const plan::StepArrayOffsets& offsets = plan_->offsets;
  qo_indptr_ = At<int32_t>(arrays, offsets.qo_indptr);
  pages_.batch_size = batch_->batch_size;
  pages_.page_size = cache->geometry().page_size;
  pages_.indptr = At<int32_t>(arrays, offsets.page_indptr);
  pages_.k_indices = At<int32_t>(arrays, offsets.k_page_indices);
  pages_.v_indices = At<int32_t>(arrays, offsets.v_page_indices);
  pages_.last_page_len = At<int32_t>(arrays, offsets.last_page_len);
  tokens_.num_tokens = batch_->num_tokens;
  tokens_.batch_indices = At<int32_t>(arrays, offsets.token_batch_indices);
  tokens_.positions = At<int32_t>(arrays, offsets.token_positions);
  if (plan_->run_decode) {
    decode_work_ = plan_->decode.View(At<int32_t>(arrays, offsets.decode_work));
  }
  if (plan_->run_decode && !plan_->run_prefill && !plan_->run_pod && !plan_->run_mla) {
    parts_ = plan::SplitDecodePlanByRows(plan_->decode, batch_->num_tokens,
                                         cache->host_shm_parts());
  }
  if (plan_->run_mla) {
    mla_work_ = plan_->mla.View(At<int32_t>(arrays, offsets.mla_work));
  }
  if (plan_->run_prefill) {
    prefill_work_ = arrays.data() + prefill_work_offset;
    prefill_work_bytes_ = cuda::BatchPrefillWorkspaceBytes(plan_->prefill);
  }
  if (plan_->run_pod) {
    prefill_work_ = arrays.data() + prefill_work_offset;
    prefill_work_bytes_ = cuda::PodWorkspaceBytes(plan_->pod);
  }
  side_by_side_ = plan_->run_decode && plan_->run_prefill && plan_->side_by_side_prefill_ctas > 0 &&
                  lane_.side.get() != nullptr;
  for (LayerSlot& slot : resources_->slots) free_slots_.push_back(&slot);
  ++lane_.open_steps;
}

CudaStep::~CudaStep() {
  --lane_.open_steps;
  cache_->ReturnResources(std::move(resources_));
}

void CudaStep::RunLayer(const LayerIo& io, DoneCallback done) {
  // The caller's thread (gRPC, a channel's pump) may have another device current; a failure
  // here shows up as the launch's own error below.
  cudaSetDevice(cache_->device());
  if (batch_->num_tokens == 0) {
    // Nothing to compute, but `done` still comes from a backend thread, never the caller's.
    lane_.completions->Post([done = std::move(done)] { done(absl::OkStatus()); });
    return;
  }
  LayerSlot* slot = nullptr;
  {
    std::lock_guard lock(mu_);
    if (free_slots_.empty()) {
      pending_.push_back({io, std::move(done)});
      return;
    }
    slot = free_slots_.back();
    free_slots_.pop_back();
  }
  Submit(slot, io, std::move(done));
}

void CudaStep::Submit(LayerSlot* slot, const LayerIo& io, DoneCallback done) {
  slot->io = io;
  slot->done = std::move(done);
  slot->status = absl::OkStatus();
  // The slot is ours: its previous layer finished, so its pinned input is free to overwrite.
  // The caller's bytes (the received message's slices) go straight into pinned staging.
  // Registered host memory (a HOST_SHM channel's ring) is copied from directly.
  if (!io.host_registered) {
    uint8_t* staged = slot->host_in.data();
    LayerIo::Input(io.q, io.q_bytes).CopyTo(staged, sizes_.q_bytes);
    if (cache_->geometry().mla) {
      LayerIo::Input(io.ckv, io.ckv_bytes).CopyTo(staged + sizes_.k_offset, sizes_.k_bytes);
      LayerIo::Input(io.kpe, io.kpe_bytes).CopyTo(staged + sizes_.v_offset, sizes_.v_bytes);
      LayerIo::Input(io.q_pe, io.q_pe_bytes)
          .CopyTo(staged + sizes_.q_pe_offset, sizes_.q_pe_bytes);
    } else {
      LayerIo::Input(io.k, io.k_bytes).CopyTo(staged + sizes_.k_offset, sizes_.k_bytes);
      LayerIo::Input(io.v, io.v_bytes).CopyTo(staged + sizes_.v_offset, sizes_.v_bytes);
    }
  }
  MarkStage(io.trace, LayerTrace::kStaged);

  absl::StatusOr<OutputPool::Buffer*> output =
      io.host_registered ? absl::StatusOr<OutputPool::Buffer*>(nullptr)
                         : cache_->outputs().Take(sizes_.out_bytes);
  slot->output = output.ok() ? *output : nullptr;
  {
    std::lock_guard lock(lane_.submit_mu);
    absl::Status status = output.status();
    if (status.ok() && RunsInParts(io)) {
      status = EnqueueInParts(*slot, io);
    } else if (status.ok()) {
      status = EnqueueLocked(*slot, io, io.host_registered ? nullptr : (*output)->memory.data());
    }
    // Recorded even after a failed launch: the slot is reused only once the work that was
    // enqueued before the failure has passed this point. A registered layer ran wholly on the
    // compute stream (EnqueueLocked), unless it ran in parts; others end with the output copy
    // on d2h, which a layer in parts also ends with, after its kernels (EnqueueInParts).
    const bool on_compute = io.host_registered && !RunsInParts(io);
    const cudaError_t recorded = cudaEventRecord(
        slot->finished.get(), on_compute ? lane_.compute.get() : lane_.d2h.get());
    if (status.ok() && recorded != cudaSuccess) {
      status = cuda::CudaErrorToStatus(recorded, "cudaEventRecord(finished)", __FILE__, __LINE__);
    }
    slot->status = status;
    MarkStage(io.trace, LayerTrace::kEnqueued);
    // Posted under the lane's lock, so completions are queued in enqueue order.
    lane_.completions->Post([this, slot] { Complete(slot); });
  }
}

absl::Status CudaStep::EnqueueLocked(LayerSlot& slot, const LayerIo& io, uint8_t* host_out) {
  const int32_t layer = io.layer;
  const cudaStream_t h2d = lane_.h2d.get();
  const cudaStream_t compute = lane_.compute.get();
  const cudaStream_t d2h = lane_.d2h.get();

  // A HOST_SHM channel layer (registered ring): its client waits for o before it writes the
  // next layer, so nothing overlaps across layers and the whole layer runs on the compute
  // stream (copies from the ring, kernels, copies back, then the done word written by the
  // device): no stream hop and no host on the path. (Kernels writing o straight into the
  // mapped ring were tried: the decode kernel's stores over PCIe took 141 us against 31.)
  if (io.host_registered) {
    // Straight from the registered ring, one copy per tensor (MLA: q_nope | ckv | kpe | q_pe).
    uint8_t* device_in = slot.device_in.data();
    const bool mla = cache_->geometry().mla;
    const void* second = mla ? io.ckv : io.k;
    const void* third = mla ? io.kpe : io.v;
    CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(device_in, io.q, sizes_.q_bytes, cudaMemcpyHostToDevice, compute));
    CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(device_in + sizes_.k_offset, second, sizes_.k_bytes,
                                         cudaMemcpyHostToDevice, compute));
    CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(device_in + sizes_.v_offset, third, sizes_.v_bytes,
                                         cudaMemcpyHostToDevice, compute));
    if (mla) {
      CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(device_in + sizes_.q_pe_offset, io.q_pe,
                                           sizes_.q_pe_bytes, cudaMemcpyHostToDevice, compute));
    }
  } else {
    CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(slot.device_in.data(), slot.host_in.data(),
                                         sizes_.in_bytes, cudaMemcpyHostToDevice, h2d));
    CUDA_RETURN_IF_ERROR(cudaEventRecord(slot.inputs_copied.get(), h2d));
    CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(compute, slot.inputs_copied.get(), 0));
  }
  CUDA_RETURN_IF_ERROR(cudaEventRecord(slot.started.get(), compute));
  LayerBuffers buffers;
  uint8_t* device_in = slot.device_in.data();
  uint8_t* device_out = slot.device_out.data();
  buffers.q = device_in;
  buffers.k = device_in + sizes_.k_offset;
  buffers.v = device_in + sizes_.v_offset;
  buffers.q_pe = device_in + sizes_.q_pe_offset;
  buffers.o = device_out;
  buffers.lse = batch_->options.return_lse
                    ? reinterpret_cast<float*>(device_out + sizes_.lse_offset)
                    : nullptr;
  const CudaEvent* attended = nullptr;
  RETURN_IF_ERROR(EnqueueKernels(slot, /*timed=*/true, buffers, layer, &attended));
  if (io.host_registered) {
    CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(io.o, device_out, sizes_.o_bytes,
                                         cudaMemcpyDeviceToHost, compute));
    if (io.lse != nullptr && sizes_.lse_bytes > 0) {
      CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(io.lse, device_out + sizes_.lse_offset,
                                           sizes_.lse_bytes, cudaMemcpyDeviceToHost, compute));
    }
    if (io.done_word != nullptr && cache_->host_pointers_on_device()) {
      // Best effort: without it the layer still completes through the host.
      cuda::StreamWriteFlag(compute, io.done_word, io.done_value).IgnoreError();
    }
    return absl::OkStatus();
  }
  // The output copy runs on the D2H stream, so the next layer's kernels need not wait for it.
  CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(d2h, attended->get(), 0));
  CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(host_out, slot.device_out.data(), sizes_.out_bytes,
                                       cudaMemcpyDeviceToHost, d2h));
  return absl::OkStatus();
}

namespace {

// Records events->*which on `stream`, or nothing for an untimed layer (events null).
absl::Status RecordIfTimed(LayerEvents* events, CudaEvent LayerEvents::*which,
                           cudaStream_t stream) {
  if (events == nullptr) return absl::OkStatus();
  CUDA_RETURN_IF_ERROR(cudaEventRecord((events->*which).get(), stream));
  return absl::OkStatus();
}

}  // namespace

absl::Status CudaStep::EnqueueKernels(LayerEvents& slot, bool timed, const LayerBuffers& buffers,
                                      int32_t layer, const CudaEvent** attended_event,
                                      bool* done_signalled) {
  if (done_signalled != nullptr) *done_signalled = false;
  // Copy-on-write (ForkSequence): shared partial pages into their fresh copies, on the compute
  // stream ahead of the append that writes the copies. Timed as part of the append.
  if (!batch_->page_copies.empty()) {
    RETURN_IF_ERROR(cache_->EnqueuePageCopies(layer, batch_->page_copies, lane_.compute.get()));
  }
  return cache_->geometry().mla
             ? EnqueueMlaKernels(timed ? &slot : nullptr, buffers, layer, attended_event)
             : EnqueueMhaKernels(slot, timed, buffers, layer, attended_event, done_signalled);
}

absl::Status CudaStep::EnqueueMhaKernels(LayerEvents& slot, bool timed, const LayerBuffers& buffers,
                                         int32_t layer, const CudaEvent** attended_event,
                                         bool* done_signalled) {
  LayerEvents* const events = timed ? &slot : nullptr;
  const CacheGeometry& g = cache_->geometry();
  const cudaStream_t compute = lane_.compute.get();
  const int64_t tokens = batch_->num_tokens;

  const cuda::AppendKvArgs append = MhaAppendArgs(buffers, layer, 0, tokens);
  RETURN_IF_ERROR(cuda::AppendKv(append, compute));
  RETURN_IF_ERROR(RecordIfTimed(events, &LayerEvents::appended, compute));

  const TokenHeadsView q = append.q_out;
  const TokenHeadsView o = RowsOf(buffers.o, g.q_dtype, tokens, g.num_qo_heads, g.v_head_dim);
  float* lse = buffers.lse;
  const cuda::BatchDecodeArgs decode = MhaDecodeArgs(q, o, lse, layer, decode_work_);
  cuda::BatchPrefillArgs prefill;
  prefill.q = q;
  prefill.qo_indptr = qo_indptr_;
  prefill.pages = pages_;
  prefill.k_cache = append.k_cache;
  prefill.v_cache = append.v_cache;
  prefill.params = batch_->options.params;
  prefill.o = o;
  prefill.lse = lse;

  if (side_by_side_) {
    // The prefill's launches first, on the side stream at the greatest priority, so that its
    // persistent CTAs take their SMs before the decode's CTAs fill the rest; they take works on
    // demand, and once the decode is done a second grid on the compute stream (the rest of the
    // wave: StepPlan::side_by_side_tail_ctas) takes what is left of them, so the decode's SMs join
    // the prefill. The merge of split works follows both. Decode and prefill write disjoint rows
    // of o and lse and read the same rotated q. Joined whatever happens, so the layer's events
    // cover both streams. (Where one grid failed to launch, the works counter is left non-zero:
    // the error fails the step, so no later layer runs on it, and the next step's plan upload
    // zeroes it.)
    const cudaStream_t side = lane_.side.get();
    prefill.max_persistent_ctas = plan_->side_by_side_prefill_ctas;
    prefill.works_on_demand = plan_->side_by_side_tail_ctas > 0;
    prefill.tail_ctas = plan_->side_by_side_tail_ctas;
    bool forked = false;
    absl::Status status = [&]() -> absl::Status {
      CUDA_RETURN_IF_ERROR(cudaEventRecord(slot.fork.get(), compute));
      CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(side, slot.fork.get(), 0));
      forked = true;
      RETURN_IF_ERROR(
          cuda::BatchPrefill(plan_->prefill, prefill, prefill_work_, prefill_work_bytes_, side));
      RETURN_IF_ERROR(cuda::BatchDecode(decode, compute));
      RETURN_IF_ERROR(RecordIfTimed(events, &LayerEvents::attended_first, compute));
      return cuda::BatchPrefillTail(plan_->prefill, prefill, prefill_work_, prefill_work_bytes_,
                                    compute);
    }();
    if (forked) {
      const cudaError_t joined = [&] {
        const cudaError_t recorded = cudaEventRecord(slot.join.get(), side);
        return recorded != cudaSuccess ? recorded
                                       : cudaStreamWaitEvent(compute, slot.join.get(), 0);
      }();
      if (status.ok() && joined != cudaSuccess) {
        status = cuda::CudaErrorToStatus(joined, "joining the side stream", __FILE__, __LINE__);
      }
    }
    RETURN_IF_ERROR(status);
    RETURN_IF_ERROR(cuda::MergeBatchPrefill(plan_->prefill, prefill, prefill_work_,
                                            prefill_work_bytes_, compute));
    // The prefill's end: both of its grids and the merge.
    RETURN_IF_ERROR(RecordIfTimed(events, &LayerEvents::attended_second, compute));
    CUDA_RETURN_IF_ERROR(cudaEventRecord(slot.attended.get(), compute));
    *attended_event = &slot.attended;
    return absl::OkStatus();
  }

  const CudaEvent* attended = events != nullptr ? &events->appended : nullptr;
  if (plan_->run_decode) {
    // A decode-only layer's last grid is the decode's: it may set the caller's done word.
    const bool signals = buffers.done.active() && done_signalled != nullptr &&
                         !plan_->run_prefill && !plan_->run_pod;
    cuda::BatchDecodeArgs last = decode;
    if (signals) last.done = buffers.done;
    RETURN_IF_ERROR(cuda::BatchDecode(last, compute));
    if (signals) *done_signalled = true;
    RETURN_IF_ERROR(RecordIfTimed(events, &LayerEvents::attended_first, compute));
    if (events != nullptr) attended = &events->attended_first;
  }
  if (plan_->run_prefill || plan_->run_pod) {
    if (plan_->run_pod) {
      // The step's decode and prefill rows in one fused launch (its merge included).
      RETURN_IF_ERROR(
          cuda::PodAttention(plan_->pod, prefill, prefill_work_, prefill_work_bytes_, compute));
    } else {
      RETURN_IF_ERROR(cuda::BatchPrefill(plan_->prefill, prefill, prefill_work_,
                                         prefill_work_bytes_, compute));
    }
    CudaEvent LayerEvents::*const last =
        plan_->run_decode ? &LayerEvents::attended_second : &LayerEvents::attended_first;
    RETURN_IF_ERROR(RecordIfTimed(events, last, compute));
    if (events != nullptr) attended = &(events->*last);
  }
  *attended_event = attended;
  return absl::OkStatus();
}

cuda::BatchDecodeArgs CudaStep::MhaDecodeArgs(const TokenHeadsView& q, const TokenHeadsView& o,
                                              float* lse, int32_t layer,
                                              const plan::DecodeWorkView& work) const {
  cuda::BatchDecodeArgs decode;
  decode.q = q;
  decode.pages = pages_;
  decode.k_cache = cache_->Pool(layer, false);
  decode.v_cache = cache_->Pool(layer, true);
  decode.params = batch_->options.params;
  decode.work = work;
  decode.o = o;
  decode.lse = lse;
  decode.workspace = lane_.decode_workspace.data();
  decode.workspace_bytes = lane_.decode_workspace.capacity();
  return decode;
}

cuda::AppendKvArgs CudaStep::MhaAppendArgs(const LayerBuffers& buffers, int32_t layer,
                                           int64_t row_begin, int64_t row_end) const {
  const CacheGeometry& g = cache_->geometry();
  const int64_t rows = row_end - row_begin;
  // Row r of a [tokens][heads][dim] tensor of `dtype` starts r * heads * dim elements in.
  auto rows_from = [&](const void* data, int32_t heads, int32_t dim) {
    const int64_t skip = row_begin * heads * dim * int64_t{DTypeBytes(g.q_dtype)};
    return RowsOf(static_cast<const uint8_t*>(data) + skip, g.q_dtype, rows, heads, dim);
  };
  cuda::AppendKvArgs append;
  append.tokens.num_tokens = rows;
  append.tokens.batch_indices = tokens_.batch_indices + row_begin;
  append.tokens.positions = tokens_.positions + row_begin;
  append.pages = pages_;
  append.rope_style = g.rope.style;
  append.rope_inv_freq = cache_->rope_inv_freq();
  append.rotary_dim = g.rope.style == RopeStyle::kNone ? 0 : g.rope.rotary_dim;
  append.q_in = rows_from(buffers.q, g.num_qo_heads, g.k_head_dim);
  append.q_out = rows_from(lane_.q_rotated.data(), g.num_qo_heads, g.k_head_dim);
  append.k_in = rows_from(buffers.k, g.num_kv_heads, g.k_head_dim);
  append.v_in = rows_from(buffers.v, g.num_kv_heads, g.v_head_dim);
  append.k_cache = cache_->Pool(layer, false);
  append.v_cache = cache_->Pool(layer, true);
  append.k_scale = g.k_scale;
  append.v_scale = g.v_scale;
  return append;
}

// A HOST_SHM decode layer in parts of its rows (--host_shm_parts; the step's parts_): part p's
// rows of q, k and v cross the bus on the H2D stream while part p - 1 computes, and part p's o
// (and lse) cross back on the D2H stream while part p + 1 computes; the client's done word
// follows the last part's outputs. Each part runs the append over its rows and the decode plan's
// slice for them (SplitDecodePlanByRows): every item and merge of the whole plan once, with the
// whole plan's partial slots, so the outputs are bitwise those of one launch.
absl::Status CudaStep::EnqueueInParts(LayerSlot& slot, const LayerIo& io) {
  absl::Status status = EnqueuePartsLocked(slot, io);
  // The layer ends on the D2H stream (Submit records `finished` there). After a failure midway,
  // copies or kernels already enqueued on the other two streams may not be behind it yet: join
  // them, so the slot and the lane's buffers are reused only once they are done.
  const cudaStream_t d2h = lane_.d2h.get();
  for (auto [event, stream] : {std::pair{&slot.inputs_copied, lane_.h2d.get()},
                               std::pair{&slot.attended_second, lane_.compute.get()}}) {
    const cudaError_t joined = [&] {
      const cudaError_t recorded = cudaEventRecord(event->get(), stream);
      return recorded != cudaSuccess ? recorded : cudaStreamWaitEvent(d2h, event->get(), 0);
    }();
    if (status.ok() && joined != cudaSuccess) {
      status = cuda::CudaErrorToStatus(joined, "joining the parts' streams", __FILE__, __LINE__);
    }
  }
  return status;
}

absl::Status CudaStep::EnqueuePartsLocked(LayerSlot& slot, const LayerIo& io) {
  const CacheGeometry& g = cache_->geometry();
  const int32_t layer = io.layer;
  const cudaStream_t h2d = lane_.h2d.get();
  const cudaStream_t compute = lane_.compute.get();
  const cudaStream_t d2h = lane_.d2h.get();
  while (slot.parts.size() < parts_.size()) {
    auto events = std::make_unique<PartEvents>();
    RETURN_IF_ERROR(events->Create());
    slot.parts.push_back(std::move(events));
  }
  // Copy-on-write pages (ForkSequence) before any part's append writes into the copies.
  if (!batch_->page_copies.empty()) {
    RETURN_IF_ERROR(cache_->EnqueuePageCopies(layer, batch_->page_copies, compute));
  }
  const int64_t tokens = batch_->num_tokens;
  const int64_t q_row = sizes_.q_bytes / tokens;
  const int64_t k_row = sizes_.k_bytes / tokens;
  const int64_t v_row = sizes_.v_bytes / tokens;
  const int64_t o_row = sizes_.o_bytes / tokens;
  const int64_t lse_row = sizes_.lse_bytes / tokens;
  uint8_t* device_in = slot.device_in.data();
  uint8_t* device_out = slot.device_out.data();
  LayerBuffers buffers;
  buffers.q = device_in;
  buffers.k = device_in + sizes_.k_offset;
  buffers.v = device_in + sizes_.v_offset;
  buffers.o = device_out;
  buffers.lse = batch_->options.return_lse
                    ? reinterpret_cast<float*>(device_out + sizes_.lse_offset)
                    : nullptr;
  const TokenHeadsView q =
      RowsOf(lane_.q_rotated.data(), g.q_dtype, tokens, g.num_qo_heads, g.k_head_dim);
  const TokenHeadsView o = RowsOf(buffers.o, g.q_dtype, tokens, g.num_qo_heads, g.v_head_dim);
  auto copy = [](void* to, const void* from, int64_t bytes, cudaMemcpyKind kind,
                 cudaStream_t stream) -> absl::Status {
    if (bytes > 0) CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(to, from, bytes, kind, stream));
    return absl::OkStatus();
  };
  for (size_t p = 0; p < parts_.size(); ++p) {
    const plan::DecodePlanPart& part = parts_[p];
    PartEvents& events = *slot.parts[p];
    const int64_t first = part.row_begin;
    const int64_t rows = part.row_end - part.row_begin;
    auto from_ring = [&](const void* ring) { return static_cast<const uint8_t*>(ring); };
    RETURN_IF_ERROR(copy(device_in + first * q_row, from_ring(io.q) + first * q_row,
                         rows * q_row, cudaMemcpyHostToDevice, h2d));
    RETURN_IF_ERROR(copy(device_in + sizes_.k_offset + first * k_row,
                         from_ring(io.k) + first * k_row, rows * k_row, cudaMemcpyHostToDevice,
                         h2d));
    RETURN_IF_ERROR(copy(device_in + sizes_.v_offset + first * v_row,
                         from_ring(io.v) + first * v_row, rows * v_row, cudaMemcpyHostToDevice,
                         h2d));
    CUDA_RETURN_IF_ERROR(cudaEventRecord(events.copied.get(), h2d));

    CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(compute, events.copied.get(), 0));
    CUDA_RETURN_IF_ERROR(cudaEventRecord(events.started.get(), compute));
    RETURN_IF_ERROR(cuda::AppendKv(MhaAppendArgs(buffers, layer, first, part.row_end), compute));
    CUDA_RETURN_IF_ERROR(cudaEventRecord(events.appended.get(), compute));
    RETURN_IF_ERROR(cuda::BatchDecode(
        MhaDecodeArgs(q, o, buffers.lse, layer,
                      plan::SliceDecodeWork(decode_work_, part.item_begin, part.item_end,
                                            part.merge_begin, part.merge_end)),
        compute));
    CUDA_RETURN_IF_ERROR(cudaEventRecord(events.attended.get(), compute));

    CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(d2h, events.attended.get(), 0));
    RETURN_IF_ERROR(copy(static_cast<uint8_t*>(io.o) + first * o_row, device_out + first * o_row,
                         rows * o_row, cudaMemcpyDeviceToHost, d2h));
    if (io.lse != nullptr) {
      RETURN_IF_ERROR(copy(reinterpret_cast<uint8_t*>(io.lse) + first * lse_row,
                           device_out + sizes_.lse_offset + first * lse_row, rows * lse_row,
                           cudaMemcpyDeviceToHost, d2h));
    }
  }
  // Behind the last part's outputs (and, through EnqueueInParts' join, nothing else is left).
  if (io.done_word != nullptr && cache_->host_pointers_on_device()) {
    // Best effort: without it the layer still completes through the host.
    cuda::StreamWriteFlag(d2h, io.done_word, io.done_value).IgnoreError();
  }
  return absl::OkStatus();
}

// MLA: ckv (K pool) and kpe (V pool, rotated) appended and q_pe rotated in one launch, then the
// MLA decode kernel over every row of the step, with its merge when the plan splits.
absl::Status CudaStep::EnqueueMlaKernels(LayerEvents* events, const LayerBuffers& buffers,
                                         int32_t layer, const CudaEvent** attended_event) {
  const CacheGeometry& g = cache_->geometry();
  const cudaStream_t compute = lane_.compute.get();
  const int64_t tokens = batch_->num_tokens;
  const int32_t rank = g.k_head_dim;
  const int32_t rope_dim = g.v_head_dim;

  cuda::AppendMlaArgs append;
  append.tokens = tokens_;
  append.pages = pages_;
  append.rope_style = g.rope.style;
  append.rope_inv_freq = cache_->rope_inv_freq();
  append.rotary_dim = g.rope.style == RopeStyle::kNone ? 0 : g.rope.rotary_dim;
  append.q_pe_in = RowsOf(buffers.q_pe, g.q_dtype, tokens, g.num_qo_heads, rope_dim);
  append.q_pe_out = RowsOf(lane_.q_rotated.data(), g.q_dtype, tokens, g.num_qo_heads, rope_dim);
  append.ckv_in = RowsOf(buffers.k, g.q_dtype, tokens, 1, rank);
  append.kpe_in = RowsOf(buffers.v, g.q_dtype, tokens, 1, rope_dim);
  append.ckv_cache = cache_->Pool(layer, false);
  append.kpe_cache = cache_->Pool(layer, true);
  append.ckv_scale = g.k_scale;
  append.kpe_scale = g.v_scale;
  RETURN_IF_ERROR(cuda::AppendMla(append, compute));
  RETURN_IF_ERROR(RecordIfTimed(events, &LayerEvents::appended, compute));
  *attended_event = events != nullptr ? &events->appended : nullptr;
  if (!plan_->run_mla) return absl::OkStatus();

  cuda::MlaDecodeArgs attention;
  attention.q_nope = RowsOf(buffers.q, g.q_dtype, tokens, g.num_qo_heads, rank);
  attention.q_pe = append.q_pe_out;
  attention.pages = pages_;
  attention.ckv_cache = append.ckv_cache;
  attention.kpe_cache = append.kpe_cache;
  attention.params = batch_->options.params;  // k_scale dequantises ckv, v_scale kpe
  attention.work = mla_work_;
  attention.o = RowsOf(buffers.o, g.q_dtype, tokens, g.num_qo_heads, rank);
  attention.lse = buffers.lse;
  attention.workspace = lane_.decode_workspace.data();
  attention.workspace_bytes = lane_.decode_workspace.capacity();
  RETURN_IF_ERROR(cuda::MlaDecode(attention, compute));
  RETURN_IF_ERROR(RecordIfTimed(events, &LayerEvents::attended_first, compute));
  *attended_event = events != nullptr ? &events->attended_first : nullptr;
  return absl::OkStatus();
}

void CudaStep::Complete(LayerSlot* slot) {
  absl::Status status = std::move(slot->status);
  const LayerIo& io = slot->io;
  const cudaError_t waited = cudaEventSynchronize(slot->finished.get());
  if (status.ok() && waited != cudaSuccess) {
    status = cuda::CudaErrorToStatus(waited, "cudaEventSynchronize(layer finished)", __FILE__,
                                     __LINE__);
  }
  MarkStage(io.trace, LayerTrace::kDeviceDone);
  auto* output = static_cast<OutputPool::Buffer*>(slot->output);
  slot->output = nullptr;
  if (status.ok() && RunsInParts(io)) {
    ReportPartTimes(*slot);
  } else if (status.ok() && io.host_registered) {
    ReportTimes(*slot, /*copied=*/true);  // the outputs were copied straight into the caller's registered memory
  } else if (status.ok()) {
    const uint8_t* host_out = output->memory.data();
    if (io.o == nullptr && io.lease != nullptr) {
      io.lease->o = host_out;
      io.lease->lse = batch_->options.return_lse
                          ? reinterpret_cast<const float*>(host_out + sizes_.lse_offset)
                          : nullptr;
      io.lease->release = &OutputPool::ReleaseLease;
      io.lease->release_arg = output;
      output = nullptr;
    } else {
      std::memcpy(io.o, host_out, sizes_.o_bytes);
      if (io.lse != nullptr && sizes_.lse_bytes > 0) {
        std::memcpy(io.lse, host_out + sizes_.lse_offset, sizes_.lse_bytes);
      }
    }
    ReportTimes(*slot, /*copied=*/true);
  }
  if (output != nullptr) OutputPool::Return(output);
  MarkStage(io.trace, LayerTrace::kCopiedOut);
  DoneCallback done = std::move(slot->done);
  slot->done = nullptr;
  std::unique_lock lock(mu_);
  if (pending_.empty()) {
    free_slots_.push_back(slot);
    lock.unlock();
    done(status);  // may destroy the step
    return;
  }
  PendingLayer next = std::move(pending_.front());
  pending_.pop_front();
  lock.unlock();
  // The waiting layer counts as in flight for the engine, so `done` cannot end the step here;
  // answering first keeps this layer's latency free of the next one's staging.
  done(status);
  Submit(slot, next.io, std::move(next.done));
}

void CudaStep::ReportTimes(const LayerEvents& slot, bool copied) const {
  if (cache_->observer() == nullptr) return;
  KernelSeconds seconds;
  seconds.append = ElapsedSeconds(slot.started, slot.appended);
  seconds.first = ElapsedSeconds(slot.appended, slot.attended_first);
  if (plan_->run_decode && plan_->run_prefill) {
    // Side by side, the prefill started with the decode, after the append.
    seconds.second = ElapsedSeconds(side_by_side_ ? slot.appended : slot.attended_first,
                                    slot.attended_second);
  }
  Report(seconds, copied);
}

// A layer in parts: each kernel's time is the sum over the parts' launches (the waits for the
// parts' copies between them are not kernel time).
void CudaStep::ReportPartTimes(const LayerSlot& slot) const {
  if (cache_->observer() == nullptr) return;
  KernelSeconds seconds;
  for (size_t p = 0; p < parts_.size(); ++p) {
    const PartEvents& events = *slot.parts[p];
    seconds.append += ElapsedSeconds(events.started, events.appended);
    seconds.first += ElapsedSeconds(events.appended, events.attended);
  }
  Report(seconds, /*copied=*/true);
}

void CudaStep::Report(const KernelSeconds& seconds, bool copied) const {
  BackendObserver* observer = cache_->observer();
  const std::string_view phase = StepPhaseName(batch_->phase);
  const int32_t device = cache_->device();
  observer->OnKernel("append", "append", seconds.append, device);
  if (plan_->run_mla) {
    // "mla_decode" or "mla_prefill", the merge of split requests included.
    observer->OnKernel(plan_->KernelName(), phase, seconds.first, device);
  }
  if (plan_->run_decode) observer->OnKernel("decode", phase, seconds.first, device);
  if (plan_->run_pod) observer->OnKernel("pod", phase, seconds.first, device);
  if (plan_->run_prefill) {
    observer->OnKernel("prefill", phase, plan_->run_decode ? seconds.second : seconds.first,
                       device);
  }
  if (!copied) return;  // a CUDA_IPC channel layer: nothing crossed the bus
  observer->OnTransfer("h2d", sizes_.q_bytes + sizes_.k_bytes + sizes_.v_bytes + sizes_.q_pe_bytes,
                       device);
  observer->OnTransfer("d2h", sizes_.o_bytes + sizes_.lse_bytes, device);
}

}  // namespace attnd::cuda_backend
