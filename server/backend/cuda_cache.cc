#include "backend/cuda_cache.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "attnd/kernels/cuda/cuda_check.h"
#include "attnd/kernels/cuda/decode.h"
#include "attnd/kernels/cuda/mla_decode.h"
#include "attnd/kernels/cuda/pod.h"
#include "attnd/kernels/cuda/prefill.h"
#include "attnd/status_macros.h"
#include "backend/cuda_ipc_channel.h"
#include "backend/cuda_step.h"
#include "backend/nccl_channel.h"
#include "attnd/nccl/nccl_loader.h"
#include "backend/peer_access.h"
#include "channel/host_shm_channel.h"
#include "plan/decode_choice.h"
#include "plan/step_plan.h"

namespace attnd::cuda_backend {
namespace {

// The devices this process sees, as the CUDA runtime reports them.
class CudaTopology final : public DeviceTopology {
 public:
  std::optional<int> OrdinalOf(const std::string& pci_bus_id) const override {
    int ordinal = 0;
    if (cudaDeviceGetByPCIBusId(&ordinal, pci_bus_id.c_str()) != cudaSuccess) {
      cudaGetLastError();
      return std::nullopt;
    }
    return ordinal;
  }
  bool CanAccessPeer(int from, int to) const override {
    int can = 0;
    if (cudaDeviceCanAccessPeer(&can, from, to) != cudaSuccess) {
      cudaGetLastError();
      return false;
    }
    return can != 0;
  }
};

}  // namespace

CudaCache::CudaCache(const CacheGeometry& geometry, uint8_t* pool,
                     const CudaCacheOptions& options, BackendObserver* observer,
                     std::function<void()> release_pool)
    : geometry_(geometry),
      pool_(pool),
      options_(options),
      observer_(observer),
      release_pool_(std::move(release_pool)) {}

absl::StatusOr<std::unique_ptr<CudaCache>> CudaCache::Create(const CacheGeometry& geometry,
                                                             uint8_t* pool, int device,
                                                             const CudaCacheOptions& options,
                                                             BackendObserver* observer,
                                                             std::function<void()> release_pool) {
  std::unique_ptr<CudaCache> cache(
      new CudaCache(geometry, pool, options, observer, std::move(release_pool)));
  RETURN_IF_ERROR(cache->Init(device));
  return cache;
}

absl::Status Lane::CreateStreams() {
  RETURN_IF_ERROR(h2d.Create());
  RETURN_IF_ERROR(compute.Create());
  return d2h.Create();
}

absl::Status CudaCache::Init(int device) {
  const plan::PodMode pod_mode = options_.pod_mode;
  const plan::DecodeKernelChoice decode_kernel = options_.decode_kernel;
  device_ = device;
  int host_pointers = 0;
  CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(
      &host_pointers, cudaDevAttrCanUseHostPointerForRegisteredMem, device));
  host_pointers_on_device_ = host_pointers != 0;
  for (Lane& lane : lanes_) RETURN_IF_ERROR(lane.CreateStreams());
  RETURN_IF_ERROR(transfer_.Create());
  const cudaStream_t stream = lanes_[0].compute.get();
  // Zeroed so that a slot never written reads as 0 (as the CPU backend's calloc'd pools do).
  CUDA_RETURN_IF_ERROR(cudaMemsetAsync(pool_, 0, geometry_.PoolBytes(), stream));
  const std::vector<float> inv_freq = RopeInverseFrequencies(geometry_.rope);
  if (!inv_freq.empty()) {
    const int64_t bytes = static_cast<int64_t>(inv_freq.size() * sizeof(float));
    RETURN_IF_ERROR(rope_inv_freq_.Reserve(bytes));
    CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(rope_inv_freq_.data(), inv_freq.data(), bytes,
                                         cudaMemcpyHostToDevice, stream));
  }
  if (geometry_.mla) {
    // Every MLA row runs the MLA decode kernel (plan/step_plan.h); no MHA kernel is set up.
    ASSIGN_OR_RETURN(mla_ctas_per_wave_,
                     cuda::MlaDecodeCtasPerWave({geometry_.q_dtype, geometry_.kv_dtype,
                                                 geometry_.k_head_dim, geometry_.v_head_dim}));
  } else {
    const cuda::DecodeKernelConfig config{geometry_.q_dtype, geometry_.kv_dtype,
                                          geometry_.k_head_dim,
                                          geometry_.num_qo_heads / geometry_.num_kv_heads};
    decode_cuda_core_supported_ = cuda::DecodeSupports(config);
    if (decode_cuda_core_supported_) {
      ASSIGN_OR_RETURN(decode_ctas_per_wave_, cuda::DecodeCtasPerWave(config));
    }
    if (cuda::TensorCoreDecodeSupports(config)) {
      ASSIGN_OR_RETURN(decode_tensor_core_ctas_per_wave_, cuda::TensorCoreDecodeCtasPerWave(config));
      decode_tensor_core_supported_ = decode_tensor_core_ctas_per_wave_ > 0;
    }
    decode_kernel_choice_ = plan::EffectiveDecodeKernelChoice(
        decode_kernel, decode_cuda_core_supported_, decode_tensor_core_supported_);
    ASSIGN_OR_RETURN(prefill_ctas_per_wave_,
                     cuda::BatchPrefillCtasPerWave(geometry_.k_head_dim, geometry_.q_dtype,
                                                   geometry_.kv_dtype));
    // Mixed steps run side by side only where the prefill can be the Hopper kernel
    // (plan::SideBySidePrefillCtas): only then does a lane take the side stream (and a hardware
    // queue with it).
    if (options_.side_by_side && prefill_ctas_per_wave_.hopper_tile128 > 0) {
      for (Lane& lane : lanes_) RETURN_IF_ERROR(lane.side.Create(/*greatest_priority=*/true));
    }
    pod_mode_ = pod_mode;
    if (pod_mode_ != plan::PodMode::kOff) {
      ASSIGN_OR_RETURN(pod_ctas_per_wave_,
                       cuda::PodCtasPerWave(geometry_.k_head_dim, geometry_.q_dtype,
                                            geometry_.kv_dtype));
    }
  }
  // A fault here belongs to this cache's creation, not to its first step.
  CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
  for (Lane& lane : lanes_) {
    lane.completions = std::make_unique<CompletionQueue>([device] { cudaSetDevice(device); });
  }
  return absl::OkStatus();
}

CudaCache::~CudaCache() {
  // May run on any thread (the last reference can sit in a layer's callback): the cache's
  // device for the teardown, the thread's own again after it.
  int previous_device = device_;
  cudaGetDevice(&previous_device);
  cudaSetDevice(device_);
  // No layer is in flight (the engine's contract), so the queues are empty.
  for (Lane& lane : lanes_) {
    if (lane.completions) lane.completions->Shutdown();
    for (const CudaStream* stream : {&lane.h2d, &lane.compute, &lane.d2h}) {
      if (stream->get() != nullptr) cudaStreamSynchronize(stream->get());
    }
  }
  if (transfer_.get() != nullptr) cudaStreamSynchronize(transfer_.get());
  free_resources_.clear();
  if (release_pool_) release_pool_();
  cudaSetDevice(previous_device);
}

PagedKvView CudaCache::Pool(int32_t layer, bool v_pool) const {
  return geometry_.Pool(pool_, layer, v_pool);
}

absl::StatusOr<std::unique_ptr<StepResources>> CudaCache::TakeResources() {
  {
    std::lock_guard lock(resources_mu_);
    if (!free_resources_.empty()) {
      std::unique_ptr<StepResources> resources = std::move(free_resources_.back());
      free_resources_.pop_back();
      return resources;
    }
  }
  auto resources = std::make_unique<StepResources>();
  RETURN_IF_ERROR(resources->Init(options_.wait == CompletionWait::kBlockingSync));
  return resources;
}

void CudaCache::ReturnResources(std::unique_ptr<StepResources> resources) {
  if (resources == nullptr) return;
  std::lock_guard lock(resources_mu_);
  free_resources_.push_back(std::move(resources));
}

int CudaCache::PickLane() {
  // The lane with the fewest open steps; ties go round-robin.
  const uint32_t first = next_lane_.fetch_add(1, std::memory_order_relaxed);
  int best = static_cast<int>(first % kLanesPerCache);
  for (int i = 1; i < kLanesPerCache; ++i) {
    const int candidate = static_cast<int>((first + i) % kLanesPerCache);
    if (lanes_[candidate].open_steps.load() < lanes_[best].open_steps.load()) best = candidate;
  }
  return best;
}

absl::Status CudaCache::ReserveLane(Lane& lane, int64_t q_rotated_bytes, int64_t workspace_bytes) {
  std::lock_guard lock(lane.submit_mu);
  if (q_rotated_bytes <= lane.q_rotated.capacity() &&
      workspace_bytes <= lane.decode_workspace.capacity()) {
    return absl::OkStatus();
  }
  // Growing frees the old buffers, which queued layers may still use.
  CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(lane.compute.get()));
  RETURN_IF_ERROR(lane.q_rotated.Reserve(q_rotated_bytes));
  return lane.decode_workspace.Reserve(workspace_bytes);
}

absl::StatusOr<std::unique_ptr<BackendStep>> CudaCache::PrepareStep(
    std::shared_ptr<const StepBatch> batch) {
  return PrepareStepOn(std::move(batch), lanes_[PickLane()], /*channel_lane=*/false);
}

absl::StatusOr<std::unique_ptr<BackendChannel>> CudaCache::CreateChannel(
    const ChannelSpec& spec) {
  CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  if (spec.kind == ChannelKind::kCudaIpc) {
    // Checked before the ring is made: a client that cannot reach it learns why at once.
    if (!spec.client_pci_bus_id.empty()) {
      char ring_bus_id[64] = {};
      CUDA_RETURN_IF_ERROR(cudaDeviceGetPCIBusId(ring_bus_id, sizeof(ring_bus_id), device_));
      RETURN_IF_ERROR(
          CheckPeerAccess(spec.client_pci_bus_id, device_, ring_bus_id, CudaTopology()));
    }
    return CudaIpcChannel::Create(this, spec, device_);
  }
  if (spec.kind == ChannelKind::kNccl) {
    ASSIGN_OR_RETURN(const nccl::NcclLibrary* library, nccl::NcclLibrary::Shared());
    return NcclChannel::Create(this, spec, device_, library, options_.nccl_init_timeout);
  }
  HostShmChannel::DeviceHooks hooks;
  hooks.register_ring = [](void* ring, int64_t bytes) -> absl::Status {
    // Mapped: the device also writes the ring's done words (LayerIo::done_word).
    CUDA_RETURN_IF_ERROR(cudaHostRegister(ring, bytes, cudaHostRegisterMapped));
    return absl::OkStatus();
  };
  hooks.unregister_ring = [](void* ring) { cudaHostUnregister(ring); };
  return HostShmChannel::Create(geometry_, spec, std::move(hooks));
}

absl::StatusOr<std::unique_ptr<BackendStep>> CudaCache::PrepareChannelStep(
    std::shared_ptr<const StepBatch> batch, BackendChannel* channel) {
  if (auto* ipc = dynamic_cast<CudaIpcChannel*>(channel); ipc != nullptr) {
    return PrepareStepOn(std::move(batch), ipc->lane(), /*channel_lane=*/true);
  }
  if (auto* nccl = dynamic_cast<NcclChannel*>(channel); nccl != nullptr) {
    return PrepareStepOn(std::move(batch), nccl->lane(), /*channel_lane=*/true);
  }
  return PrepareStep(std::move(batch));
}

absl::StatusOr<std::unique_ptr<BackendStep>> CudaCache::PrepareStepOn(
    std::shared_ptr<const StepBatch> batch, Lane& lane, bool channel_lane) {
  // Callers' threads (gRPC, the engine) may have another device current.
  CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  plan::StepPlanContext context;
  context.geometry = &geometry_;
  context.decode_supported = decode_cuda_core_supported_ || decode_tensor_core_supported_;
  context.decode_cuda_core_supported = decode_cuda_core_supported_;
  context.decode_ctas_per_wave = decode_ctas_per_wave_;
  context.decode_tensor_core_supported = decode_tensor_core_supported_;
  context.decode_tensor_core_ctas_per_wave = decode_tensor_core_ctas_per_wave_;
  context.decode_kernel_choice = decode_kernel_choice_;
  context.prefill_ctas_per_wave = prefill_ctas_per_wave_;
  context.mla_ctas_per_wave = mla_ctas_per_wave_;
  context.pod_mode = pod_mode_;
  context.pod_ctas_per_wave = pod_ctas_per_wave_;
  ASSIGN_OR_RETURN(std::shared_ptr<const plan::StepPlan> plan, plans_.Get(*batch, context));

  const LayerSizes sizes = LayerSizes::Of(geometry_, batch->num_tokens, batch->options.return_lse);
  const int64_t prefill_work_offset = AlignUp(plan->offsets.total_bytes, kBufferAlignment);
  const int64_t prefill_work_bytes =
      plan->run_pod       ? cuda::PodWorkspaceBytes(plan->pod)
      : plan->run_prefill ? cuda::BatchPrefillWorkspaceBytes(plan->prefill)
                          : 0;
  const int64_t workspace_bytes =
      plan->run_mla      ? cuda::MlaDecodeWorkspaceBytes(plan->mla.num_partials,
                                                         geometry_.num_qo_heads,
                                                         geometry_.k_head_dim)
      : plan->run_decode ? cuda::BatchDecodeWorkspaceBytes(plan->decode.num_partials,
                                                           geometry_.num_qo_heads,
                                                           geometry_.k_head_dim)
                         : 0;
  const cudaStream_t stream = lane.compute.get();
  if (channel_lane) {
    // A channel's stream may sit on a ready word for as long as the client takes: never wait
    // for it. Outgrown buffers are kept (their queued users may still run) until the lane goes.
    std::lock_guard lock(lane.submit_mu);
    RETURN_IF_ERROR(lane.q_rotated.Reserve(sizes.q_bytes, &lane.retired));
    RETURN_IF_ERROR(lane.decode_workspace.Reserve(workspace_bytes, &lane.retired));
  } else {
    RETURN_IF_ERROR(ReserveLane(lane, sizes.q_bytes, workspace_bytes));
  }
  // Channel layers read and write the ring: no staging, no host outputs.
  if (!channel_lane) RETURN_IF_ERROR(outputs_->Reserve(kLayerSlotsPerStep, sizes.out_bytes));

  ASSIGN_OR_RETURN(std::unique_ptr<StepResources> resources, TakeResources());
  absl::Status status = [&]() -> absl::Status {
    // The previous owner's upload read host_arrays; usually long done.
    CUDA_RETURN_IF_ERROR(cudaEventSynchronize(resources->arrays_uploaded.get()));
    if (channel_lane) {
      // As the lane's own buffers above: a chained Plan runs while the channel's stream waits
      // for its client, so nothing may be freed here.
      std::lock_guard lock(lane.submit_mu);
      RETURN_IF_ERROR(resources->Reserve(LayerSizes(), prefill_work_offset + prefill_work_bytes,
                                         &lane.retired, &lane.retired_pinned));
    } else {
      RETURN_IF_ERROR(resources->Reserve(sizes, prefill_work_offset + prefill_work_bytes));
    }
    plan->Fill(*batch, resources->host_arrays.data());
    CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(resources->device_arrays.data(),
                                         resources->host_arrays.data(), plan->offsets.total_bytes,
                                         cudaMemcpyHostToDevice, stream));
    if (plan->run_prefill) {
      RETURN_IF_ERROR(cuda::UploadBatchPrefillPlan(
          plan->prefill, resources->device_arrays.data() + prefill_work_offset,
          prefill_work_bytes, stream));
    }
    if (plan->run_pod) {
      // The POD scheduler's counters sit in this step's workspace, used by one stream (the
      // lane's compute stream), zeroed there before each layer's launch.
      RETURN_IF_ERROR(cuda::UploadPodPlan(plan->pod,
                                          resources->device_arrays.data() + prefill_work_offset,
                                          prefill_work_bytes, stream));
    }
    CUDA_RETURN_IF_ERROR(cudaEventRecord(resources->arrays_uploaded.get(), stream));
    return absl::OkStatus();
  }();
  if (!status.ok()) {
    ReturnResources(std::move(resources));
    return status;
  }
  if (observer_ != nullptr) {
    observer_->OnTransfer("h2d", plan->offsets.total_bytes + prefill_work_bytes, device_);
  }
  return std::make_unique<CudaStep>(this, lane, std::move(batch), std::move(plan),
                                    std::move(resources), prefill_work_offset);
}

absl::Status CudaCache::ReadPages(int32_t layer, bool v_pool, int64_t first_page,
                                  std::span<uint8_t> bytes) {
  const int64_t page_bytes = v_pool ? geometry_.VPageBytes() : geometry_.KPageBytes();
  if (layer < 0 || layer >= geometry_.num_layers || first_page < 0 ||
      bytes.size() % page_bytes != 0 ||
      first_page + static_cast<int64_t>(bytes.size()) / page_bytes > geometry_.num_pages) {
    return absl::OutOfRangeError("ReadPages: layer or page range outside the pool");
  }
  if (bytes.empty()) return absl::OkStatus();
  CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  const uint8_t* pool = static_cast<const uint8_t*>(Pool(layer, v_pool).data);
  // After every layer already enqueued on any lane.
  for (Lane& lane : lanes_) CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(lane.compute.get()));
  CUDA_RETURN_IF_ERROR(cudaMemcpy(bytes.data(), pool + first_page * page_bytes, bytes.size(),
                                  cudaMemcpyDeviceToHost));
  return absl::OkStatus();
}

absl::Status CudaCache::EnqueuePageCopies(int32_t layer, std::span<const PageCopy> copies,
                                          cudaStream_t stream) const {
  for (const bool v_pool : {false, true}) {
    const int64_t page_bytes = v_pool ? geometry_.VPageBytes() : geometry_.KPageBytes();
    uint8_t* pool = static_cast<uint8_t*>(Pool(layer, v_pool).data);
    for (const PageCopy& copy : copies) {
      if (copy.source < 0 || copy.source >= geometry_.num_pages || copy.destination < 0 ||
          copy.destination >= geometry_.num_pages) {
        return absl::OutOfRangeError("page copy: page outside the pool");
      }
      CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(pool + copy.destination * page_bytes,
                                           pool + copy.source * page_bytes, page_bytes,
                                           cudaMemcpyDeviceToDevice, stream));
    }
  }
  return absl::OkStatus();
}

absl::Status CudaCache::CopyPages(int32_t layer, std::span<const PageCopy> copies) {
  if (layer < 0 || layer >= geometry_.num_layers) {
    return absl::OutOfRangeError("CopyPages: layer outside the cache");
  }
  std::lock_guard lock(transfer_mu_);
  CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  RETURN_IF_ERROR(EnqueuePageCopies(layer, copies, transfer_.get()));
  CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(transfer_.get()));
  return absl::OkStatus();
}

namespace {

// Calls copy(first_index, count) for each run of consecutive page ids in `pages`: one copy per
// run instead of one per page (a sequence's pages are mostly allocated in order).
template <typename CopyRun>
absl::Status ForEachPageRun(std::span<const int32_t> pages, CopyRun&& copy) {
  size_t first = 0;
  while (first < pages.size()) {
    size_t end = first + 1;
    while (end < pages.size() && pages[end] == pages[end - 1] + 1) ++end;
    RETURN_IF_ERROR(copy(first, end - first));
    first = end;
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CudaCache::ReadPageList(int32_t layer, bool v_pool, std::span<const int32_t> pages,
                                     std::span<uint8_t> bytes) {
  const int64_t page_bytes = v_pool ? geometry_.VPageBytes() : geometry_.KPageBytes();
  if (layer < 0 || layer >= geometry_.num_layers ||
      static_cast<int64_t>(bytes.size()) != static_cast<int64_t>(pages.size()) * page_bytes) {
    return absl::OutOfRangeError("ReadPageList: layer or byte count outside the cache");
  }
  for (const int32_t page : pages) {
    if (page < 0 || page >= geometry_.num_pages) {
      return absl::OutOfRangeError("ReadPageList: page outside the pool");
    }
  }
  const uint8_t* pool = static_cast<const uint8_t*>(Pool(layer, v_pool).data);
  std::lock_guard lock(transfer_mu_);
  CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  const cudaStream_t stream = transfer_.get();
  RETURN_IF_ERROR(ForEachPageRun(pages, [&](size_t first, size_t count) -> absl::Status {
    CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(bytes.data() + first * page_bytes,
                                         pool + pages[first] * page_bytes, count * page_bytes,
                                         cudaMemcpyDeviceToHost, stream));
    return absl::OkStatus();
  }));
  CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
  if (observer_ != nullptr) observer_->OnTransfer("d2h", static_cast<int64_t>(bytes.size()), device_);
  return absl::OkStatus();
}

absl::Status CudaCache::WritePageList(int32_t layer, bool v_pool, std::span<const int32_t> pages,
                                      std::span<const uint8_t> bytes) {
  const int64_t page_bytes = v_pool ? geometry_.VPageBytes() : geometry_.KPageBytes();
  if (layer < 0 || layer >= geometry_.num_layers ||
      static_cast<int64_t>(bytes.size()) != static_cast<int64_t>(pages.size()) * page_bytes) {
    return absl::OutOfRangeError("WritePageList: layer or byte count outside the cache");
  }
  for (const int32_t page : pages) {
    if (page < 0 || page >= geometry_.num_pages) {
      return absl::OutOfRangeError("WritePageList: page outside the pool");
    }
  }
  uint8_t* pool = static_cast<uint8_t*>(Pool(layer, v_pool).data);
  std::lock_guard lock(transfer_mu_);
  CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  const cudaStream_t stream = transfer_.get();
  RETURN_IF_ERROR(ForEachPageRun(pages, [&](size_t first, size_t count) -> absl::Status {
    CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(pool + pages[first] * page_bytes,
                                         bytes.data() + first * page_bytes, count * page_bytes,
                                         cudaMemcpyHostToDevice, stream));
    return absl::OkStatus();
  }));
  // Later steps run on the lanes' streams: the bytes must have landed before the import
  // commits (a synchronised stream orders before any later launch).
  CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
  if (observer_ != nullptr) observer_->OnTransfer("h2d", static_cast<int64_t>(bytes.size()), device_);
  return absl::OkStatus();
}

}  // namespace attnd::cuda_backend
