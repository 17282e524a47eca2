#include "backend/cuda_step.h"

#include <cstring>
#include <utility>

#include "attnd/kernels/cuda/append.h"
#include "attnd/kernels/cuda/decode.h"
#include "attnd/kernels/cuda/prefill.h"
#include "attnd/status_macros.h"
#include "cuda/cuda_check.h"

namespace attnd::cuda_backend {
namespace {

TokenHeadsView Rows(const void* data, DType dtype, int64_t tokens, int32_t heads, int32_t dim) {
  TokenHeadsView view;
  view.data = const_cast<void*>(data);
  view.dtype = dtype;
  view.num_tokens = tokens;
  view.num_heads = heads;
  view.head_dim = dim;
  return view;
}

template <typename T>
const T* At(const DeviceBuffer& buffer, int64_t offset) {
  return reinterpret_cast<const T*>(buffer.data() + offset);
}

}  // namespace

CudaStep::CudaStep(CudaCache* cache, std::shared_ptr<const StepBatch> batch, StepPlan plan,
                   std::unique_ptr<StepResources> resources, int64_t prefill_work_offset)
    : cache_(cache),
      batch_(std::move(batch)),
      plan_(std::move(plan)),
      resources_(std::move(resources)),
      sizes_(LayerSizes::Of(cache->geometry(), batch_->num_tokens, batch_->options.return_lse)) {
  const DeviceBuffer& arrays = resources_->device_arrays;
  const StepArrayOffsets& offsets = plan_.offsets;
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
  if (plan_.run_decode) decode_work_ = plan_.decode.View(At<int32_t>(arrays, offsets.decode_work));
  if (plan_.run_prefill) {
    prefill_work_ = arrays.data() + prefill_work_offset;
    prefill_work_bytes_ = cuda::BatchPrefillWorkspaceBytes(plan_.prefill);
  }
  for (LayerSlot& slot : resources_->slots) free_slots_.push_back(&slot);
}

CudaStep::~CudaStep() { cache_->ReturnResources(std::move(resources_)); }

void CudaStep::RunLayer(const LayerIo& io, DoneCallback done) {
  if (batch_->num_tokens == 0) {
    // Nothing to compute, but `done` still comes from a backend thread, never the caller's.
    cache_->completions().Post([done = std::move(done)] { done(absl::OkStatus()); });
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
  // The slot is ours: its previous layer finished, so its pinned input is free to overwrite.
  uint8_t* staged = slot->host_in.data();
  std::memcpy(staged, io.q, sizes_.q_bytes);
  std::memcpy(staged + sizes_.k_offset, io.k, sizes_.k_bytes);
  std::memcpy(staged + sizes_.v_offset, io.v, sizes_.v_bytes);

  std::lock_guard lock(cache_->submit_mutex());
  absl::Status status = EnqueueLocked(*slot, io.layer);
  // Recorded even after a failed launch: the slot is reused only once the work that was
  // enqueued before the failure has passed this point.
  const cudaError_t recorded = cudaEventRecord(slot->finished.get(), cache_->compute_stream());
  if (status.ok() && recorded != cudaSuccess) {
    status = cuda::CudaErrorToStatus(recorded, "cudaEventRecord(finished)", __FILE__, __LINE__);
  }
  cache_->completions().Post([this, slot, io, status, done = std::move(done)] {
    Complete(slot, io, status, done);
  });
}

absl::Status CudaStep::EnqueueLocked(LayerSlot& slot, int32_t layer) {
  const CacheGeometry& g = cache_->geometry();
  const cudaStream_t copy = cache_->copy_stream();
  const cudaStream_t compute = cache_->compute_stream();
  const int64_t tokens = batch_->num_tokens;
  uint8_t* device_in = slot.device_in.data();

  CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(device_in, slot.host_in.data(), sizes_.in_bytes,
                                       cudaMemcpyHostToDevice, copy));
  CUDA_RETURN_IF_ERROR(cudaEventRecord(slot.inputs_copied.get(), copy));
  CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(compute, slot.inputs_copied.get(), 0));
  CUDA_RETURN_IF_ERROR(cudaEventRecord(slot.started.get(), compute));

  cuda::AppendKvArgs append;
  append.tokens = tokens_;
  append.pages = pages_;
  append.rope_style = g.rope.style;
  append.rope_inv_freq = cache_->rope_inv_freq();
  append.rotary_dim = g.rope.style == RopeStyle::kNone ? 0 : g.rope.rotary_dim;
  append.q_in = Rows(device_in, g.q_dtype, tokens, g.num_qo_heads, g.k_head_dim);
  append.q_out = Rows(cache_->q_rotated(), g.q_dtype, tokens, g.num_qo_heads, g.k_head_dim);
  append.k_in = Rows(device_in + sizes_.k_offset, g.q_dtype, tokens, g.num_kv_heads, g.k_head_dim);
  append.v_in = Rows(device_in + sizes_.v_offset, g.q_dtype, tokens, g.num_kv_heads, g.v_head_dim);
  append.k_cache = cache_->Pool(layer, false);
  append.v_cache = cache_->Pool(layer, true);
  append.k_scale = g.k_scale;
  append.v_scale = g.v_scale;
  RETURN_IF_ERROR(cuda::AppendKv(append, compute));
  CUDA_RETURN_IF_ERROR(cudaEventRecord(slot.appended.get(), compute));

  const TokenHeadsView q = append.q_out;
  const TokenHeadsView o =
      Rows(cache_->device_out(), g.q_dtype, tokens, g.num_qo_heads, g.v_head_dim);
  float* lse = batch_->options.return_lse
                   ? reinterpret_cast<float*>(cache_->device_out() + sizes_.lse_offset)
                   : nullptr;
  if (plan_.run_decode) {
    cuda::BatchDecodeArgs decode;
    decode.q = q;
    decode.pages = pages_;
    decode.k_cache = append.k_cache;
    decode.v_cache = append.v_cache;
    decode.params = batch_->options.params;
    decode.work = decode_work_;
    decode.o = o;
    decode.lse = lse;
    decode.workspace = cache_->decode_workspace();
    decode.workspace_bytes = cache_->decode_workspace_bytes();
    RETURN_IF_ERROR(cuda::BatchDecode(decode, compute));
    CUDA_RETURN_IF_ERROR(cudaEventRecord(slot.attended_first.get(), compute));
  }
  if (plan_.run_prefill) {
    cuda::BatchPrefillArgs prefill;
    prefill.q = q;
    prefill.qo_indptr = qo_indptr_;
    prefill.pages = pages_;
    prefill.k_cache = append.k_cache;
    prefill.v_cache = append.v_cache;
    prefill.params = batch_->options.params;
    prefill.o = o;
    prefill.lse = lse;
    RETURN_IF_ERROR(cuda::BatchPrefill(plan_.prefill, prefill, prefill_work_,
                                       prefill_work_bytes_, compute));
    CUDA_RETURN_IF_ERROR(cudaEventRecord(
        (plan_.run_decode ? slot.attended_second : slot.attended_first).get(), compute));
  }
  CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(slot.host_out.data(), cache_->device_out(),
                                       sizes_.out_bytes, cudaMemcpyDeviceToHost, compute));
  return absl::OkStatus();
}

void CudaStep::Complete(LayerSlot* slot, const LayerIo& io, absl::Status status,
                        const DoneCallback& done) {
  const cudaError_t waited = cudaEventSynchronize(slot->finished.get());
  if (status.ok() && waited != cudaSuccess) {
    status = cuda::CudaErrorToStatus(waited, "cudaEventSynchronize(layer finished)", __FILE__,
                                     __LINE__);
  }
  if (status.ok()) {
    std::memcpy(io.o, slot->host_out.data(), sizes_.o_bytes);
    if (io.lse != nullptr && sizes_.lse_bytes > 0) {
      std::memcpy(io.lse, slot->host_out.data() + sizes_.lse_offset, sizes_.lse_bytes);
    }
    ReportTimes(*slot);
  }
  // Hand the slot to a waiting layer, or back to the pool, before `done`: once `done` runs the
  // step may be gone.
  std::unique_lock lock(mu_);
  if (pending_.empty()) {
    free_slots_.push_back(slot);
    lock.unlock();
  } else {
    PendingLayer next = std::move(pending_.front());
    pending_.pop_front();
    lock.unlock();
    Submit(slot, next.io, std::move(next.done));
  }
  done(status);
}

void CudaStep::ReportTimes(const LayerSlot& slot) const {
  BackendObserver* observer = cache_->observer();
  if (observer == nullptr) return;
  const std::string_view phase = StepPhaseName(batch_->phase);
  observer->OnKernel("append", "append", ElapsedSeconds(slot.started, slot.appended));
  if (plan_.run_decode) {
    observer->OnKernel("decode", phase, ElapsedSeconds(slot.appended, slot.attended_first));
  }
  if (plan_.run_prefill) {
    observer->OnKernel("prefill", phase,
                       plan_.run_decode ? ElapsedSeconds(slot.attended_first, slot.attended_second)
                                        : ElapsedSeconds(slot.appended, slot.attended_first));
  }
  observer->OnTransfer("h2d", sizes_.q_bytes + sizes_.k_bytes + sizes_.v_bytes);
  observer->OnTransfer("d2h", sizes_.o_bytes + sizes_.lse_bytes);
}

}  // namespace attnd::cuda_backend
