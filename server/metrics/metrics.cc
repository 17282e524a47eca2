#include "metrics/metrics.h"

#include <prometheus/counter.h>
#include <prometheus/family.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>

namespace attnd {
namespace {

// 1-2-5 steps from 5 us to 10 s: kernels of a few microseconds and multi-second prefills both
// land in a bucket of their own decade. Written out, not computed: 1e-6 * 5 is not 5e-6 in
// binary, and a computed bound would print as le="9.999999999999999e-06".
prometheus::Histogram::BucketBoundaries DurationBuckets() {
  return {5e-6, 1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2,
          2e-2, 5e-2, 1e-1, 2e-1, 5e-1, 1.0,  2.0,  5.0,  10.0};
}

prometheus::Histogram::BucketBoundaries TokenBuckets() {
  prometheus::Histogram::BucketBoundaries bounds;
  for (double bound = 1; bound <= 65536; bound *= 2) bounds.push_back(bound);
  return bounds;
}

}  // namespace

std::string_view StatusCodeLabel(absl::StatusCode code) {
  switch (code) {
    case absl::StatusCode::kOk: return "ok";
    case absl::StatusCode::kCancelled: return "cancelled";
    case absl::StatusCode::kUnknown: return "unknown";
    case absl::StatusCode::kInvalidArgument: return "invalid_argument";
    case absl::StatusCode::kDeadlineExceeded: return "deadline_exceeded";
    case absl::StatusCode::kNotFound: return "not_found";
    case absl::StatusCode::kAlreadyExists: return "already_exists";
    case absl::StatusCode::kPermissionDenied: return "permission_denied";
    case absl::StatusCode::kResourceExhausted: return "resource_exhausted";
    case absl::StatusCode::kFailedPrecondition: return "failed_precondition";
    case absl::StatusCode::kAborted: return "aborted";
    case absl::StatusCode::kOutOfRange: return "out_of_range";
    case absl::StatusCode::kUnimplemented: return "unimplemented";
    case absl::StatusCode::kInternal: return "internal";
    case absl::StatusCode::kUnavailable: return "unavailable";
    case absl::StatusCode::kDataLoss: return "data_loss";
    case absl::StatusCode::kUnauthenticated: return "unauthenticated";
    default: return "unknown";
  }
}

Metrics::Metrics(const BuildInfo& build_info, bool cache_labels)
    : cache_labels_(cache_labels), registry_(std::make_shared<prometheus::Registry>()) {
  kernel_duration_ = &prometheus::BuildHistogram()
                          .Name("attnd_kernel_duration_seconds")
                          .Help("Device time of each kernel launch, from CUDA events (CPU: wall "
                                "time), by kernel and device")
                          .Register(*registry_);
  rpc_duration_ = &prometheus::BuildHistogram()
                       .Name("attnd_rpc_duration_seconds")
                       .Help("Server-side duration of each RPC, or of each message on ForwardStream")
                       .Register(*registry_);
  rpc_requests_ = &prometheus::BuildCounter()
                       .Name("attnd_rpc_requests_total")
                       .Help("RPCs (and ForwardStream messages) by method and final status code")
                       .Register(*registry_);
  plan_duration_ = &prometheus::BuildHistogram()
                        .Name("attnd_plan_duration_seconds")
                        .Help("Time to validate, allocate and plan one step")
                        .Register(*registry_)
                        .Add({}, DurationBuckets());
  batch_tokens_ = &prometheus::BuildHistogram()
                       .Name("attnd_batch_tokens")
                       .Help("New tokens per planned step, by phase (decode rows, prefill rows)")
                       .Register(*registry_);
  tokens_total_ = &prometheus::BuildCounter()
                       .Name("attnd_tokens_total")
                       .Help("Tokens of committed steps, by phase")
                       .Register(*registry_);
  kv_pages_ = &prometheus::BuildGauge()
                   .Name("attnd_kv_pages")
                   .Help("KV pages per cache and state (used, free); managed caches only count used")
                   .Register(*registry_);
  kv_usage_ = &prometheus::BuildGauge()
                   .Name("attnd_kv_cache_usage_ratio")
                   .Help("Fraction of a cache's pages in use")
                   .Register(*registry_);
  transfer_bytes_ = &prometheus::BuildCounter()
                         .Name("attnd_transfer_bytes_total")
                         .Help("Bytes copied between host and device, by direction (h2d, d2h) "
                               "and device")
                         .Register(*registry_);
  device_kv_bytes_ = &prometheus::BuildGauge()
                         .Name("attnd_device_kv_bytes")
                         .Help("KV budget of each device caches are placed on, by state (used: "
                               "held by caches, free)")
                         .Register(*registry_);
  channels_open_ = &prometheus::BuildGauge()
                        .Name("attnd_channels_open")
                        .Help("Data-plane channels open (HOST_SHM and CUDA_IPC)")
                        .Register(*registry_)
                        .Add({});
  channel_bytes_ = &prometheus::BuildCounter()
                        .Name("attnd_channel_bytes_total")
                        .Help("Layer bytes carried by channels, by kind and direction (in: q/k/v "
                              "to attnd, out: o/lse back)")
                        .Register(*registry_);
  errors_ = &prometheus::BuildCounter()
                 .Name("attnd_errors_total")
                 .Help("Failed RPCs and stream messages by error type (status code)")
                 .Register(*registry_);
  prometheus::BuildGauge()
      .Name("attnd_build_info")
      .Help("Always 1; labels describe the build and the backend in use")
      .Register(*registry_)
      .Add({{"version", build_info.version},
            {"backend", build_info.backend},
            {"device", build_info.device}})
      .Set(1);
  // Pre-create the common series so dashboards show zeros rather than gaps (the per-device ones
  // as each device is published, SetDeviceKvBytes).
  for (const char* phase : {"decode", "prefill"}) {
    tokens_total_->Add({{"phase", phase}});
    batch_tokens_->Add({{"phase", phase}}, TokenBuckets());
  }
}

Metrics::~Metrics() = default;

prometheus::Histogram& Metrics::KernelHistogram(std::string_view kernel,
                                                const std::string& device) {
  // Family::Add returns the existing series for known labels.
  return kernel_duration_->Add({{"kernel", std::string(kernel)}, {"device", device}},
                               DurationBuckets());
}

void Metrics::OnKernel(std::string_view kernel, std::string_view phase, double seconds,
                       int32_t device) {
  KernelHistogram(kernel, std::to_string(device)).Observe(seconds);
  absl::MutexLock lock(&mu_);
  auto& totals = kernel_totals_[{std::string(kernel), std::string(phase)}];
  ++totals.first;
  totals.second += seconds;
}

void Metrics::SetDeviceKvBytes(int32_t device, int64_t used_bytes, int64_t free_bytes) {
  const std::string label = std::to_string(device);
  for (const char* kernel : {"append", "decode", "prefill", "pod", "mla_decode", "merge"}) {
    KernelHistogram(kernel, label);
  }
  for (const char* direction : {"h2d", "d2h"}) {
    transfer_bytes_->Add({{"direction", direction}, {"device", label}});
  }
  device_kv_bytes_->Add({{"device", label}, {"state", "used"}}).Set(static_cast<double>(used_bytes));
  device_kv_bytes_->Add({{"device", label}, {"state", "free"}}).Set(static_cast<double>(free_bytes));
}

void Metrics::SetOpenChannels(size_t open) { channels_open_->Set(static_cast<double>(open)); }

void Metrics::ChannelBytes(std::string_view kind, int64_t bytes_in, int64_t bytes_out) {
  channel_bytes_->Add({{"kind", std::string(kind)}, {"direction", "in"}})
      .Increment(static_cast<double>(bytes_in));
  channel_bytes_->Add({{"kind", std::string(kind)}, {"direction", "out"}})
      .Increment(static_cast<double>(bytes_out));
}

void Metrics::OnTransfer(std::string_view direction, int64_t bytes, int32_t device) {
  transfer_bytes_->Add({{"direction", std::string(direction)}, {"device", std::to_string(device)}})
      .Increment(static_cast<double>(bytes));
}

void Metrics::ObserveRpc(std::string_view method, absl::StatusCode code, double seconds) {
  const std::string method_label(method);
  rpc_duration_->Add({{"method", method_label}}, DurationBuckets()).Observe(seconds);
  const std::string code_label(StatusCodeLabel(code));
  rpc_requests_->Add({{"method", method_label}, {"code", code_label}}).Increment();
  if (code != absl::StatusCode::kOk) errors_->Add({{"error_type", code_label}}).Increment();
}

void Metrics::ObservePlan(double seconds, int64_t decode_tokens, int64_t prefill_tokens) {
  plan_duration_->Observe(seconds);
  if (decode_tokens > 0) {
    batch_tokens_->Add({{"phase", "decode"}}, TokenBuckets()).Observe(static_cast<double>(decode_tokens));
  }
  if (prefill_tokens > 0) {
    batch_tokens_->Add({{"phase", "prefill"}}, TokenBuckets()).Observe(static_cast<double>(prefill_tokens));
  }
}

void Metrics::StepEnded(bool committed, int64_t decode_tokens, int64_t prefill_tokens) {
  if (committed) {
    tokens_total_->Add({{"phase", "decode"}}).Increment(static_cast<double>(decode_tokens));
    tokens_total_->Add({{"phase", "prefill"}}).Increment(static_cast<double>(prefill_tokens));
  }
  absl::MutexLock lock(&mu_);
  if (committed) {
    ++steps_committed_;
    tokens_decode_ += decode_tokens;
    tokens_prefill_ += prefill_tokens;
  } else {
    ++steps_aborted_;
  }
}

void Metrics::PublishCachePages(const std::string& label, int64_t used_pages,
                                int64_t free_pages) {
  kv_pages_->Add({{"cache", label}, {"state", "used"}}).Set(static_cast<double>(used_pages));
  kv_pages_->Add({{"cache", label}, {"state", "free"}}).Set(static_cast<double>(free_pages));
  const int64_t total = used_pages + free_pages;
  kv_usage_->Add({{"cache", label}})
      .Set(total > 0 ? static_cast<double>(used_pages) / static_cast<double>(total) : 0.0);
}

void Metrics::PublishAggregateLocked() {
  int64_t used = 0;
  int64_t free = 0;
  for (const auto& [cache, pages] : cache_pages_) {
    used += pages.first;
    free += pages.second;
  }
  PublishCachePages("", used, free);
}

void Metrics::SetCachePages(const std::string& cache, int64_t used_pages, int64_t free_pages) {
  if (!cache_labels_) {
    absl::MutexLock lock(&mu_);
    cache_pages_[cache] = {used_pages, free_pages};
    PublishAggregateLocked();
    return;
  }
  PublishCachePages(cache, used_pages, free_pages);
}

void Metrics::RemoveCache(const std::string& cache) {
  if (!cache_labels_) {
    absl::MutexLock lock(&mu_);
    cache_pages_.erase(cache);
    PublishAggregateLocked();
    return;
  }
  for (const char* state : {"used", "free"}) {
    kv_pages_->Remove(&kv_pages_->Add({{"cache", cache}, {"state", state}}));
  }
  kv_usage_->Remove(&kv_usage_->Add({{"cache", cache}}));
}

StatsSnapshot Metrics::Snapshot() const {
  absl::MutexLock lock(&mu_);
  StatsSnapshot snapshot;
  for (const auto& [key, totals] : kernel_totals_) {
    snapshot.kernels.push_back({key.first, key.second, totals.first, totals.second});
  }
  snapshot.steps_committed = steps_committed_;
  snapshot.steps_aborted = steps_aborted_;
  snapshot.tokens_prefill = tokens_prefill_;
  snapshot.tokens_decode = tokens_decode_;
  return snapshot;
}

}  // namespace attnd
