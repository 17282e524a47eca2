#include "backend/cpu_backend.h"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <fstream>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "attnd/status_macros.h"
#include "channel/host_shm_channel.h"
#include "reference/append.h"
#include "reference/attention.h"

namespace attnd {
namespace {

// A FIFO of tasks on a fixed set of threads.
class WorkerPool {
 public:
  explicit WorkerPool(int num_threads) {
    for (int i = 0; i < num_threads; ++i) threads_.emplace_back([this] { Loop(); });
  }
  ~WorkerPool() {
    {
      std::lock_guard lock(mu_);
      stopping_ = true;
    }
    ready_.notify_all();
    for (auto& thread : threads_) thread.join();
  }
  void Post(std::function<void()> task) {
    {
      std::lock_guard lock(mu_);
      tasks_.push_back(std::move(task));
    }
    ready_.notify_one();
  }

 private:
  void Loop() {
    for (;;) {
      std::function<void()> task;
      {
        std::unique_lock lock(mu_);
        ready_.wait(lock, [this] { return stopping_ || !tasks_.empty(); });
        if (tasks_.empty()) return;  // stopping, and every posted task has run
        task = std::move(tasks_.front());
        tasks_.pop_front();
      }
      task();
    }
  }

  std::mutex mu_;
  std::condition_variable ready_;
  std::deque<std::function<void()>> tasks_;
  bool stopping_ = false;
  std::vector<std::thread> threads_;
};

struct FreeDeleter {
  void operator()(uint8_t* bytes) const { std::free(bytes); }
};

// Pool storage: [layer][K pool, V pool] regions of num_pages pages each. Zeroed (calloc) so a
// slot never written reads as 0, not as a NaN pattern.
class CpuCache final : public BackendCache {
 public:
  CpuCache(const CacheGeometry& geometry, uint8_t* storage, std::atomic<int64_t>* budget_used,
           int32_t device, WorkerPool* workers, BackendObserver* observer)
      : geometry_(geometry),
        storage_(storage),
        budget_used_(budget_used),
        device_(device),
        workers_(workers),
        observer_(observer),
        inv_freq_(RopeInverseFrequencies(geometry.rope)) {}
  ~CpuCache() override { budget_used_->fetch_sub(geometry_.PoolBytes()); }

  const CacheGeometry& geometry() const override { return geometry_; }
  int32_t device() const override { return device_; }

  absl::StatusOr<std::unique_ptr<BackendStep>> PrepareStep(
      std::shared_ptr<const StepBatch> batch) override;

  absl::StatusOr<std::unique_ptr<BackendChannel>> CreateChannel(
      const ChannelSpec& spec) override {
    if (spec.kind != ChannelKind::kHostShm) {
      return absl::UnimplementedError(absl::StrCat(
          "kind: ", ChannelKindName(spec.kind),
          " channels need the cuda backend; this server runs the cpu backend (use HOST_SHM)"));
    }
    return HostShmChannel::Create(geometry_, spec, {});
  }

  absl::Status ReadPages(int32_t layer, bool v_pool, int64_t first_page,
                         std::span<uint8_t> bytes) override {
    const int64_t page_bytes = v_pool ? geometry_.VPageBytes() : geometry_.KPageBytes();
    if (layer < 0 || layer >= geometry_.num_layers || first_page < 0 ||
        bytes.size() % page_bytes != 0 ||
        first_page + static_cast<int64_t>(bytes.size()) / page_bytes > geometry_.num_pages) {
      return absl::OutOfRangeError("ReadPages: layer or page range outside the pool");
    }
    const uint8_t* pool = static_cast<const uint8_t*>(Pool(layer, v_pool).data);
    std::memcpy(bytes.data(), pool + first_page * page_bytes, bytes.size());
    return absl::OkStatus();
  }

  absl::Status CopyPages(int32_t layer, std::span<const PageCopy> copies) override {
    if (layer < 0 || layer >= geometry_.num_layers) {
      return absl::OutOfRangeError("CopyPages: layer outside the cache");
    }
    for (const PageCopy& copy : copies) {
      if (!ValidPage(copy.source) || !ValidPage(copy.destination)) {
        return absl::OutOfRangeError("CopyPages: page outside the pool");
      }
    }
    CopyLayerPages(layer, copies);
    return absl::OkStatus();
  }

  absl::Status ReadPageList(int32_t layer, bool v_pool, std::span<const int32_t> pages,
                            std::span<uint8_t> bytes) override {
    const int64_t page_bytes = v_pool ? geometry_.VPageBytes() : geometry_.KPageBytes();
    RETURN_IF_ERROR(CheckPageList(layer, pages, static_cast<int64_t>(bytes.size()), page_bytes));
    const uint8_t* pool = static_cast<const uint8_t*>(Pool(layer, v_pool).data);
    for (size_t i = 0; i < pages.size(); ++i) {
      std::memcpy(bytes.data() + i * page_bytes, pool + pages[i] * page_bytes, page_bytes);
    }
    return absl::OkStatus();
  }

  absl::Status WritePageList(int32_t layer, bool v_pool, std::span<const int32_t> pages,
                             std::span<const uint8_t> bytes) override {
    const int64_t page_bytes = v_pool ? geometry_.VPageBytes() : geometry_.KPageBytes();
    RETURN_IF_ERROR(CheckPageList(layer, pages, static_cast<int64_t>(bytes.size()), page_bytes));
    uint8_t* pool = static_cast<uint8_t*>(Pool(layer, v_pool).data);
    for (size_t i = 0; i < pages.size(); ++i) {
      std::memcpy(pool + pages[i] * page_bytes, bytes.data() + i * page_bytes, page_bytes);
    }
    return absl::OkStatus();
  }

  // Copy-on-write of one layer: each copy's K and V page bytes, source to destination.
  void CopyLayerPages(int32_t layer, std::span<const PageCopy> copies) const {
    for (const bool v_pool : {false, true}) {
      const int64_t page_bytes = v_pool ? geometry_.VPageBytes() : geometry_.KPageBytes();
      uint8_t* pool = static_cast<uint8_t*>(Pool(layer, v_pool).data);
      for (const PageCopy& copy : copies) {
        std::memcpy(pool + copy.destination * page_bytes, pool + copy.source * page_bytes,
                    page_bytes);
      }
    }
  }

  PagedKvView Pool(int32_t layer, bool v_pool) const {
    return geometry_.Pool(storage_.get(), layer, v_pool);
  }

  WorkerPool* workers() const { return workers_; }

 private:
  bool ValidPage(int32_t page) const { return page >= 0 && page < geometry_.num_pages; }
  absl::Status CheckPageList(int32_t layer, std::span<const int32_t> pages, int64_t bytes,
                             int64_t page_bytes) const {
    if (layer < 0 || layer >= geometry_.num_layers) {
      return absl::OutOfRangeError("page list: layer outside the cache");
    }
    if (bytes != static_cast<int64_t>(pages.size()) * page_bytes) {
      return absl::OutOfRangeError("page list: byte count is not one page per id");
    }
    for (const int32_t page : pages) {
      if (!ValidPage(page)) return absl::OutOfRangeError("page list: page outside the pool");
    }
    return absl::OkStatus();
  }

 public:
  BackendObserver* observer() const { return observer_; }
  std::span<const float> inv_freq() const { return inv_freq_; }

 private:
  CacheGeometry geometry_;
  std::unique_ptr<uint8_t, FreeDeleter> storage_;
  std::atomic<int64_t>* budget_used_;
  int32_t device_;
  WorkerPool* workers_;
  BackendObserver* observer_;
  std::vector<float> inv_freq_;
};

double SecondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

class CpuStep final : public BackendStep {
 public:
  CpuStep(CpuCache* cache, std::shared_ptr<const StepBatch> batch)
      : cache_(cache), batch_(std::move(batch)) {}

  std::string_view KernelName() const override {
    if (batch_->phase == StepPhase::kEmpty) return "none";
    if (cache_->geometry().mla) {
      return batch_->phase == StepPhase::kDecode ? "mla_decode" : "mla_prefill";
    }
    return batch_->phase == StepPhase::kDecode ? "decode" : "prefill";
  }

  void RunLayer(const LayerIo& io, DoneCallback done) override {
    // The task holds what it needs by value: the step object may be gone when it finishes.
    cache_->workers()->Post([cache = cache_, batch = batch_, io, kernel = KernelName(),
                             done = std::move(done)] {
      MarkStage(io.trace, LayerTrace::kStaged);
      MarkStage(io.trace, LayerTrace::kEnqueued);
      Run(*cache, *batch, io, kernel);
      MarkStage(io.trace, LayerTrace::kDeviceDone);
      MarkStage(io.trace, LayerTrace::kCopiedOut);
      done(absl::OkStatus());
    });
  }

 private:
  static void Run(const CpuCache& cache, const StepBatch& batch, const LayerIo& io,
                  std::string_view kernel);

  CpuCache* cache_;
  std::shared_ptr<const StepBatch> batch_;
};

// Outputs lent to the caller (LayerIo::lease): one heap block, freed on release.
struct LentOutputs {
  std::vector<uint8_t> o;
  std::vector<float> lse;
  static void Release(void* arg) { delete static_cast<LentOutputs*>(arg); }
};

void CpuStep::Run(const CpuCache& cache, const StepBatch& batch, const LayerIo& given,
                  std::string_view kernel) {
  const CacheGeometry& g = cache.geometry();
  const int64_t tokens = batch.num_tokens;
  LayerIo io = given;
  const int64_t element = DTypeBytes(g.q_dtype);
  if (io.o == nullptr && io.lease != nullptr) {
    auto* lent = new LentOutputs;
    lent->o.resize(tokens * g.num_qo_heads * g.k_head_dim * element);
    if (batch.options.return_lse) lent->lse.resize(tokens * g.num_qo_heads);
    io.o = lent->o.data();
    io.lse = batch.options.return_lse ? lent->lse.data() : nullptr;
    io.lease->o = lent->o.data();
    io.lease->lse = io.lse;
    io.lease->release = &LentOutputs::Release;
    io.lease->release_arg = lent;
  }
  if (tokens == 0) return;
  // Inputs given as pieces (a message's slices) are gathered: the reference reads them whole.
  std::vector<uint8_t> gathered[6];
  // q (MLA: q_nope) is [T][Hq][k_head_dim].
  io.q = LayerIo::Input(io.q, io.q_bytes)
             .Contiguous(tokens * g.num_qo_heads * g.k_head_dim * element, gathered[0]);
  if (!g.mla) {
    io.k = LayerIo::Input(io.k, io.k_bytes)
               .Contiguous(tokens * g.num_kv_heads * g.k_head_dim * element, gathered[1]);
    io.v = LayerIo::Input(io.v, io.v_bytes)
               .Contiguous(tokens * g.num_kv_heads * g.v_head_dim * element, gathered[2]);
  } else {
    io.q_pe = LayerIo::Input(io.q_pe, io.q_pe_bytes)
                  .Contiguous(tokens * g.num_qo_heads * g.v_head_dim * element, gathered[3]);
    io.ckv = LayerIo::Input(io.ckv, io.ckv_bytes)
                 .Contiguous(tokens * g.k_head_dim * element, gathered[4]);
    io.kpe = LayerIo::Input(io.kpe, io.kpe_bytes)
                 .Contiguous(tokens * g.v_head_dim * element, gathered[5]);
  }
  const PageTableView pages = batch.PageTable(g.page_size);
  const std::string_view phase = StepPhaseName(batch.phase);
  const int32_t q_dim = g.mla ? g.v_head_dim : g.k_head_dim;  // the rotated part of q
  std::vector<uint8_t> rotated_q(tokens * g.num_qo_heads * q_dim * DTypeBytes(g.q_dtype));

  auto start = std::chrono::steady_clock::now();
  // Copy-on-write before the append: this layer's shared partial pages into their fresh copies.
  cache.CopyLayerPages(io.layer, batch.page_copies);
  if (!g.mla) {
    reference::AppendArgs append;
    append.tokens = batch.AppendIndex();
    append.pages = pages;
    append.rope_style = g.rope.style;
    append.rope_inv_freq = cache.inv_freq();
    append.q_in = RowsOf(io.q, g.q_dtype, tokens, g.num_qo_heads, g.k_head_dim);
    append.q_out = RowsOf(rotated_q.data(), g.q_dtype, tokens, g.num_qo_heads, g.k_head_dim);
    append.k_in = RowsOf(io.k, g.q_dtype, tokens, g.num_kv_heads, g.k_head_dim);
    append.v_in = RowsOf(io.v, g.q_dtype, tokens, g.num_kv_heads, g.v_head_dim);
    append.k_cache = cache.Pool(io.layer, false);
    append.v_cache = cache.Pool(io.layer, true);
    append.k_scale = g.k_scale;
    append.v_scale = g.v_scale;
    reference::AppendKv(append);
  } else {
    reference::MlaAppendArgs append;
    append.tokens = batch.AppendIndex();
    append.pages = pages;
    append.rope_style = g.rope.style;
    append.rope_inv_freq = cache.inv_freq();
    append.q_pe_in = RowsOf(io.q_pe, g.q_dtype, tokens, g.num_qo_heads, g.v_head_dim);
    append.q_pe_out = RowsOf(rotated_q.data(), g.q_dtype, tokens, g.num_qo_heads, g.v_head_dim);
    append.ckv_in = RowsOf(io.ckv, g.q_dtype, tokens, 1, g.k_head_dim);
    append.kpe_in = RowsOf(io.kpe, g.q_dtype, tokens, 1, g.v_head_dim);
    append.ckv_cache = cache.Pool(io.layer, false);
    append.kpe_cache = cache.Pool(io.layer, true);
    append.ckv_scale = g.k_scale;
    append.kpe_scale = g.v_scale;
    reference::AppendMla(append);
  }
  if (cache.observer()) cache.observer()->OnKernel("append", "append", SecondsSince(start), cache.device());

  start = std::chrono::steady_clock::now();
  if (!g.mla) {
    reference::BatchAttentionArgs attention;
    attention.q = RowsOf(rotated_q.data(), g.q_dtype, tokens, g.num_qo_heads, g.k_head_dim);
    attention.qo_indptr = batch.qo_indptr.data();
    attention.pages = pages;
    attention.k_cache = cache.Pool(io.layer, false);
    attention.v_cache = cache.Pool(io.layer, true);
    attention.params = batch.options.params;
    attention.o = RowsOf(io.o, g.q_dtype, tokens, g.num_qo_heads, g.v_head_dim);
    attention.lse = io.lse;
    reference::BatchAttention(attention);
  } else {
    reference::MlaAttentionArgs attention;
    attention.q_nope = RowsOf(io.q, g.q_dtype, tokens, g.num_qo_heads, g.k_head_dim);
    attention.q_pe = RowsOf(rotated_q.data(), g.q_dtype, tokens, g.num_qo_heads, g.v_head_dim);
    attention.qo_indptr = batch.qo_indptr.data();
    attention.pages = pages;
    attention.ckv_cache = cache.Pool(io.layer, false);
    attention.kpe_cache = cache.Pool(io.layer, true);
    attention.params = batch.options.params;
    attention.o = RowsOf(io.o, g.q_dtype, tokens, g.num_qo_heads, g.k_head_dim);
    attention.lse = io.lse;
    reference::MlaAttention(attention);
  }
  if (cache.observer()) cache.observer()->OnKernel(kernel, phase, SecondsSince(start), cache.device());
}

absl::StatusOr<std::unique_ptr<BackendStep>> CpuCache::PrepareStep(
    std::shared_ptr<const StepBatch> batch) {
  return std::make_unique<CpuStep>(this, std::move(batch));
}

std::string CpuModelName() {
  std::ifstream cpuinfo("/proc/cpuinfo");
  std::string line;
  while (std::getline(cpuinfo, line)) {
    if (line.rfind("model name", 0) == 0) {
      const size_t colon = line.find(':');
      if (colon != std::string::npos && colon + 2 <= line.size()) return line.substr(colon + 2);
    }
  }
  return "cpu";
}

class CpuBackend final : public Backend {
 public:
  explicit CpuBackend(const CpuBackendOptions& options)
      : options_(options),
        workers_(options.num_workers > 0
                     ? options.num_workers
                     : std::max(2u, std::thread::hardware_concurrency())) {
    const std::vector<int32_t> ordinals =
        options.devices.empty() ? std::vector<int32_t>{0} : options.devices;
    for (const int32_t ordinal : ordinals) {
      devices_.push_back(std::make_unique<Device>());
      devices_.back()->ordinal = ordinal;
    }
  }

  BackendInfo Info() const override {
    BackendInfo info;
    info.name = "cpu";
    info.device = CpuModelName();
    info.kv_budget_bytes = options_.kv_budget_bytes * static_cast<int64_t>(devices_.size());
    info.extensions = {"mla", "fp8_kv", "deterministic", "separate_kv_index", "channel_host_shm"};
    for (const auto& device : devices_) {
      info.devices.push_back({device->ordinal, info.device, 0, 0, options_.kv_budget_bytes});
    }
    return info;
  }

  int64_t KvFreeBytes() const override {
    int64_t free = 0;
    for (const auto& device : devices_) free += options_.kv_budget_bytes - device->used.load();
    return free;
  }

  int64_t KvFreeBytesOn(int32_t ordinal) const override {
    const Device* device = Find(ordinal);
    return device == nullptr ? 0 : options_.kv_budget_bytes - device->used.load();
  }

  absl::StatusOr<std::unique_ptr<BackendCache>> CreateCache(const CacheGeometry& geometry,
                                                            int32_t ordinal) override {
    Device* device = nullptr;
    if (ordinal == kAnyDevice) {
      // The device with the most free budget; ties go to the first listed.
      for (const auto& candidate : devices_) {
        if (device == nullptr || candidate->used.load() < device->used.load()) {
          device = candidate.get();
        }
      }
    } else {
      device = Find(ordinal);
      if (device == nullptr) return absl::InvalidArgumentError(UnknownDevice(ordinal));
    }
    const int64_t bytes = geometry.PoolBytes();
    int64_t used = device->used.load();
    do {
      if (used + bytes > options_.kv_budget_bytes) {
        return absl::ResourceExhaustedError(absl::StrCat(
            "the cache needs ", bytes, " bytes but ", options_.kv_budget_bytes - used,
            " of device ", device->ordinal, "'s KV budget (", options_.kv_budget_bytes,
            " bytes) are free"));
      }
    } while (!device->used.compare_exchange_weak(used, used + bytes));
    auto* storage = static_cast<uint8_t*>(std::calloc(static_cast<size_t>(bytes), 1));
    if (storage == nullptr) {
      device->used.fetch_sub(bytes);
      return absl::ResourceExhaustedError(absl::StrCat("host allocation of ", bytes, " bytes failed"));
    }
    return std::make_unique<CpuCache>(geometry, storage, &device->used, device->ordinal,
                                      &workers_, options_.observer);
  }

 private:
  // A pretend device: only a KV budget of its own.
  struct Device {
    int32_t ordinal = 0;
    std::atomic<int64_t> used{0};
  };

  Device* Find(int32_t ordinal) const {
    for (const auto& device : devices_) {
      if (device->ordinal == ordinal) return device.get();
    }
    return nullptr;
  }

  std::string UnknownDevice(int32_t ordinal) const {
    std::string served;
    for (const auto& device : devices_) {
      absl::StrAppend(&served, served.empty() ? "" : ", ", device->ordinal);
    }
    return absl::StrCat("device: this server places caches on device(s) ", served, " (--devices), not ",
                        ordinal);
  }

  CpuBackendOptions options_;
  std::vector<std::unique_ptr<Device>> devices_;
  WorkerPool workers_;
};

}  // namespace

std::unique_ptr<Backend> MakeCpuBackend(const CpuBackendOptions& options) {
  return std::make_unique<CpuBackend>(options);
}

}  // namespace attnd
