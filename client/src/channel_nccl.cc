// Client NCCL channels with CUDA: libnccl.so.2 through the loader attnd uses too
// (attnd/nccl/nccl_loader.h), a blocking rank-1 join, and per layer two NCCL groups on the
// caller's stream. The communicator is blocking (attnd's is not): a layer's calls only enqueue
// work, and the join happens inside Channel::Open, which may block anyway.
#include "channel_nccl.h"

#include <cuda_runtime_api.h>

#include <cstring>
#include <mutex>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "attnd/nccl/nccl_loader.h"
#include "channel_cuda.h"

namespace attnd::client::internal {
namespace {

using nccl::ncclResult_t;
using nccl::ncclSuccess;

// Makes `device` current for the scope (NCCL enqueues on the current device's context), and
// puts the caller's back after.
class ScopedDevice {
 public:
  explicit ScopedDevice(int device) {
    if (cudaGetDevice(&previous_) == cudaSuccess && previous_ != device) {
      cudaSetDevice(device);
    } else {
      previous_ = -1;
    }
  }
  ~ScopedDevice() {
    if (previous_ >= 0) cudaSetDevice(previous_);
  }
  ScopedDevice(const ScopedDevice&) = delete;
  ScopedDevice& operator=(const ScopedDevice&) = delete;

 private:
  int previous_ = -1;
};

class CudaNcclPeer final : public NcclPeer {
 public:
  CudaNcclPeer(const nccl::NcclLibrary* nccl, int device) : nccl_(nccl), device_(device) {}

  ~CudaNcclPeer() override {
    Abort();
    if (ring_ != nullptr) {
      ScopedDevice scoped(device_);
      cudaFree(ring_);  // waits for work still using it (the aborted NCCL kernels have exited)
    }
  }

  absl::Status Init(const std::string& unique_id, const std::string& attnd_pci_bus_id,
                    int64_t ring_bytes) {
    if (unique_id.size() != nccl::kUniqueIdBytes) {
      return absl::InvalidArgumentError(absl::StrCat("nccl_unique_id: expected ",
                                                     nccl::kUniqueIdBytes, " bytes, got ",
                                                     unique_id.size()));
    }
    void* ring = nullptr;
    if (const cudaError_t error = cudaMalloc(&ring, static_cast<size_t>(ring_bytes));
        error != cudaSuccess) {
      cudaGetLastError();
      return absl::ResourceExhaustedError(absl::StrCat(
          "cudaMalloc of the NCCL channel's local ring (", ring_bytes,
          " bytes): ", cudaGetErrorString(error)));
    }
    ring_ = static_cast<uint8_t*>(ring);
    // Zeroed, as attnd's: a receive cut short leaves zeros, not stale memory.
    if (const cudaError_t error = cudaMemset(ring_, 0, static_cast<size_t>(ring_bytes));
        error != cudaSuccess) {
      return absl::InternalError(absl::StrCat("cudaMemset: ", cudaGetErrorString(error)));
    }
    nccl::ncclUniqueId id;
    std::memcpy(id.internal, unique_id.data(), sizeof(id.internal));
    nccl::ncclComm_t comm = nullptr;
    const ncclResult_t result =
        nccl_->api().CommInitRank(&comm, nccl::kChannelRanks, id, nccl::kClientRank);
    if (result != ncclSuccess) {
      std::string message = absl::StrCat(
          nccl_->Describe("ncclCommInitRank (rank 1 of the channel's communicator)", result));
      const std::string own_bus_id = CurrentPciBusId();
      if (!own_bus_id.empty() &&
          absl::AsciiStrToLower(own_bus_id) == absl::AsciiStrToLower(attnd_pci_bus_id)) {
        return absl::FailedPreconditionError(absl::StrCat(
            message, "; this process's current GPU (", own_bus_id,
            ") is attnd's, and NCCL cannot join two ranks on one GPU: open a CUDA_IPC channel, "
            "or make another GPU current"));
      }
      return absl::UnavailableError(absl::StrCat(
          message, " (attnd gives up on a peer that does not join within --nccl_init_timeout)"));
    }
    comm_ = comm;
    return absl::OkStatus();
  }

  uint8_t* ring() const override { return ring_; }
  int device() const override { return device_; }

  absl::Status Exchange(const NcclLayerBuffers& buffers, void* stream) override {
    const nccl::NcclApi& api = nccl_->api();
    auto* cuda_stream = static_cast<CUstream_st*>(stream);
    ScopedDevice scoped(device_);
    // Held while enqueueing: Abort (the reader thread, when attnd closes the channel) must not
    // free the communicator under a call.
    std::lock_guard lock(mu_);
    if (comm_ == nullptr) {
      return absl::UnavailableError("the NCCL channel's communicator was aborted (the channel "
                                    "closed)");
    }
    // Two groups, as attnd's receive group and send group: the sends pair with its receives of
    // the layer's inputs, the receives with its sends of o (and lse) after the kernels.
    for (const bool send : {true, false}) {
      const std::vector<NcclBuffer>& list = send ? buffers.sends : buffers.receives;
      if (list.empty()) continue;
      ncclResult_t result = api.GroupStart();
      for (const NcclBuffer& buffer : list) {
        if (result != ncclSuccess) break;
        const size_t count = static_cast<size_t>(buffer.bytes);
        result = send ? api.Send(buffer.data, count, nccl::ncclUint8, nccl::kAttndRank, comm_,
                                 cuda_stream)
                      : api.Recv(buffer.data, count, nccl::ncclUint8, nccl::kAttndRank, comm_,
                                 cuda_stream);
      }
      // Ended even after a failed call: a group left open would swallow the next one.
      const ncclResult_t ended = api.GroupEnd();
      if (result == ncclSuccess) result = ended;
      if (result != ncclSuccess) {
        return absl::UnavailableError(
            nccl_->Describe(send ? "ncclSend group (q/k/v to attnd)"
                                 : "ncclRecv group (o/lse from attnd)",
                            result));
      }
    }
    return absl::OkStatus();
  }

  void Abort() override {
    std::lock_guard lock(mu_);
    if (comm_ == nullptr) return;
    ScopedDevice scoped(device_);
    // Not ncclCommDestroy: that may wait for a peer that is gone.
    nccl_->api().CommAbort(comm_);
    comm_ = nullptr;
  }

 private:
  const nccl::NcclLibrary* const nccl_;
  const int device_;
  uint8_t* ring_ = nullptr;
  std::mutex mu_;
  nccl::ncclComm_t comm_ = nullptr;  // guarded by mu_; null once aborted
};

}  // namespace

absl::Status NcclAvailable() {
  const absl::StatusOr<const nccl::NcclLibrary*> library = nccl::NcclLibrary::Shared();
  if (library.ok()) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "CHANNEL_KIND_NCCL: ", library.status().message(),
      "; install NCCL >= 2.14 where the loader finds it (LD_LIBRARY_PATH), or open a HOST_SHM "
      "or CUDA_IPC channel"));
}

absl::StatusOr<std::unique_ptr<NcclPeer>> JoinNcclChannel(const std::string& unique_id,
                                                          const std::string& attnd_pci_bus_id,
                                                          int64_t ring_bytes) {
  const absl::StatusOr<const nccl::NcclLibrary*> library = nccl::NcclLibrary::Shared();
  if (!library.ok()) return NcclAvailable();
  int device = 0;
  if (const cudaError_t error = cudaGetDevice(&device); error != cudaSuccess) {
    cudaGetLastError();
    return absl::FailedPreconditionError(
        absl::StrCat("cudaGetDevice: ", cudaGetErrorString(error),
                     " (an NCCL channel needs a GPU in this process)"));
  }
  auto peer = std::make_unique<CudaNcclPeer>(*library, device);
  if (absl::Status joined = peer->Init(unique_id, attnd_pci_bus_id, ring_bytes); !joined.ok()) {
    return joined;
  }
  return peer;
}

}  // namespace attnd::client::internal
