#include "backend/nccl_channel.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "attnd/kernels/cuda/cuda_check.h"
#include "attnd/status_macros.h"
#include "backend/cuda_step.h"
#include "util/log.h"

namespace attnd::cuda_backend {
namespace {

using nccl::ncclResult_t;
using nccl::ncclSuccess;

// How often the watcher asks the communicator for asynchronous errors (a peer that died).
constexpr absl::Duration kWatchPeriod = absl::Milliseconds(10);

}  // namespace

void NcclChannel::Profile::Add(std::vector<double>& samples, double value) {
  if (samples.size() >= kSamples) samples.erase(samples.begin(), samples.begin() + kSamples / 2);
  samples.push_back(value);
}

std::string NcclChannel::Profile::Summary() const {
  auto p50 = [](std::vector<double> samples) {
    if (samples.empty()) return -1.0;
    std::nth_element(samples.begin(), samples.begin() + samples.size() / 2, samples.end());
    return samples[samples.size() / 2];
  };
  return absl::StrFormat(
      "(p50 of the last %d): host: receive group %.1f us, kernels' launches %.1f us, send group "
      "%.1f us, %.0f layers on the stream at enqueue; GPU (%d timed layers): receive %.1f us "
      "(the wait for the client's send included), send %.1f us",
      static_cast<int>(recv_host_us.size()), p50(recv_host_us), p50(kernels_host_us),
      p50(send_host_us), p50(ahead), static_cast<int>(recv_gpu_us.size()), p50(recv_gpu_us),
      p50(send_gpu_us));
}

absl::StatusOr<std::unique_ptr<NcclChannel>> NcclChannel::Create(CudaCache* cache,
                                                                 const ChannelSpec& spec,
                                                                 int device,
                                                                 const nccl::NcclLibrary* nccl,
                                                                 absl::Duration init_timeout) {
  std::unique_ptr<NcclChannel> channel(new NcclChannel(cache, spec, device, nccl, init_timeout));
  RETURN_IF_ERROR(channel->Init());
  return channel;
}

NcclChannel::NcclChannel(CudaCache* cache, const ChannelSpec& spec, int device,
                         const nccl::NcclLibrary* nccl, absl::Duration init_timeout)
    : cache_(cache),
      geometry_(cache->geometry()),
      layout_(MakeChannelLayout(cache->geometry(), spec.max_tokens, spec.num_slots,
                                spec.with_lse)),
      device_(device),
      nccl_(nccl),
      init_timeout_(init_timeout),
      on_broken_(spec.on_broken),
      window_(cache->geometry().num_layers, mu_, wake_) {}

absl::Status NcclChannel::Init() {
  CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  RETURN_IF_ERROR(lane_.compute.Create());
  RETURN_IF_ERROR(ring_.Reserve(layout_.ring_bytes));
  // Zeroed: a layer that runs after an abort reads zeros, not another tenant's stale bytes.
  CUDA_RETURN_IF_ERROR(cudaMemsetAsync(ring_.data(), 0, layout_.ring_bytes, lane_.compute.get()));
  const int32_t q_dim = geometry_.mla ? geometry_.v_head_dim : geometry_.k_head_dim;
  RETURN_IF_ERROR(lane_.q_rotated.Reserve(int64_t{layout_.max_tokens} * geometry_.num_qo_heads *
                                          q_dim * DTypeBytes(geometry_.q_dtype)));
  CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(lane_.compute.get()));
  char bus_id[64] = {};
  CUDA_RETURN_IF_ERROR(cudaDeviceGetPCIBusId(bus_id, sizeof(bus_id), device_));
  pci_bus_id_ = bus_id;
  nccl::ncclUniqueId id;
  if (const ncclResult_t result = nccl_->api().GetUniqueId(&id); result != ncclSuccess) {
    return absl::UnavailableError(nccl_->Describe("ncclGetUniqueId", result));
  }
  unique_id_.assign(id.internal, sizeof(id.internal));
  const bool blocking = cache_->completion_wait() == CompletionWait::kBlockingSync;
  for (WindowEvents& events : window_.events()) {
    RETURN_IF_ERROR(events.layer.Create(blocking));
    RETURN_IF_ERROR(events.received.Create(/*timing=*/false));
    RETURN_IF_ERROR(events.posted.Create(/*timing=*/true));
    RETURN_IF_ERROR(events.sent.Create(/*timing=*/true));
  }
  const int device = device_;
  lane_.completions = std::make_unique<CompletionQueue>([device] { cudaSetDevice(device); });
  watcher_ = std::thread([this] { WatchLoop(); });
  enqueuer_ = std::thread([this] { EnqueueLoop(); });
  return absl::OkStatus();
}

NcclChannel::~NcclChannel() {
  // The engine destroys a channel only once no layer of it is in flight.
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
  }
  wake_.notify_all();
  if (enqueuer_.joinable()) enqueuer_.join();
  if (watcher_.joinable()) watcher_.join();  // aborts the communicator on its way out
  if (lane_.completions) lane_.completions->Shutdown();
  if (!profile_.recv_host_us.empty()) {
    LogInfo(absl::StrCat("NCCL channel on GPU ", device_, " closed; per layer ",
                         profile_.Summary()));
  }
  if (lane_.compute.get() != nullptr) cudaStreamSynchronize(lane_.compute.get());
  for (uint8_t* retired : lane_.retired) cudaFree(retired);
  for (uint8_t* retired : lane_.retired_pinned) cudaFreeHost(retired);
}

void NcclChannel::WatchLoop() {
  cudaSetDevice(device_);
  const nccl::NcclApi& api = nccl_->api();
  absl::Status failure = Join();
  std::unique_lock lock(mu_);
  if (failure.ok() && !stopping_ && !broken_) {
    connected_ = true;
    wake_.notify_all();
  }
  while (failure.ok() && !stopping_ && !broken_) {
    wake_.wait_for(lock, absl::ToChronoNanoseconds(kWatchPeriod),
                   [&] { return stopping_ || broken_; });
    if (stopping_ || broken_) break;
    lock.unlock();
    ncclResult_t state = ncclSuccess;
    {
      // Skipped while the enqueuer is inside a call (it may wait there for the peer).
      std::unique_lock comm_lock(nccl_mu_, std::try_to_lock);
      if (comm_lock.owns_lock() && comm_ != nullptr) api.CommGetAsyncError(comm_, &state);
    }
    if (state != ncclSuccess && state != nccl::ncclInProgress) {
      failure = absl::UnavailableError(
          nccl_->Describe("the NCCL communicator failed (the peer is gone?)", state));
    }
    lock.lock();
  }
  if (!failure.ok()) BreakLocked(failure);
  const bool report = broken_ && !stopping_;
  const absl::Status why = break_reason_;
  lock.unlock();
  Abort();
  wake_.notify_all();
  if (report && on_broken_) on_broken_(why);
}

absl::Status NcclChannel::Join() {
  // A blocking communicator: with a non-blocking one NCCL runs every group on a thread it
  // creates for it, ~70-90 us of the host per group (measured on the 2-GPU machine: the
  // enqueuer fell behind the GPU). A blocking ncclCommInitRankConfig cannot be given up,
  // so it runs on a thread of its own; if the peer does not come in time (or the channel
  // closes first), this thread joins as the missing rank 1 from attnd's own GPU, which NCCL
  // refuses for two ranks of one communicator: both joins end with that error.
  struct Attempt {
    std::atomic<bool> done{false};
    ncclResult_t result = ncclSuccess;
    nccl::ncclComm_t comm = nullptr;
  };
  const nccl::NcclApi* api = &nccl_->api();
  nccl::ncclUniqueId id;
  std::memcpy(id.internal, unique_id_.data(), sizeof(id.internal));
  const int device = device_;
  Attempt attempt;
  std::thread joiner([api, id, device, &attempt] {
    cudaSetDevice(device);
    nccl::ncclConfig_t config;
    config.blocking = 1;
    attempt.result =
        api->CommInitRankConfig(&attempt.comm, nccl::kChannelRanks, id, kAttndRank, &config);
    attempt.done.store(true, std::memory_order_release);
  });
  const absl::Time deadline = absl::Now() + init_timeout_;
  bool gave_up = false;
  {
    std::unique_lock lock(mu_);
    while (!attempt.done.load(std::memory_order_acquire) && !stopping_ && !broken_ &&
           absl::Now() < deadline) {
      wake_.wait_for(lock, std::chrono::milliseconds(1));
    }
    gave_up = !attempt.done.load(std::memory_order_acquire);
  }
  if (gave_up) {
    std::thread unblocker([api, id, device] {
      cudaSetDevice(device);
      nccl::ncclComm_t stand_in = nullptr;
      api->CommInitRank(&stand_in, nccl::kChannelRanks, id, kClientRank);
      if (stand_in != nullptr) api->CommAbort(stand_in);
    });
    unblocker.join();
  }
  joiner.join();
  if (attempt.result != ncclSuccess || gave_up) {
    if (attempt.comm != nullptr) api->CommAbort(attempt.comm);
    if (gave_up) {
      return absl::DeadlineExceededError(absl::StrCat(
          "the NCCL peer did not join within ", absl::FormatDuration(init_timeout_),
          " (ncclCommInitRank with ChannelInfo.nccl_unique_id as rank 1)"));
    }
    return absl::UnavailableError(
        nccl_->Describe("the NCCL peer's join failed (ncclCommInitRankConfig)", attempt.result));
  }
  std::lock_guard comm_lock(nccl_mu_);
  comm_ = attempt.comm;
  comm_seen_.store(attempt.comm);
  return absl::OkStatus();
}

void NcclChannel::Abort() {
  // Local and immediate, whatever the peer does: NCCL's kernels still waiting on the stream
  // exit, so the completion thread's waits end. Also how a channel closes normally (a
  // ncclCommDestroy could wait for a peer that is gone). The enqueuer may be inside a group
  // call that waits for the peer (a connection's first use) and holds nccl_mu_ there: then
  // the abort goes ahead without the lock (what ncclCommAbort from another thread is for),
  // and `aborted_` keeps the enqueuer from another call once that one returns.
  const nccl::NcclApi& api = nccl_->api();
  const absl::Time patience = absl::Now() + absl::Milliseconds(200);
  std::unique_lock comm_lock(nccl_mu_, std::try_to_lock);
  while (!comm_lock.owns_lock() && absl::Now() < patience) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
    comm_lock.try_lock();
  }
  aborted_.store(true);
  if (comm_lock.owns_lock()) {
    if (comm_ != nullptr) api.CommAbort(comm_);
    comm_ = nullptr;
    return;
  }
  nccl::ncclComm_t comm = comm_seen_.load();
  if (comm != nullptr) api.CommAbort(comm);
  comm_lock.lock();  // the enqueuer's call has returned
  comm_ = nullptr;
}

void NcclChannel::BreakLocked(absl::Status why) {
  if (broken_) return;
  broken_ = true;
  break_reason_ = std::move(why);
  wake_.notify_all();
}

absl::Status NcclChannel::Group(bool send,
                                const std::vector<std::pair<uint8_t*, int64_t>>& buffers) {
  const nccl::NcclApi& api = nccl_->api();
  const char* call = send ? "ncclSend group" : "ncclRecv group";
  ncclResult_t result = ncclSuccess;
  {
    std::lock_guard comm_lock(nccl_mu_);
    if (comm_ == nullptr || aborted_.load()) {
      return absl::UnavailableError("the NCCL communicator was aborted");
    }
    result = api.GroupStart();
    for (const auto& [buffer, bytes] : buffers) {
      if (result != ncclSuccess || bytes <= 0) continue;
      const size_t count = static_cast<size_t>(bytes);
      result = send ? api.Send(buffer, count, nccl::ncclUint8, kClientRank, comm_,
                               lane_.compute.get())
                    : api.Recv(buffer, count, nccl::ncclUint8, kClientRank, comm_,
                               lane_.compute.get());
    }
    // Ended even after a failed call: a group left open would swallow the next one.
    const ncclResult_t ended = api.GroupEnd();
    if (result == ncclSuccess) result = ended;
    if (aborted_.load()) return absl::UnavailableError("the NCCL communicator was aborted");
  }
  if (result != ncclSuccess) return absl::UnavailableError(nccl_->Describe(call, result));
  return absl::OkStatus();
}

void NcclChannel::StartStep(BackendStep* step, uint32_t sequence, int64_t /*num_tokens*/,
                            ChannelLayerDone layer_done) {
  window_.Start(static_cast<CudaStep*>(step), sequence, std::move(layer_done));
}

void NcclChannel::CancelStep(uint32_t sequence, bool /*mark_aborted*/) {
  window_.Cancel(sequence, [&](ActiveStep& active) {
    // Receives already on the stream wait for sends the peer may never make, and the peer
    // would pair its next sends with them: only an aborted communicator ends both.
    for (int32_t layer = 0; layer < active.next_layer; ++layer) {
      if (!active.completed[layer] && active.step->num_tokens() > 0) {
        BreakLocked(absl::AbortedError(absl::StrCat(
            "channel step ", sequence, " was aborted with layer ", layer,
            " on the wire; an NCCL channel cannot skip it")));
        break;
      }
    }
  });
}

bool NcclChannel::ReadyReached(int32_t layer, uint32_t sequence) {
  std::lock_guard lock(mu_);
  if (const ActiveStep* active = window_.FindLiveLocked(sequence)) {
    if (active->completed[layer]) return true;
    const WindowEvents* events = active->in_flight[layer];
    return events != nullptr && cudaEventQuery(events->received.get()) == cudaSuccess;
  }
  // No longer live: every layer of it that was enqueued has completed, the rest were skipped.
  return true;
}

void NcclChannel::Skip(const ActiveStep& active, int32_t layer, const absl::Status& why) {
  active.layer_done(layer, absl::CancelledError(absl::StrCat(
                               "layer ", layer, " of channel step ", active.sequence,
                               " did not run: ", why.message())));
}

void NcclChannel::EnqueueLoop() {
  cudaSetDevice(device_);
  window_.RunEnqueuer(
      [this] {
        StreamStepWindow<ActiveStep>::Gate gate;
        gate.stopping = stopping_;
        gate.connected = connected_;
        gate.broken = broken_ ? &break_reason_ : nullptr;
        return gate;
      },
      [this](const ActiveStep& active, int32_t layer, const absl::Status& why) {
        Skip(active, layer, why);
      },
      [this](const std::shared_ptr<ActiveStep>& active, int32_t layer, WindowEvents* events,
             int ahead) { Enqueue(active, layer, events, ahead); });
}

void NcclChannel::Enqueue(const std::shared_ptr<ActiveStep>& active, int32_t layer,
                          WindowEvents* events, int ahead) {
  CudaStep& step = *active->step;
  const cudaStream_t compute = lane_.compute.get();
  const ChannelSlotLayout& slot = layout_.slots[layout_.SlotOf(layer)];
  uint8_t* ring = ring_.data();
  const int64_t rows = step.num_tokens();
  // As CudaIpcChannel: some layers record kernel timing events (LayerTimingDraw).
  const bool timed = timing_draw_.Next(cache_->channel_timing_stride(), rows);
  absl::Status status = [&]() -> absl::Status {
    // A step with no rows moves nothing and runs no kernel (the peer knows T from Plan too).
    if (rows == 0) return absl::OkStatus();
    // The wire order of the proto's CHANNEL_KIND_NCCL: q, k, v (MLA q_nope, q_pe, ckv, kpe).
    std::vector<std::pair<uint8_t*, int64_t>> inputs;
    if (geometry_.mla) {
      inputs = {{ring + slot.q, rows * layout_.q_row},
                {ring + slot.q_pe, rows * layout_.q_pe_row},
                {ring + slot.ckv, rows * layout_.ckv_row},
                {ring + slot.kpe, rows * layout_.kpe_row}};
    } else {
      inputs = {{ring + slot.q, rows * layout_.q_row},
                {ring + slot.k, rows * layout_.k_row},
                {ring + slot.v, rows * layout_.v_row}};
    }
    // The host's part of a layer, sampled on the timed layers only (Profile).
    auto stamp = [timed] { return timed ? absl::Now() : absl::InfinitePast(); };
    const absl::Time posted = stamp();
    if (timed) CUDA_RETURN_IF_ERROR(cudaEventRecord(events->posted.get(), compute));
    RETURN_IF_ERROR(Group(/*send=*/false, inputs));
    CUDA_RETURN_IF_ERROR(cudaEventRecord(events->received.get(), compute));
    const absl::Time received = stamp();
    LayerBuffers buffers;
    buffers.q = ring + slot.q;
    buffers.k = ring + (geometry_.mla ? slot.ckv : slot.k);
    buffers.v = ring + (geometry_.mla ? slot.kpe : slot.v);
    buffers.q_pe = ring + slot.q_pe;
    buffers.o = ring + slot.o;
    buffers.lse = step.returns_lse() ? reinterpret_cast<float*>(ring + slot.lse) : nullptr;
    {
      // Only the launches hold the lane (its buffers do not grow under them). Not the NCCL
      // groups: settling one can wait for the peer (a first use of a connection), and the peer
      // may be waiting for a chained Plan, which takes the lane to grow them: a deadlock seen
      // on the 2-GPU machine.
      std::lock_guard lock(lane_.submit_mu);
      if (timed) CUDA_RETURN_IF_ERROR(cudaEventRecord(events->layer.started.get(), compute));
      const CudaEvent* attended = nullptr;
      RETURN_IF_ERROR(step.EnqueueKernels(events->layer, timed, buffers, layer, &attended));
      events->attended = attended;
    }
    const absl::Time launched = stamp();
    std::vector<std::pair<uint8_t*, int64_t>> outputs = {{ring + slot.o, rows * layout_.o_row}};
    if (step.returns_lse()) outputs.emplace_back(ring + slot.lse, rows * layout_.lse_row);
    RETURN_IF_ERROR(Group(/*send=*/true, outputs));
    if (timed) {
      CUDA_RETURN_IF_ERROR(cudaEventRecord(events->sent.get(), compute));
      Profile::Add(profile_.recv_host_us, absl::ToDoubleMicroseconds(received - posted));
      Profile::Add(profile_.kernels_host_us, absl::ToDoubleMicroseconds(launched - received));
      Profile::Add(profile_.send_host_us, absl::ToDoubleMicroseconds(absl::Now() - launched));
      Profile::Add(profile_.ahead, ahead);
    }
    return absl::OkStatus();
  }();
  // Recorded even after a failed enqueue: the events are reused only once the work that was
  // enqueued has passed this point.
  const cudaError_t recorded = cudaEventRecord(events->layer.finished.get(), compute);
  if (status.ok() && recorded != cudaSuccess) {
    status = cuda::CudaErrorToStatus(recorded, "cudaEventRecord(finished)", __FILE__, __LINE__);
  }
  if (!status.ok() && status.code() != absl::StatusCode::kInternal) {
    // The communicator failed (not the device): the channel cannot go on.
    std::lock_guard state_lock(mu_);
    BreakLocked(status);
  }
  lane_.completions->Post(
      [this, active, layer, events, timed, status = std::move(status)]() mutable {
        Complete(active, layer, events, timed, std::move(status));
      });
}

void NcclChannel::Complete(const std::shared_ptr<ActiveStep>& active, int32_t layer,
                           WindowEvents* events, bool timed, absl::Status status) {
  const cudaError_t waited = cudaEventSynchronize(events->layer.finished.get());
  if (status.ok() && waited != cudaSuccess) {
    status = cuda::CudaErrorToStatus(waited, "cudaEventSynchronize(channel layer)", __FILE__,
                                     __LINE__);
  }
  if (status.ok() && timed) active->step->ReportChannelLayer(events->layer);
  if (status.ok() && timed && events->attended != nullptr) {
    Profile::Add(profile_.recv_gpu_us,
                 1e6 * ElapsedSeconds(events->posted, events->layer.started));
    Profile::Add(profile_.send_gpu_us, 1e6 * ElapsedSeconds(*events->attended, events->sent));
  }
  {
    std::lock_guard lock(mu_);
    // A layer that ended because the communicator was aborted under it did not run: its
    // receive may have been cut short.
    if (status.ok() && broken_) {
      status = absl::CancelledError(absl::StrCat("layer ", layer, " of channel step ",
                                                 active->sequence, " was cut short: ",
                                                 break_reason_.message()));
    } else if (!status.ok() && status.code() != absl::StatusCode::kInternal) {
      status = absl::CancelledError(status.message());
    }
    window_.CompleteLocked(active, layer, events);
  }
  wake_.notify_all();
  // May end the step (and destroy the CudaStep): nothing of it is touched after this.
  active->layer_done(layer, std::move(status));
}

}  // namespace attnd::cuda_backend
