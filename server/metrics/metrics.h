// The attnd_ metric families (DESIGN 5) on a prometheus-cpp registry, plus the running totals
// GetStats reports. Thread-safe; every method is cheap enough for the per-layer path.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "backend/backend.h"

namespace prometheus {
class Registry;
class Counter;
class Gauge;
class Histogram;
template <typename T>
class Family;
}  // namespace prometheus

namespace attnd {

struct KernelTotals {
  std::string kernel;
  std::string phase;
  int64_t count = 0;
  double total_seconds = 0;
};

struct StatsSnapshot {
  std::vector<KernelTotals> kernels;  // sorted by (kernel, phase)
  int64_t steps_committed = 0;
  int64_t steps_aborted = 0;
  int64_t tokens_prefill = 0;
  int64_t tokens_decode = 0;
};

class Metrics : public BackendObserver {
 public:
  struct BuildInfo {
    std::string version;
    std::string backend;
    std::string device;
  };
  // With `cache_labels` false (tenants configured, see --metrics_cache_labels) the per-cache
  // gauges carry cache="" and sum over every cache, so /metrics names no cache.
  explicit Metrics(const BuildInfo& build_info, bool cache_labels = true);
  ~Metrics() override;

  std::shared_ptr<prometheus::Registry> registry() const { return registry_; }

  // BackendObserver.
  // attnd_kernel_duration_seconds{kernel, device}, attnd_transfer_bytes_total{direction,
  // device}.
  void OnKernel(std::string_view kernel, std::string_view phase, double seconds,
                int32_t device) override;
  void OnTransfer(std::string_view direction, int64_t bytes, int32_t device) override;

  // method is the RPC's short name ("Plan"); code its final status.
  void ObserveRpc(std::string_view method, absl::StatusCode code, double seconds);
  void ObservePlan(double seconds, int64_t decode_tokens, int64_t prefill_tokens);
  void StepEnded(bool committed, int64_t decode_tokens, int64_t prefill_tokens);
  void SetCachePages(const std::string& cache, int64_t used_pages, int64_t free_pages);
  void RemoveCache(const std::string& cache);
  // Channels (DESIGN 3b): how many are open, and the layer bytes they carried.
  // attnd_device_kv_bytes{device, state}: one device's KV budget, held by caches or free. The
  // first call for a device also creates its kernel and transfer series (zeros, not gaps).
  void SetDeviceKvBytes(int32_t device, int64_t used_bytes, int64_t free_bytes);
  void SetOpenChannels(size_t open);
  void ChannelBytes(std::string_view kind, int64_t bytes_in, int64_t bytes_out);

  StatsSnapshot Snapshot() const;

 private:
  prometheus::Histogram& KernelHistogram(std::string_view kernel, const std::string& device);
  void PublishCachePages(const std::string& label, int64_t used_pages, int64_t free_pages);
  void PublishAggregateLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const bool cache_labels_;

  std::shared_ptr<prometheus::Registry> registry_;
  prometheus::Family<prometheus::Histogram>* kernel_duration_;
  prometheus::Family<prometheus::Histogram>* rpc_duration_;
  prometheus::Family<prometheus::Counter>* rpc_requests_;
  prometheus::Histogram* plan_duration_;
  prometheus::Family<prometheus::Histogram>* batch_tokens_;
  prometheus::Family<prometheus::Counter>* tokens_total_;
  prometheus::Family<prometheus::Gauge>* kv_pages_;
  prometheus::Family<prometheus::Gauge>* kv_usage_;
  prometheus::Family<prometheus::Counter>* transfer_bytes_;
  prometheus::Family<prometheus::Counter>* errors_;
  prometheus::Family<prometheus::Gauge>* device_kv_bytes_;
  prometheus::Gauge* channels_open_;
  prometheus::Family<prometheus::Counter>* channel_bytes_;

  mutable absl::Mutex mu_;
  std::map<std::pair<std::string, std::string>, std::pair<int64_t, double>> kernel_totals_
      ABSL_GUARDED_BY(mu_);
  int64_t steps_committed_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t steps_aborted_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t tokens_prefill_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t tokens_decode_ ABSL_GUARDED_BY(mu_) = 0;
  // Without cache labels: (used, free) pages per cache, summed into the cache="" series.
  std::map<std::string, std::pair<int64_t, int64_t>> cache_pages_ ABSL_GUARDED_BY(mu_);
};

// Lower-case snake name of a status code ("invalid_argument"), the error_type label.
std::string_view StatusCodeLabel(absl::StatusCode code);

}  // namespace attnd
