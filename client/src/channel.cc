#include "attnd/client/channel.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "attnd/client/client.h"
#include "attnd/client/status.h"
#include "attnd/status_macros.h"
#include "channel_cuda.h"
#include "channel_nccl.h"
#include "nccl_wire.h"

namespace attnd::client {
namespace {

bool Reached(uint32_t flag, uint32_t sequence) {
  return static_cast<int32_t>(flag - sequence) >= 0;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Channel>> Channel::Open(Client& client, std::string_view cache,
                                                       const ChannelOptions& options) {
  if (options.cuda_device >= 0 && options.kind != attnd::v1::CHANNEL_KIND_HOST_SHM) {
    // Everything of the open happens on that GPU (the bus id sent, the mapping, the NCCL join);
    // the caller's current GPU is put back after.
    const int previous = internal::CurrentDevice();
    RETURN_IF_ERROR(internal::SetCurrentDevice(options.cuda_device));
    ChannelOptions on_current = options;
    on_current.cuda_device = -1;
    absl::StatusOr<std::unique_ptr<Channel>> opened = Open(client, cache, on_current);
    if (previous >= 0) internal::SetCurrentDevice(previous).IgnoreError();
    return opened;
  }
  // Refused before attnd makes a communicator that no one would join.
  if (options.kind == attnd::v1::CHANNEL_KIND_NCCL) RETURN_IF_ERROR(internal::NcclAvailable());
  std::unique_ptr<Channel> channel(new Channel());
  attnd::v1::OpenChannelRequest request;
  request.set_cache(std::string(cache));
  request.set_kind(options.kind);
  request.set_max_tokens(options.max_tokens);
  request.set_slots(options.slots);
  request.set_with_lse(options.with_lse);
  // attnd checks that this GPU reaches the ring (peer access) and refuses the channel if not.
  if (options.kind == attnd::v1::CHANNEL_KIND_CUDA_IPC) {
    request.set_client_pci_bus_id(internal::CurrentPciBusId());
  }
  // The call lives as long as the channel: no deadline.
  channel->call_ = client.NewContext(/*with_deadline=*/false);
  channel->reader_ = client.stub().OpenChannel(channel->call_.get(), request);
  attnd::v1::OpenChannelResponse first;
  if (!channel->reader_->Read(&first)) {
    absl::Status status = FromGrpcStatus(channel->reader_->Finish());
    channel->reader_.reset();
    if (status.ok()) status = absl::UnavailableError("OpenChannel ended without a channel");
    return status;
  }
  channel->info_ = first.channel();
  channel->host_spin_ = options.host_spin;
  absl::Status mapped = channel->Map();
  if (mapped.ok() && options.kind == attnd::v1::CHANNEL_KIND_CUDA_IPC) {
    channel->flag_kernels_ = options.stream_flags == ChannelOptions::StreamFlags::kKernels;
  }
  if (!mapped.ok()) {
    channel->call_->TryCancel();
    attnd::v1::OpenChannelResponse rest;
    while (channel->reader_->Read(&rest)) {
    }
    channel->reader_->Finish().error_code();
    channel->reader_.reset();
    return mapped;
  }
  channel->reader_thread_ = std::thread([raw = channel.get()] { raw->ReadUntilClosed(); });
  return channel;
}

void Channel::ReadUntilClosed() {
  attnd::v1::OpenChannelResponse message;
  std::string reason;
  while (reader_->Read(&message)) {
    if (!message.closed().empty()) reason = message.closed();
  }
  const grpc::Status status = reader_->Finish();
  if (reason.empty()) {
    reason = status.ok() ? "closed" : absl::StrCat("OpenChannel call ended: ",
                                                   status.error_message());
  }
  {
    std::lock_guard lock(mu_);
    closed_reason_ = reason;
    closed_ = true;
  }
  // attnd aborted its rank: NCCL kernels of ours still waiting on a stream for it must exit.
  if (nccl_ != nullptr) nccl_->Abort();
}

Channel::~Channel() {
  if (call_ != nullptr) call_->TryCancel();
  if (reader_thread_.joinable()) reader_thread_.join();
  Unmap();
}

std::string Channel::closed_reason() const {
  std::lock_guard lock(mu_);
  return closed_reason_;
}

absl::Status Channel::Map() {
  ring_bytes_ = info_.layout().ring_bytes();
  if (info_.kind() == attnd::v1::CHANNEL_KIND_NCCL) {
    ASSIGN_OR_RETURN(nccl_, internal::JoinNcclChannel(info_.nccl_unique_id(), info_.pci_bus_id(),
                                                      ring_bytes_));
    ring_ = nccl_->ring();
    cuda_device_ = nccl_->device();
    return absl::OkStatus();
  }
  if (info_.kind() == attnd::v1::CHANNEL_KIND_CUDA_IPC) {
    ASSIGN_OR_RETURN(ring_, internal::OpenIpcRing(info_.cuda_ipc_handle(), info_.pci_bus_id(),
                                                  &cuda_device_));
    return absl::OkStatus();
  }
  const int fd = shm_open(info_.shm_name().c_str(), O_RDWR, 0);
  if (fd < 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "shm_open(", info_.shm_name(), "): ", std::strerror(errno),
        " (HOST_SHM channels need the client on attnd's host, as the same user)"));
  }
  void* mapped = mmap(nullptr, ring_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int error = errno;
  close(fd);
  if (mapped == MAP_FAILED) {
    return absl::ResourceExhaustedError(absl::StrCat("mmap(", info_.shm_name(), "): ",
                                                     std::strerror(error)));
  }
  ring_ = static_cast<uint8_t*>(mapped);
  return absl::OkStatus();
}

bool Channel::device_ring() const {
  return info_.kind() == attnd::v1::CHANNEL_KIND_CUDA_IPC ||
         info_.kind() == attnd::v1::CHANNEL_KIND_NCCL;
}

void Channel::Unmap() {
  if (info_.kind() == attnd::v1::CHANNEL_KIND_NCCL) {
    nccl_.reset();  // aborts the communicator, then frees the local ring
    ring_ = nullptr;
    return;
  }
  if (ring_ == nullptr) return;
  if (info_.kind() == attnd::v1::CHANNEL_KIND_CUDA_IPC) {
    internal::CloseIpcRing(ring_, cuda_device_);
  } else {
    munmap(ring_, ring_bytes_);
  }
  ring_ = nullptr;
}

ChannelSlot Channel::Slot(int32_t layer) const {
  const attnd::v1::ChannelLayout& layout = info_.layout();
  const attnd::v1::ChannelSlotLayout& slot = layout.slots(layer % layout.slots_size());
  auto at = [&](int64_t offset, int64_t row_bytes) -> void* {
    return row_bytes > 0 ? ring_ + offset : nullptr;
  };
  ChannelSlot out;
  out.q = at(slot.q_offset(), layout.q_row_bytes());
  out.k = at(slot.k_offset(), layout.k_row_bytes());
  out.v = at(slot.v_offset(), layout.v_row_bytes());
  out.q_pe = at(slot.q_pe_offset(), layout.q_pe_row_bytes());
  out.ckv = at(slot.ckv_offset(), layout.ckv_row_bytes());
  out.kpe = at(slot.kpe_offset(), layout.kpe_row_bytes());
  out.o = at(slot.o_offset(), layout.o_row_bytes());
  out.lse = static_cast<float*>(at(slot.lse_offset(), layout.lse_row_bytes()));
  return out;
}

uint32_t Channel::ReadFlag(int64_t offset) const {
  if (info_.kind() == attnd::v1::CHANNEL_KIND_CUDA_IPC) {
    return internal::ReadDeviceFlag(ring_ + offset);
  }
  return std::atomic_ref<uint32_t>(*reinterpret_cast<uint32_t*>(ring_ + offset))
      .load(std::memory_order_acquire);
}

void Channel::WriteFlag(int64_t offset, uint32_t value) {
  if (info_.kind() == attnd::v1::CHANNEL_KIND_CUDA_IPC) {
    internal::WriteDeviceFlag(ring_ + offset, value);
    return;
  }
  auto* word = reinterpret_cast<uint32_t*>(ring_ + offset);
  std::atomic_ref<uint32_t>(*word).store(value, std::memory_order_release);
  syscall(SYS_futex, word, FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

void Channel::SetReady(int32_t layer, uint32_t sequence) {
  if (info_.kind() == attnd::v1::CHANNEL_KIND_NCCL) return;  // the send group is the signal
  WriteFlag(info_.layout().ready_offsets(layer), sequence);
}

bool Channel::Aborted(uint32_t sequence) const {
  // NCCL: an aborted step closes the channel (closed_reason says so).
  if (info_.kind() == attnd::v1::CHANNEL_KIND_NCCL) return false;
  const uint32_t aborted = ReadFlag(info_.layout().aborted_offset());
  return aborted != 0 && Reached(aborted, sequence);
}

absl::Status Channel::WaitDone(int32_t layer, uint32_t sequence, absl::Duration timeout) {
  if (info_.kind() == attnd::v1::CHANNEL_KIND_NCCL) {
    return absl::FailedPreconditionError(
        "WaitDone: NCCL channels have no done words; ExchangeOnStream receives o on a stream");
  }
  const int64_t offset = info_.layout().done_offsets(layer);
  const auto start = std::chrono::steady_clock::now();
  const auto deadline = start + absl::ToChronoNanoseconds(timeout);
  const bool host = info_.kind() != attnd::v1::CHANNEL_KIND_CUDA_IPC;
  for (;;) {
    const uint32_t seen = ReadFlag(offset);
    if (Reached(seen, sequence)) {
      if (Aborted(sequence)) {
        return absl::AbortedError(absl::StrCat("channel step ", sequence,
                                               " was aborted by attnd; o means nothing"));
      }
      return absl::OkStatus();
    }
    const auto now = std::chrono::steady_clock::now();
    if (closed_) {
      return absl::UnavailableError(absl::StrCat("channel closed: ", closed_reason()));
    }
    if (now >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat("done[", layer, "] did not reach ",
                                                      sequence, " within ",
                                                      absl::FormatDuration(timeout)));
    }
    if (now - start < absl::ToChronoNanoseconds(host_spin_)) continue;  // spin first
    if (host) {
      timespec slice{0, 1000000};  // 1 ms, re-checking the deadline and the channel
      syscall(SYS_futex, reinterpret_cast<uint32_t*>(ring_ + offset), FUTEX_WAIT, seen, &slice,
              nullptr, 0);
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }
}

absl::Status Channel::CopyIn(void* slot_tensor, const void* host, int64_t bytes) {
  if (device_ring()) {
    return internal::CopyDevice(slot_tensor, host, bytes, /*to_device=*/true);
  }
  std::memcpy(slot_tensor, host, bytes);
  return absl::OkStatus();
}

absl::Status Channel::CopyOut(void* host, const void* slot_tensor, int64_t bytes) const {
  if (device_ring()) {
    return internal::CopyDevice(host, slot_tensor, bytes, /*to_device=*/false);
  }
  std::memcpy(host, slot_tensor, bytes);
  return absl::OkStatus();
}

absl::Status Channel::SetReadyOnStream(int32_t layer, uint32_t sequence, void* stream) {
  if (info_.kind() != attnd::v1::CHANNEL_KIND_CUDA_IPC) {
    return absl::FailedPreconditionError("SetReadyOnStream: only CUDA_IPC channels");
  }
  uint8_t* ready = ring_ + info_.layout().ready_offsets(layer);
  if (flag_kernels_) return internal::StreamSignalFlag(stream, ready, sequence);
  return internal::StreamWriteFlag(stream, ready, sequence);
}

uint32_t* Channel::ReadyWord(int32_t layer) const {
  if (info_.kind() != attnd::v1::CHANNEL_KIND_CUDA_IPC || layer < 0 ||
      layer >= info_.layout().ready_offsets_size()) {
    return nullptr;
  }
  return reinterpret_cast<uint32_t*>(ring_ + info_.layout().ready_offsets(layer));
}

absl::Status Channel::WaitDoneOnStream(int32_t layer, uint32_t sequence, void* stream) {
  return WaitDoneOnStream(layer, sequence, stream, ChannelOptions::StreamFlags::kDefault);
}

absl::Status Channel::WaitDoneOnStream(int32_t layer, uint32_t sequence, void* stream,
                                       ChannelOptions::StreamFlags flags) {
  if (info_.kind() != attnd::v1::CHANNEL_KIND_CUDA_IPC) {
    return absl::FailedPreconditionError("WaitDoneOnStream: only CUDA_IPC channels");
  }
  uint8_t* done = ring_ + info_.layout().done_offsets(layer);
  const bool poll = flags == ChannelOptions::StreamFlags::kDefault
                        ? flag_kernels_
                        : flags == ChannelOptions::StreamFlags::kKernels;
  if (poll) {
    return internal::StreamPollFlag(stream, done, sequence);
  }
  return internal::StreamWaitFlag(stream, done, sequence);
}

absl::Status Channel::ExchangeOnStream(int32_t layer, int64_t rows, bool return_lse,
                                       const ChannelSlot& tensors, void* stream) {
  if (info_.kind() != attnd::v1::CHANNEL_KIND_NCCL || nccl_ == nullptr) {
    return absl::FailedPreconditionError("ExchangeOnStream: only NCCL channels");
  }
  ASSIGN_OR_RETURN(const internal::NcclLayerBuffers buffers,
                   internal::NcclLayerBuffersOf(info_, rows, return_lse, tensors));
  std::lock_guard lock(exchange_mu_);
  if (layer != next_exchange_layer_) {
    // Enqueued out of order, the layer's bytes would pair with another layer's receives.
    return absl::FailedPreconditionError(absl::StrCat(
        "ExchangeOnStream: layer ", layer, " out of order; attnd takes layer ",
        next_exchange_layer_, " next (layers 0..", info_.layout().ready_offsets_size() - 1,
        " of each step, in order)"));
  }
  if (closed_) {
    return absl::UnavailableError(absl::StrCat("channel closed: ", closed_reason()));
  }
  RETURN_IF_ERROR(nccl_->Exchange(buffers, stream));
  next_exchange_layer_ = (layer + 1) % std::max(1, info_.layout().ready_offsets_size());
  return absl::OkStatus();
}

}  // namespace attnd::client
