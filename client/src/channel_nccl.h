// The client's side of CHANNEL_KIND_NCCL channels (channel_nccl.cc with CUDA; channel_no_cuda.cc
// refuses them): rank 1 of the channel's 2-rank communicator, which attnd created as rank 0,
// and a ring of the channel's layout in this process's device memory, so Channel::Slot has
// somewhere to point (nothing is shared with attnd: the tensors travel by ncclSend/ncclRecv).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "nccl_wire.h"

namespace attnd::client::internal {

// OK when this client can drive NCCL channels: libnccl.so.2 (>= 2.14) loads. Otherwise
// FAILED_PRECONDITION with the loader's reason, or UNIMPLEMENTED in a build without CUDA.
// Channel::Open asks before it opens anything on attnd.
absl::Status NcclAvailable();

class NcclPeer {
 public:
  virtual ~NcclPeer() = default;  // aborts the communicator and frees the ring
  // The local ring (device memory of device(), zeroed) and the device of the communicator.
  virtual uint8_t* ring() const = 0;
  virtual int device() const = 0;
  // Enqueues on `stream` (a cudaStream_t of device()) one group of ncclSend of `sends`, then
  // one group of ncclRecv into `receives`, in list order, with attnd's rank: the mirror of
  // NcclChannel::Enqueue's receive group and send group. UNAVAILABLE once aborted.
  virtual absl::Status Exchange(const NcclLayerBuffers& buffers, void* stream) = 0;
  // Aborts the communicator (any thread, more than once): NCCL kernels of it still waiting on a
  // stream exit, and later Exchanges answer UNAVAILABLE. For when attnd closed the channel.
  virtual void Abort() = 0;
};

// Joins the communicator of `unique_id` (ChannelInfo.nccl_unique_id) as rank 1 from this
// thread's current CUDA device, blocking until attnd's rank is there too, and allocates a
// `ring_bytes` local ring on that device. `attnd_pci_bus_id` (ChannelInfo.pci_bus_id) only
// explains a failure: NCCL cannot join two ranks on one GPU.
absl::StatusOr<std::unique_ptr<NcclPeer>> JoinNcclChannel(const std::string& unique_id,
                                                          const std::string& attnd_pci_bus_id,
                                                          int64_t ring_bytes);

}  // namespace attnd::client::internal
