// CudaCache: one cache's pools in the CUDA backend's KV reservation, and everything its steps
// run with.
//
// Streams. A copy stream carries each layer's inputs host -> device; the compute stream waits
// for them, then runs the append, the attention kernels and the copy of the outputs back, and
// also carries the steps' array uploads and pool reads. Work of one cache is ordered on the
// compute stream; caches overlap one another, and a layer's input copy overlaps the previous
// layer's kernels.
//
// Buffers. The rotated q, the device outputs and the decode workspace are shared by the
// cache's layers (they are only touched by compute-stream work, which runs in order); staging
// and device inputs are per layer slot (cuda_step_resources.h). All grow at PrepareStep only.
//
// Completion. Every enqueued layer posts a task to the cache's completion thread, in enqueue
// order; the task waits on the layer's last event, copies o/lse to the caller's buffers, reports
// kernel times (from events recorded around each kernel) and bytes to the observer, and calls
// `done`. The gRPC thread never waits for the GPU.
//
// Thread safety: PrepareStep, ReadPages and steps' RunLayer may be called from any threads.
#pragma once

#include <functional>
#include <memory>
#include <mutex>
#include <vector>

#include "absl/status/statusor.h"
#include "backend/backend.h"
#include "backend/cuda_completion_queue.h"
#include "backend/cuda_memory.h"
#include "backend/cuda_step_resources.h"
#include "plan/prefill_plan.h"

namespace attnd::cuda_backend {

class CudaCache final : public BackendCache {
 public:
  // `pool` is geometry.PoolBytes() of device memory the cache uses until it is destroyed, when
  // it calls `release_pool`. The observer may be null and must outlive the cache.
  static absl::StatusOr<std::unique_ptr<CudaCache>> Create(const CacheGeometry& geometry,
                                                           uint8_t* pool, int device,
                                                           BackendObserver* observer,
                                                           std::function<void()> release_pool);
  ~CudaCache() override;

  const CacheGeometry& geometry() const override { return geometry_; }
  absl::StatusOr<std::unique_ptr<BackendStep>> PrepareStep(
      std::shared_ptr<const StepBatch> batch) override;
  absl::Status ReadPages(int32_t layer, bool v_pool, int64_t first_page,
                         std::span<uint8_t> bytes) override;

  // For the cache's steps (cuda_step.cc).
  PagedKvView Pool(int32_t layer, bool v_pool) const;
  cudaStream_t compute_stream() const { return compute_stream_.get(); }
  cudaStream_t copy_stream() const { return copy_stream_.get(); }
  const float* rope_inv_freq() const {
    return reinterpret_cast<const float*>(rope_inv_freq_.data());
  }
  BackendObserver* observer() const { return observer_; }
  CompletionQueue& completions() { return *completions_; }
  // Held while a layer's work is enqueued (and while the shared buffers grow), so that one
  // layer's launches and the posting of its completion are not interleaved with another's.
  std::mutex& submit_mutex() { return submit_mu_; }
  uint8_t* q_rotated() const { return q_rotated_.data(); }  // under submit_mutex()
  uint8_t* device_out() const { return device_out_.data(); }
  uint8_t* decode_workspace() const { return decode_workspace_.data(); }
  int64_t decode_workspace_bytes() const { return decode_workspace_.capacity(); }
  void ReturnResources(std::unique_ptr<StepResources> resources);

 private:
  CudaCache(const CacheGeometry& geometry, uint8_t* pool, BackendObserver* observer,
            std::function<void()> release_pool);
  absl::Status Init(int device);
  absl::StatusOr<std::unique_ptr<StepResources>> TakeResources();
  absl::Status ReserveShared(int64_t q_rotated_bytes, int64_t out_bytes, int64_t workspace_bytes);

  const CacheGeometry geometry_;
  uint8_t* const pool_;  // [layer][K pool, V pool] regions of num_pages pages each
  BackendObserver* const observer_;
  std::function<void()> release_pool_;

  CudaStream compute_stream_;
  CudaStream copy_stream_;
  DeviceBuffer rope_inv_freq_;  // [rotary_dim / 2] float
  bool decode_supported_ = false;
  int32_t decode_ctas_per_wave_ = 0;
  plan::PrefillWaveSizes prefill_ctas_per_wave_;

  std::mutex submit_mu_;
  DeviceBuffer q_rotated_;         // [T][Hq][D] q_dtype
  DeviceBuffer device_out_;        // o | lse, LayerSizes layout
  DeviceBuffer decode_workspace_;  // split-KV partials

  std::mutex resources_mu_;
  std::vector<std::unique_ptr<StepResources>> free_resources_;

  std::unique_ptr<CompletionQueue> completions_;
};

}  // namespace attnd::cuda_backend
