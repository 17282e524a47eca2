#include "backend/cuda_backend.h"

#include <cuda_runtime_api.h>

#include <cstdlib>
#include <mutex>
#include <optional>

#include "absl/strings/str_cat.h"
#include "attnd/kernels/cuda/cuda_check.h"
#include "attnd/kernels/cuda/mla_decode.h"
#include "attnd/status_macros.h"
#include "backend/cuda_cache.h"
#include "backend/cuda_memory.h"
#include "attnd/nccl/nccl_loader.h"
#include "plan/pod_choice.h"
#include "plan/range_allocator.h"
#include "util/log.h"

namespace attnd {
namespace {

using cuda_backend::CudaCache;
using plan::RangeAllocator;

// Kernels are loaded when the CUDA context is created rather than at their first launch (the
// runtime's default is lazy loading, which made the first layer of the first step take 5.5 ms
// on an H100). Read by the driver at initialisation, so before the first CUDA call; an operator's
// own CUDA_MODULE_LOADING wins.
void PreferEagerModuleLoading() { setenv("CUDA_MODULE_LOADING", "EAGER", /*overwrite=*/0); }

bool IsPowerOfTwo(int64_t value) { return value > 0 && (value & (value - 1)) == 0; }

// What the CUDA kernels take; the service validates most of this already, so a refusal here
// names the limit of this backend rather than of the API.
// MLA caches: one latent "head" (ckv in the K pool, kpe in the V pool), served by the MLA
// decode kernel for every row (plan/step_plan.h).
absl::Status CheckMlaSupported(const CacheGeometry& g) {
  auto unsupported = [](absl::string_view what) {
    return absl::UnimplementedError(
        absl::StrCat("the CUDA backend does not support MLA caches with ", what));
  };
  if (g.q_dtype != DType::kFloat16 && g.q_dtype != DType::kBFloat16) {
    return unsupported(absl::StrCat("q_dtype ", DTypeName(g.q_dtype), " (float16, bfloat16)"));
  }
  if (g.kv_dtype != DType::kFloat16 && g.kv_dtype != DType::kBFloat16 &&
      g.kv_dtype != DType::kFloat8E4M3) {
    return unsupported(absl::StrCat("kv_dtype ", DTypeName(g.kv_dtype),
                                    " (float16, bfloat16, float8_e4m3)"));
  }
  if (g.k_head_dim != 512 && g.k_head_dim != 256) {
    return unsupported(absl::StrCat("kv_lora_rank ", g.k_head_dim, " (512, 256)"));
  }
  if (g.v_head_dim != 64) return unsupported(absl::StrCat("rope_dim ", g.v_head_dim, " (64)"));
  if (!cuda::MlaDecodeSupports({g.q_dtype, g.kv_dtype, g.k_head_dim, g.v_head_dim})) {
    return unsupported(absl::StrCat("q_dtype ", DTypeName(g.q_dtype), ", kv_dtype ",
                                    DTypeName(g.kv_dtype), ", kv_lora_rank ", g.k_head_dim));
  }
  if (g.num_kv_heads != 1 || g.num_qo_heads < 1 || g.num_qo_heads > 1024) {
    return unsupported(absl::StrCat("num_qo_heads ", g.num_qo_heads, " (1..1024; one latent head)"));
  }
  if (!IsPowerOfTwo(g.page_size) || g.page_size > 128) {
    return unsupported(absl::StrCat("page_size ", g.page_size, " (a power of two up to 128)"));
  }
  if (g.rope.style != RopeStyle::kNone &&
      (g.rope.rotary_dim <= 0 || g.rope.rotary_dim % 2 != 0 || g.rope.rotary_dim > g.v_head_dim)) {
    return unsupported(absl::StrCat("rope.rotary_dim ", g.rope.rotary_dim, " (even, <= rope_dim)"));
  }
  if (g.num_pages <= 0 || g.num_layers <= 0) {
    return absl::InvalidArgumentError("the cache needs at least one layer and one page");
  }
  return absl::OkStatus();
}

absl::Status CheckSupported(const CacheGeometry& g) {
  if (g.mla) return CheckMlaSupported(g);
  auto unsupported = [](absl::string_view what) {
    return absl::UnimplementedError(absl::StrCat("the CUDA backend does not support ", what));
  };
  if (g.q_dtype != DType::kFloat16 && g.q_dtype != DType::kBFloat16) {
    return unsupported(absl::StrCat("q_dtype ", DTypeName(g.q_dtype), " (float16, bfloat16)"));
  }
  if (g.kv_dtype != DType::kFloat16 && g.kv_dtype != DType::kBFloat16 &&
      g.kv_dtype != DType::kFloat8E4M3) {
    return unsupported(absl::StrCat("kv_dtype ", DTypeName(g.kv_dtype),
                                    " (float16, bfloat16, float8_e4m3)"));
  }
  if ((g.k_head_dim != 64 && g.k_head_dim != 128 && g.k_head_dim != 256) ||
      g.v_head_dim != g.k_head_dim) {
    return unsupported(absl::StrCat("head_dim ", g.k_head_dim, " (64, 128, 256)"));
  }
  if (g.num_kv_heads <= 0 || g.num_qo_heads % g.num_kv_heads != 0) {
    return unsupported(absl::StrCat("num_qo_heads ", g.num_qo_heads, " with num_kv_heads ",
                                    g.num_kv_heads));
  }
  if (!IsPowerOfTwo(g.page_size) || g.page_size > 128) {
    return unsupported(absl::StrCat("page_size ", g.page_size, " (a power of two up to 128)"));
  }
  if (g.rope.style != RopeStyle::kNone &&
      (g.rope.rotary_dim <= 0 || g.rope.rotary_dim % 2 != 0 || g.rope.rotary_dim > g.k_head_dim)) {
    return unsupported(absl::StrCat("rotary_dim ", g.rope.rotary_dim));
  }
  if (g.num_pages <= 0 || g.num_layers <= 0) {
    return absl::InvalidArgumentError("the cache needs at least one layer and one page");
  }
  return absl::OkStatus();
}

// The KV reservation and its ranges. Shared by the backend and its caches: a cache can be
// destroyed on its own completion thread after the engine has let go of everything (the last
// reference to it can sit in a finished layer's callback), possibly after the backend.
class KvReservation {
 public:
  KvReservation(int device, uint8_t* base, int64_t bytes)
      : device_(device), base_(base), ranges_(bytes, cuda_backend::kBufferAlignment) {}
  ~KvReservation() {
    int previous_device = device_;
    cudaGetDevice(&previous_device);
    cudaSetDevice(device_);
    cudaFree(base_);
    cudaSetDevice(previous_device);
  }

  uint8_t* base() const { return base_; }
  int64_t capacity_bytes() const { return ranges_.capacity_bytes(); }
  int64_t FreeBytes() const {
    std::lock_guard lock(mu_);
    return ranges_.capacity_bytes() - used_bytes_;
  }
  absl::StatusOr<int64_t> Allocate(const CacheGeometry& geometry) {
    const int64_t bytes = geometry.PoolBytes();
    std::lock_guard lock(mu_);
    const std::optional<int64_t> offset = ranges_.Allocate(bytes);
    if (!offset.has_value()) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "the cache needs ", bytes, " bytes of KV memory (", geometry.num_pages, " pages of ",
          geometry.BytesPerPage(), " bytes) but ", ranges_.capacity_bytes() - used_bytes_,
          " of device ", device_, "'s CUDA KV budget (", ranges_.capacity_bytes(),
          " bytes, --kv_memory_bytes) are free, the largest free range ",
          ranges_.largest_free_range(), " bytes"));
    }
    used_bytes_ += bytes;
    return *offset;
  }
  void Free(int64_t offset, int64_t bytes) {
    std::lock_guard lock(mu_);
    ranges_.Free(offset, bytes);
    used_bytes_ -= bytes;
  }

 private:
  const int device_;
  uint8_t* const base_;
  mutable std::mutex mu_;
  RangeAllocator ranges_;
  // Pool bytes the caches asked for: ranges are rounded up, but the budget is reported
  // unrounded, as the CPU backend does.
  int64_t used_bytes_ = 0;
};

// One GPU the backend places caches on: its KV reservation and what GetServerInfo says of it.
struct CudaDevice {
  DeviceInfo info;
  std::shared_ptr<KvReservation> reservation;
};

class CudaBackend final : public Backend {
 public:
  static absl::StatusOr<std::unique_ptr<CudaBackend>> Create(const CudaBackendOptions& options);

  BackendInfo Info() const override { return info_; }
  int64_t KvFreeBytes() const override {
    int64_t free = 0;
    for (const CudaDevice& device : devices_) free += device.reservation->FreeBytes();
    return free;
  }
  int64_t KvFreeBytesOn(int32_t ordinal) const override {
    const CudaDevice* device = Find(ordinal);
    return device == nullptr ? 0 : device->reservation->FreeBytes();
  }
  absl::StatusOr<std::unique_ptr<BackendCache>> CreateCache(const CacheGeometry& geometry,
                                                            int32_t device) override;

 private:
  CudaBackend(const CudaBackendOptions& options, const BackendInfo& info,
              std::vector<CudaDevice> devices, cuda_backend::CompletionWait wait)
      : options_(options), info_(info), devices_(std::move(devices)), wait_(wait) {}

  const CudaDevice* Find(int32_t ordinal) const {
    for (const CudaDevice& device : devices_) {
      if (device.info.ordinal == ordinal) return &device;
    }
    return nullptr;
  }

  const CudaBackendOptions options_;
  const BackendInfo info_;
  const std::vector<CudaDevice> devices_;
  const cuda_backend::CompletionWait wait_;
};

absl::StatusOr<cuda_backend::CompletionWait> CompletionWaitOf(const CudaBackendOptions& options) {
  const std::string& name = options.completion_wait;
  if (name.empty() || name == "blocking") return cuda_backend::CompletionWait::kBlockingSync;
  if (name == "spin") return cuda_backend::CompletionWait::kSpin;
  return absl::InvalidArgumentError(
      absl::StrCat("CUDA completion wait: expected blocking or spin, got '", name, "'"));
}

// Reserves the KV budget of one device.
absl::StatusOr<CudaDevice> OpenDevice(const CudaBackendOptions& options, int ordinal) {
  CUDA_RETURN_IF_ERROR(cudaSetDevice(ordinal));
  cudaDeviceProp properties{};
  CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&properties, ordinal));
  size_t free_bytes = 0;
  size_t total_bytes = 0;
  CUDA_RETURN_IF_ERROR(cudaMemGetInfo(&free_bytes, &total_bytes));

  int64_t budget = options.kv_budget_bytes;
  if (budget <= 0) {
    if (!(options.kv_memory_fraction > 0.0 && options.kv_memory_fraction <= 1.0)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--kv_memory_fraction: expected a fraction in (0, 1], got ", options.kv_memory_fraction));
    }
    budget = static_cast<int64_t>(static_cast<double>(free_bytes) * options.kv_memory_fraction);
  }
  budget &= ~(cuda_backend::kBufferAlignment - 1);
  if (budget <= 0) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "device ", ordinal, ": KV budget of ", budget, " bytes is too small (the device has ",
        free_bytes, " bytes free)"));
  }
  void* reservation = nullptr;
  const cudaError_t error = cudaMalloc(&reservation, static_cast<size_t>(budget));
  if (error != cudaSuccess) {
    cudaGetLastError();
    return absl::ResourceExhaustedError(absl::StrCat(
        "device ", ordinal, ": reserving ", budget,
        " bytes of KV memory (--kv_memory_bytes / --kv_memory_fraction) failed: ",
        cudaGetErrorString(error), "; the device has ", free_bytes, " of ", total_bytes,
        " bytes free"));
  }
  CudaDevice device;
  device.info.ordinal = ordinal;
  device.info.name = properties.name;
  device.info.num_sms = properties.multiProcessorCount;
  device.info.memory_bytes = static_cast<int64_t>(properties.totalGlobalMem);
  device.info.kv_budget_bytes = budget;
  device.reservation =
      std::make_shared<KvReservation>(ordinal, static_cast<uint8_t*>(reservation), budget);
  return device;
}

absl::StatusOr<std::unique_ptr<CudaBackend>> CudaBackend::Create(
    const CudaBackendOptions& options) {
  ASSIGN_OR_RETURN(const cuda_backend::CompletionWait wait, CompletionWaitOf(options));
  PreferEagerModuleLoading();
  const int count = CudaDeviceCount();
  if (count == 0) {
    return absl::FailedPreconditionError("the CUDA backend needs a CUDA device; none is visible");
  }
  std::vector<int32_t> ordinals = options.devices;
  if (ordinals.empty()) {
    for (int ordinal = 0; ordinal < count; ++ordinal) ordinals.push_back(ordinal);
  }
  std::vector<CudaDevice> devices;
  for (size_t i = 0; i < ordinals.size(); ++i) {
    const int32_t ordinal = ordinals[i];
    if (ordinal < 0 || ordinal >= count) {
      return absl::InvalidArgumentError(absl::StrCat("--devices: device ", ordinal,
                                                     " is not visible (", count,
                                                     " CUDA device(s): 0..", count - 1, ")"));
    }
    for (size_t j = 0; j < i; ++j) {
      if (ordinals[j] == ordinal) {
        return absl::InvalidArgumentError(
            absl::StrCat("--devices: device ", ordinal, " is listed twice"));
      }
    }
    ASSIGN_OR_RETURN(CudaDevice device, OpenDevice(options, ordinal));
    devices.push_back(std::move(device));
  }
  // The first device stays current on this thread (as before: threads that never set one use
  // device 0's context).
  CUDA_RETURN_IF_ERROR(cudaSetDevice(ordinals[0]));

  BackendInfo info;
  info.name = "cuda";
  info.device = devices[0].info.name;
  info.num_sms = devices[0].info.num_sms;
  info.device_memory_bytes = devices[0].info.memory_bytes;
  for (const CudaDevice& device : devices) {
    info.kv_budget_bytes += device.info.kv_budget_bytes;
    info.devices.push_back(device.info);
  }
  info.extensions = {"mla", "fp8_kv", "deterministic", "separate_kv_index", "channel_host_shm", "channel_cuda_ipc"};
  // Mixed steps may run as one POD launch unless --pod=off (pod_choice.h).
  if (options.pod_mode != plan::PodMode::kOff) info.extensions.push_back("pod");
  // NCCL channels only where libnccl.so.2 loads (it is not a build dependency).
  if (absl::StatusOr<const nccl::NcclLibrary*> nccl = nccl::NcclLibrary::Shared(); nccl.ok()) {
    info.extensions.push_back("channel_nccl");
    LogInfo(absl::StrCat("NCCL ", (*nccl)->version(), " loaded: NCCL channels available"));
  } else {
    LogInfo(absl::StrCat("no NCCL channels: ", nccl.status().message()));
  }
  return std::unique_ptr<CudaBackend>(new CudaBackend(options, info, std::move(devices), wait));
}

absl::StatusOr<std::unique_ptr<BackendCache>> CudaBackend::CreateCache(
    const CacheGeometry& geometry, int32_t ordinal) {
  RETURN_IF_ERROR(CheckSupported(geometry));
  const CudaDevice* device = nullptr;
  if (ordinal == kAnyDevice) {
    // The device with the most free KV budget; ties go to the first listed.
    for (const CudaDevice& candidate : devices_) {
      if (device == nullptr ||
          candidate.reservation->FreeBytes() > device->reservation->FreeBytes()) {
        device = &candidate;
      }
    }
  } else {
    device = Find(ordinal);
    if (device == nullptr) {
      std::string served;
      for (const CudaDevice& candidate : devices_) {
        absl::StrAppend(&served, served.empty() ? "" : ", ", candidate.info.ordinal);
      }
      return absl::InvalidArgumentError(absl::StrCat(
          "device: this server places caches on device(s) ", served, " (--devices), not ",
          ordinal));
    }
  }
  const std::shared_ptr<KvReservation>& reservation = device->reservation;
  ASSIGN_OR_RETURN(const int64_t offset, reservation->Allocate(geometry));
  auto release = [reservation, offset, bytes = geometry.PoolBytes()] {
    reservation->Free(offset, bytes);
  };
  // The cache's streams, events and buffers belong to its device.
  CUDA_RETURN_IF_ERROR(cudaSetDevice(device->info.ordinal));
  cuda_backend::CudaCacheOptions cache_options;
  cache_options.wait = wait_;
  cache_options.pod_mode = options_.pod_mode;
  cache_options.decode_kernel = options_.decode_kernel;
  cache_options.channel_timing_stride = options_.channel_timing_stride;
  cache_options.channel_done_by_kernel = options_.channel_done_by_kernel;
  cache_options.host_shm_parts = options_.host_shm_parts;
  cache_options.side_by_side = options_.side_by_side;
  cache_options.nccl_init_timeout = options_.nccl_init_timeout;
  auto cache = CudaCache::Create(geometry, reservation->base() + offset, device->info.ordinal,
                                 cache_options, options_.observer, release);
  if (!cache.ok()) {  // the failed cache gave its range back
    return absl::Status(cache.status().code(),
                        absl::StrCat("set up the cache on GPU ", device->info.ordinal, ": ",
                                     cache.status().message()));
  }
  return std::unique_ptr<BackendCache>(std::move(cache).value());
}

}  // namespace

int CudaDeviceCount() {
  PreferEagerModuleLoading();
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return count;
}

std::string CudaUnavailableReason() {
  PreferEagerModuleLoading();
  int count = 0;
  const cudaError_t error = cudaGetDeviceCount(&count);
  if (error != cudaSuccess) {
    cudaGetLastError();
    return absl::StrCat("cudaGetDeviceCount: ", cudaGetErrorString(error), " (",
                        cudaGetErrorName(error), ")");
  }
  if (count == 0) return "cudaGetDeviceCount found no device";
  return "";
}

absl::StatusOr<std::unique_ptr<Backend>> MakeCudaBackend(const CudaBackendOptions& options) {
  ASSIGN_OR_RETURN(std::unique_ptr<CudaBackend> backend, CudaBackend::Create(options));
  return std::unique_ptr<Backend>(std::move(backend));
}

}  // namespace attnd
