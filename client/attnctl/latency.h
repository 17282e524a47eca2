// Latency samples and their percentiles, for bench's summary.
#pragma once

#include <cstddef>
#include <vector>

#include "absl/time/time.h"

namespace attnd::attnctl {

// Not thread-safe; guard it when several threads record.
class LatencyRecorder {
 public:
  void Record(absl::Duration latency) { samples_.push_back(latency); }
  size_t count() const { return samples_.size(); }
  // Nearest-rank percentile, p in [0, 100]; zero when empty. Sorts the samples once.
  absl::Duration Percentile(double p);
  absl::Duration Mean() const;

 private:
  std::vector<absl::Duration> samples_;
  bool sorted_ = false;
};

// "1.23 ms", "456 us", "2.5 s".
std::string FormatLatency(absl::Duration latency);

}  // namespace attnd::attnctl
