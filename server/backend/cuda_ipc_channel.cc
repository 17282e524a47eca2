#include "backend/cuda_ipc_channel.h"

#include <cuda_runtime_api.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "attnd/kernels/cuda/cuda_check.h"
#include "attnd/kernels/cuda/stream_flags.h"
#include "attnd/kernels/cuda/timer_stamp.h"
#include "attnd/status_macros.h"
#include "backend/cuda_step.h"

namespace attnd::cuda_backend {
namespace {

bool StampsRequested() {
  const char* value = std::getenv("ATTND_CHANNEL_STAMPS");
  return value != nullptr && value[0] != '\0' && std::strcmp(value, "0") != 0;
}

}  // namespace

absl::StatusOr<std::unique_ptr<CudaIpcChannel>> CudaIpcChannel::Create(CudaCache* cache,
                                                                        const ChannelSpec& spec,
                                                                        int device) {
  std::unique_ptr<CudaIpcChannel> channel(new CudaIpcChannel(cache, spec, device));
  RETURN_IF_ERROR(channel->Init());
  return channel;
}

CudaIpcChannel::CudaIpcChannel(CudaCache* cache, const ChannelSpec& spec, int device)
    : cache_(cache),
      geometry_(cache->geometry()),
      layout_(MakeChannelLayout(cache->geometry(), spec.max_tokens, spec.num_slots,
                                spec.with_lse)),
      device_(device),
      with_lse_(spec.with_lse),
      peer_access_(!spec.client_pci_bus_id.empty()),
      window_(cache->geometry().num_layers, mu_, wake_) {}

absl::Status CudaIpcChannel::Init() {
  CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  // Only the compute stream: a CUDA_IPC layer copies nothing, and every stream takes one of
  // the GPU's hardware queues (see CUDA_DEVICE_MAX_CONNECTIONS in backend_factory.cc).
  RETURN_IF_ERROR(lane_.compute.Create());
  RETURN_IF_ERROR(signal_.Create());
  RETURN_IF_ERROR(ring_.Reserve(layout_.ring_bytes));
  RETURN_IF_ERROR(done_counter_.Reserve(sizeof(uint32_t)));
  // Zeroed: flags start at 0 (no step's sequence), slots hold zeros, not stale bytes.
  CUDA_RETURN_IF_ERROR(cudaMemsetAsync(ring_.data(), 0, layout_.ring_bytes, lane_.compute.get()));
  CUDA_RETURN_IF_ERROR(
      cudaMemsetAsync(done_counter_.data(), 0, sizeof(uint32_t), lane_.compute.get()));
  const int32_t q_dim = geometry_.mla ? geometry_.v_head_dim : geometry_.k_head_dim;
  RETURN_IF_ERROR(lane_.q_rotated.Reserve(int64_t{layout_.max_tokens} * geometry_.num_qo_heads *
                                          q_dim * DTypeBytes(geometry_.q_dtype)));
  CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(lane_.compute.get()));
  cudaIpcMemHandle_t handle;
  CUDA_RETURN_IF_ERROR(cudaIpcGetMemHandle(&handle, ring_.data()));
  ipc_handle_.assign(reinterpret_cast<const char*>(&handle), sizeof(handle));
  char bus_id[64] = {};
  CUDA_RETURN_IF_ERROR(cudaDeviceGetPCIBusId(bus_id, sizeof(bus_id), device_));
  pci_bus_id_ = bus_id;
  const bool blocking = cache_->completion_wait() == CompletionWait::kBlockingSync;
  for (LayerEvents& events : window_.events()) RETURN_IF_ERROR(events.Create(blocking));
  if (StampsRequested()) {
    const size_t bytes = sizeof(uint64_t) * 2 * geometry_.num_layers;
    CUDA_RETURN_IF_ERROR(
        cudaHostAlloc(reinterpret_cast<void**>(&stamps_), bytes, cudaHostAllocMapped));
    std::memset(stamps_, 0, bytes);
    CUDA_RETURN_IF_ERROR(
        cudaHostGetDevicePointer(reinterpret_cast<void**>(&stamps_device_), stamps_, 0));
  }
  const int device = device_;
  lane_.completions = std::make_unique<CompletionQueue>([device] { cudaSetDevice(device); });
  enqueuer_ = std::thread([this] { EnqueueLoop(); });
  return absl::OkStatus();
}

CudaIpcChannel::~CudaIpcChannel() {
  // The engine destroys a channel only once no layer of it is in flight.
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
  }
  wake_.notify_all();
  if (enqueuer_.joinable()) enqueuer_.join();
  if (lane_.completions) lane_.completions->Shutdown();
  for (const CudaStream* stream : {&lane_.compute, &signal_}) {
    if (stream->get() != nullptr) cudaStreamSynchronize(stream->get());
  }
  for (uint8_t* retired : lane_.retired) cudaFree(retired);
  for (uint8_t* retired : lane_.retired_pinned) cudaFreeHost(retired);
  if (stamps_ != nullptr) cudaFreeHost(stamps_);
}

absl::Status CudaIpcChannel::WriteFlag(int64_t offset, uint32_t value) {
  // Called from any thread (CancelStep from the engine, SignalReady from a Forward): on a
  // daemon serving several GPUs that thread's current device may be another one, and a stream
  // memory operation on this device's stream from there fails (the ignored error once left a
  // cancelled step's waits unreleased and its layers on the device forever).
  CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  return cuda::StreamWriteFlag(signal_.get(), ring_.data() + offset, value);
}

void CudaIpcChannel::StartStep(BackendStep* step, uint32_t sequence, int64_t /*num_tokens*/,
                               ChannelLayerDone layer_done) {
  window_.Start(static_cast<CudaStep*>(step), sequence, std::move(layer_done));
}

void CudaIpcChannel::CancelStep(uint32_t sequence, bool mark_aborted) {
  window_.Cancel(sequence, [&](ActiveStep& active) {
    active.mark_aborted = mark_aborted;
    // Layers already on the device wait for ready words the client may never set: set them.
    // Their kernels then run on whatever the slot holds, into the step's own pages, which the
    // abort rolls back.
    for (int32_t layer = 0; layer < active.next_layer; ++layer) {
      if (!active.completed[layer]) WriteFlag(layout_.ready[layer], sequence).IgnoreError();
    }
  });
}

bool CudaIpcChannel::ReadyReached(int32_t layer, uint32_t sequence) {
  // On the signal stream, which only ever carries attnd's own short flag writes.
  uint32_t value = 0;
  if (cudaSetDevice(device_) != cudaSuccess ||
      cudaMemcpyAsync(&value, ring_.data() + layout_.ready[layer], sizeof(value),
                      cudaMemcpyDeviceToHost, signal_.get()) != cudaSuccess ||
      cudaStreamSynchronize(signal_.get()) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return static_cast<int32_t>(value - sequence) >= 0;
}

absl::Status CudaIpcChannel::ReadRing(int64_t offset, std::span<uint8_t> bytes) {
  CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(bytes.data(), ring_.data() + offset, bytes.size(),
                                       cudaMemcpyDeviceToHost, signal_.get()));
  CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(signal_.get()));
  return absl::OkStatus();
}

absl::Status CudaIpcChannel::WriteRing(int64_t offset, std::span<const uint8_t> bytes) {
  CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(ring_.data() + offset, bytes.data(), bytes.size(),
                                       cudaMemcpyHostToDevice, signal_.get()));
  CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(signal_.get()));
  return absl::OkStatus();
}

absl::StatusOr<uint32_t> CudaIpcChannel::LoadTransferFlag(int64_t offset) {
  uint32_t value = 0;
  RETURN_IF_ERROR(ReadRing(offset, std::span<uint8_t>(reinterpret_cast<uint8_t*>(&value),
                                                      sizeof(value))));
  return value;
}

absl::Status CudaIpcChannel::StoreTransferFlag(int64_t offset, uint32_t value) {
  CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  RETURN_IF_ERROR(WriteFlag(offset, value));
  // Ordered after the region's copies on the same stream; synchronised so that the caller's
  // next region write cannot pass it.
  CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(signal_.get()));
  return absl::OkStatus();
}

void CudaIpcChannel::SignalReady(int32_t layer, uint32_t sequence) {
  WriteFlag(layout_.ready[layer], sequence).IgnoreError();
}

void CudaIpcChannel::Skip(const ActiveStep& active, int32_t layer) {
  if (active.mark_aborted) WriteFlag(layout_.aborted, active.sequence).IgnoreError();
  WriteFlag(layout_.done[layer], active.sequence).IgnoreError();
  active.layer_done(layer, absl::CancelledError(absl::StrCat(
                               "layer ", layer, " of channel step ", active.sequence,
                               " did not run: the step was aborted")));
}

void CudaIpcChannel::EnqueueLoop() {
  cudaSetDevice(device_);
  window_.RunEnqueuer(
      [this] {
        StreamStepWindow<ActiveStep>::Gate gate;
        gate.stopping = stopping_;
        return gate;
      },
      // The reason is always "the step was aborted" here (a CUDA_IPC channel does not break),
      // which is what Skip says.
      [this](const ActiveStep& active, int32_t layer, const absl::Status& /*why*/) {
        Skip(active, layer);
      },
      [this](const std::shared_ptr<ActiveStep>& active, int32_t layer, LayerEvents* events,
             int /*ahead*/) { Enqueue(active, layer, events); });
}

void CudaIpcChannel::Enqueue(const std::shared_ptr<ActiveStep>& active, int32_t layer,
                             LayerEvents* events) {
  CudaStep& step = *active->step;
  const cudaStream_t compute = lane_.compute.get();
  const ChannelSlotLayout& slot = layout_.slots[layout_.SlotOf(layer)];
  uint8_t* ring = ring_.data();
  // Some layers are timed (the kernel metrics): see LayerTimingDraw.
  const bool timed = timing_draw_.Next(cache_->channel_timing_stride(), step.num_tokens());
  std::lock_guard lock(lane_.submit_mu);
  bool done_signalled = false;
  absl::Status status = [&]() -> absl::Status {
    // Not a polling kernel (flag_gate.h), though it hands over sooner: while it spun, any
    // implicitly synchronizing call of attnd's (cudaFree of a grown buffer at Plan, a cache's
    // or channel's teardown) would wait for it, that is for the client's ready, which may wait
    // for that very call: a deadlock seen on the H100 (a chained Plan growing the step's
    // buffers). A memory-operation wait is not running work and holds no such call.
    RETURN_IF_ERROR(cuda::StreamWaitFlag(compute, ring + layout_.ready[layer], active->sequence));
    if (stamps_device_ != nullptr) {
      RETURN_IF_ERROR(cuda::LaunchTimerStamp(stamps_device_ + 2 * layer, compute));
    }
    // A step with no rows runs no kernel (and reports no kernel time, see Complete).
    if (step.num_tokens() > 0) {
      LayerBuffers buffers;
      buffers.q = ring + slot.q;
      buffers.k = ring + (geometry_.mla ? slot.ckv : slot.k);
      buffers.v = ring + (geometry_.mla ? slot.kpe : slot.v);
      buffers.q_pe = ring + slot.q_pe;
      buffers.o = ring + slot.o;
      buffers.lse = step.returns_lse() ? reinterpret_cast<float*>(ring + slot.lse) : nullptr;
      // Where the layer's last kernel can set done itself, it does: the client polling the
      // word sees it as the grid's last stores land, not after the grid's completion and a
      // stream operation (--channel_done_by_kernel).
      if (cache_->channel_done_by_kernel()) {
        buffers.done = {reinterpret_cast<uint32_t*>(ring + layout_.done[layer]), active->sequence,
                        reinterpret_cast<uint32_t*>(done_counter_.data())};
      }
      if (timed) CUDA_RETURN_IF_ERROR(cudaEventRecord(events->started.get(), compute));
      const CudaEvent* attended = nullptr;
      RETURN_IF_ERROR(
          step.EnqueueKernels(*events, timed, buffers, layer, &attended, &done_signalled));
    }
    if (stamps_device_ != nullptr) {
      RETURN_IF_ERROR(cuda::LaunchTimerStamp(stamps_device_ + 2 * layer + 1, compute));
    }
    if (done_signalled) return absl::OkStatus();
    return cuda::StreamWriteFlag(compute, ring + layout_.done[layer], active->sequence);
  }();
  // Recorded even after a failed enqueue: the events are reused only once the work that was
  // enqueued has passed this point.
  const cudaError_t recorded = cudaEventRecord(events->finished.get(), compute);
  if (status.ok() && recorded != cudaSuccess) {
    status = cuda::CudaErrorToStatus(recorded, "cudaEventRecord(finished)", __FILE__, __LINE__);
  }
  lane_.completions->Post(
      [this, active, layer, events, timed, status = std::move(status)]() mutable {
        Complete(active, layer, events, timed, std::move(status));
      });
}

void CudaIpcChannel::Complete(const std::shared_ptr<ActiveStep>& active, int32_t layer,
                              LayerEvents* events, bool timed, absl::Status status) {
  const cudaError_t waited = cudaEventSynchronize(events->finished.get());
  if (status.ok() && waited != cudaSuccess) {
    status = cuda::CudaErrorToStatus(waited, "cudaEventSynchronize(channel layer)", __FILE__,
                                     __LINE__);
  }
  if (status.ok() && timed) active->step->ReportChannelLayer(*events);
  if (status.ok() && stamps_ != nullptr) {
    // The layer's stamps were written before `finished`, and layer l is not enqueued again
    // before this completion returns its events.
    std::fprintf(stderr,
                 "attnd-stamp seq=%u layer=%d ready_passed_ns=%llu kernels_done_ns=%llu\n",
                 active->sequence, layer, static_cast<unsigned long long>(stamps_[2 * layer]),
                 static_cast<unsigned long long>(stamps_[2 * layer + 1]));
  }
  {
    std::lock_guard lock(mu_);
    window_.CompleteLocked(active, layer, events);
  }
  wake_.notify_all();
  // May end the step (and destroy the CudaStep): nothing of it is touched after this.
  active->layer_done(layer, std::move(status));
}

}  // namespace attnd::cuda_backend
