// CudaCache: one cache's pools in the CUDA backend's KV reservation, and everything its steps
// run with.
//
// Lanes. A cache has kLanesPerCache lanes; each step runs on one (the lane with the fewest open
// steps, chosen at PrepareStep), so micro-batches of one cache (steps of disjoint sequences
// that a client pipelines) run their kernels concurrently on different lanes. A lane has three
// streams: H2D carries each layer's inputs to the device, compute waits for them and runs the
// append and the attention kernels, D2H waits for those and copies the outputs back. So a
// layer's input copy overlaps the previous layer's kernels, whose output copy overlaps the
// next layer's kernels. Steps of one lane, and the layers of one step, are ordered on its
// compute stream, which also carries the steps' array uploads.
//
// Buffers. The rotated q and the decode workspace belong to a lane (only its compute stream
// touches them, in order); staging, device inputs and outputs to a layer slot
// (cuda_step_resources.h); host outputs come from the OutputPool and may be lent beyond the
// step. All grow at PrepareStep only (the pool also when a lent buffer is still out).
//
// Completion. Every enqueued layer posts its slot to its lane's completion thread, in enqueue
// order; the thread waits for the layer's last event (CompletionWait), then lends or copies the
// outputs, reports kernel times (from events recorded around each kernel) and bytes to the
// observer, and calls `done`. The gRPC thread never waits for the GPU.
//
// Thread safety: PrepareStep, ReadPages and steps' RunLayer may be called from any threads;
// each makes the cache's device current on its thread first (a host may serve several GPUs).
#pragma once

#include <array>
#include <atomic>
#include <functional>
#include <memory>
#include <mutex>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "backend/backend.h"
#include "backend/cuda_completion_queue.h"
#include "backend/cuda_memory.h"
#include "backend/cuda_output_pool.h"
#include "backend/cuda_plan_cache.h"
#include "backend/cuda_step_resources.h"
#include "plan/decode_plan.h"
#include "plan/pod_choice.h"
#include "plan/pod_plan.h"
#include "plan/prefill_plan.h"

namespace attnd::cuda_backend {

// How a completion thread waits for a layer's outputs to reach the host. The default sleeps:
// spinning burns a core per lane (two per cache) for a wake-up that is small next to the wire's
// latency; spin stays selectable (--cuda_completion=spin) to measure the difference.
enum class CompletionWait {
  kBlockingSync,  // cudaEventSynchronize on a cudaEventBlockingSync event: the thread sleeps
  kSpin,          // cudaEventSynchronize on a default event: the thread spins
};

inline constexpr int kLanesPerCache = 2;

// What the backend's options (attnd's flags) set in every cache.
struct CudaCacheOptions {
  CompletionWait wait = CompletionWait::kBlockingSync;
  plan::PodMode pod_mode = plan::PodMode::kAuto;
  plan::DecodeKernelChoice decode_kernel = plan::DecodeKernelChoice::kAuto;
  // CUDA_IPC channels time the kernels of one layer in this many (1: every layer, 0: none;
  // attnd's --channel_kernel_timing): a timing event costs ~2 us of the stream under MPS.
  int32_t channel_timing_stride = 16;
  // CUDA_IPC channels: a decode-only layer's last kernel sets the layer's done word itself
  // (cuda::GridSignal) instead of a stream memory operation after it (attnd's
  // --channel_done_by_kernel).
  bool channel_done_by_kernel = false;
  // A HOST_SHM channel's decode layer runs in this many parts of its rows (attnd's
  // --host_shm_parts; CudaStep::EnqueueInParts).
  int32_t host_shm_parts = 2;
  // Whether the cache's lanes get the side stream of mixed steps side by side (Lane::side).
  bool side_by_side = true;
  // How long an NCCL channel waits for its peer to join before it closes (issue 19; attnd's
  // --nccl_init_timeout).
  absl::Duration nccl_init_timeout = absl::Seconds(60);
};

struct Lane {
  CudaStream h2d;
  CudaStream compute;
  CudaStream d2h;
  // A cache's lanes only (channel lanes keep one stream each), where the Hopper prefill runs
  // (CudaCache::Init): a mixed step's prefill runs here, at the device's greatest stream
  // priority, beside its decode on `compute` (StepPlan::side_by_side_prefill_ctas).
  CudaStream side;
  // Held while a layer's work is enqueued (and while the lane's buffers grow), so that one
  // layer's launches and the posting of its completion are not interleaved with another's.
  std::mutex submit_mu;
  DeviceBuffer q_rotated;         // [T][Hq][D] q_dtype (MLA: q_pe [T][H][rope_dim]); under submit_mu
  DeviceBuffer decode_workspace;  // split-KV partials (MHA decode or MLA)
  std::atomic<int32_t> open_steps{0};
  std::unique_ptr<CompletionQueue> completions;
  // A channel lane's outgrown buffers (and those of the step resources its steps took), freed
  // when the lane goes (under submit_mu): device memory, and pinned host memory.
  std::vector<uint8_t*> retired;
  std::vector<uint8_t*> retired_pinned;

  absl::Status CreateStreams();
};

class CudaCache final : public BackendCache {
 public:
  // `pool` is geometry.PoolBytes() of device memory the cache uses until it is destroyed, when
  // it calls `release_pool`. The observer may be null and must outlive the cache.
  static absl::StatusOr<std::unique_ptr<CudaCache>> Create(const CacheGeometry& geometry,
                                                           uint8_t* pool, int device,
                                                           const CudaCacheOptions& options,
                                                           BackendObserver* observer,
                                                           std::function<void()> release_pool);
  ~CudaCache() override;

  const CacheGeometry& geometry() const override { return geometry_; }
  int32_t device() const override { return device_; }
  absl::StatusOr<std::unique_ptr<BackendStep>> PrepareStep(
      std::shared_ptr<const StepBatch> batch) override;
  absl::Status ReadPages(int32_t layer, bool v_pool, int64_t first_page,
                         std::span<uint8_t> bytes) override;
  absl::StatusOr<std::unique_ptr<BackendChannel>> CreateChannel(const ChannelSpec& spec) override;
  absl::StatusOr<std::unique_ptr<BackendStep>> PrepareChannelStep(
      std::shared_ptr<const StepBatch> batch, BackendChannel* channel) override;
  // Sequence lifecycle transfers, on the cache's transfer stream, each waited for.
  absl::Status CopyPages(int32_t layer, std::span<const PageCopy> copies) override;
  absl::Status ReadPageList(int32_t layer, bool v_pool, std::span<const int32_t> pages,
                            std::span<uint8_t> bytes) override;
  absl::Status WritePageList(int32_t layer, bool v_pool, std::span<const int32_t> pages,
                             std::span<const uint8_t> bytes) override;
  // Enqueues one layer's copy-on-write (K and V of each copy) on `stream`, ahead of the
  // append that writes the destination pages. Page ids come from the engine's allocator.
  absl::Status EnqueuePageCopies(int32_t layer, std::span<const PageCopy> copies,
                                 cudaStream_t stream) const;

  // For the cache's steps (cuda_step.cc).
  PagedKvView Pool(int32_t layer, bool v_pool) const;
  const float* rope_inv_freq() const {
    return reinterpret_cast<const float*>(rope_inv_freq_.data());
  }
  BackendObserver* observer() const { return observer_; }
  CompletionWait completion_wait() const { return options_.wait; }
  int32_t channel_timing_stride() const { return options_.channel_timing_stride; }
  bool channel_done_by_kernel() const { return options_.channel_done_by_kernel; }
  int32_t host_shm_parts() const { return options_.host_shm_parts; }
  // Whether the device reaches registered host memory (a HOST_SHM ring) at its host address
  // (cudaDevAttrCanUseHostPointerForRegisteredMem), so stream operations may name it.
  bool host_pointers_on_device() const { return host_pointers_on_device_; }
  absl::Duration nccl_init_timeout() const { return options_.nccl_init_timeout; }
  OutputPool& outputs() { return *outputs_; }
  Lane& lane(int index) { return lanes_[index]; }
  void ReturnResources(std::unique_ptr<StepResources> resources);

 private:
  // A step on `lane` (one of lanes_, or a CUDA_IPC channel's own lane).
  absl::StatusOr<std::unique_ptr<BackendStep>> PrepareStepOn(
      std::shared_ptr<const StepBatch> batch, Lane& lane, bool channel_lane);

  CudaCache(const CacheGeometry& geometry, uint8_t* pool, const CudaCacheOptions& options,
            BackendObserver* observer, std::function<void()> release_pool);
  absl::Status Init(int device);
  absl::StatusOr<std::unique_ptr<StepResources>> TakeResources();
  int PickLane();
  absl::Status ReserveLane(Lane& lane, int64_t q_rotated_bytes, int64_t workspace_bytes);

  const CacheGeometry geometry_;
  uint8_t* const pool_;  // [layer][K pool, V pool] regions of num_pages pages each
  const CudaCacheOptions options_;
  int device_ = 0;
  bool host_pointers_on_device_ = false;
  BackendObserver* const observer_;
  std::function<void()> release_pool_;

  std::array<Lane, kLanesPerCache> lanes_;
  std::atomic<uint32_t> next_lane_{0};
  DeviceBuffer rope_inv_freq_;  // [rotary_dim / 2] float
  bool decode_cuda_core_supported_ = false;
  int32_t decode_ctas_per_wave_ = 0;
  bool decode_tensor_core_supported_ = false;
  int32_t decode_tensor_core_ctas_per_wave_ = 0;
  // CudaBackendOptions::decode_kernel, reduced to a kernel the cache has (decode_choice.h)
  plan::DecodeKernelChoice decode_kernel_choice_ = plan::DecodeKernelChoice::kAuto;
  plan::PrefillWaveSizes prefill_ctas_per_wave_;
  plan::PodMode pod_mode_ = plan::PodMode::kOff;  // CudaBackendOptions::pod_mode (pod_choice.h)
  plan::PodWaveSizes pod_ctas_per_wave_;
  int32_t mla_ctas_per_wave_ = 0;  // MLA caches only

  // Export/import and late copy-on-write copies; one transfer at a time (transfer_mu_).
  std::mutex transfer_mu_;
  CudaStream transfer_;

  PlanCache plans_;
  std::shared_ptr<OutputPool> outputs_ = OutputPool::Create();

  std::mutex resources_mu_;
  std::vector<std::unique_ptr<StepResources>> free_resources_;
};

}  // namespace attnd::cuda_backend
