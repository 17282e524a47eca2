#include "latency.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "absl/strings/str_format.h"

namespace attnd::attnctl {

absl::Duration LatencyRecorder::Percentile(double p) {
  if (samples_.empty()) return absl::ZeroDuration();
  if (!sorted_) {
    std::sort(samples_.begin(), samples_.end());
    sorted_ = true;
  }
  const double rank = std::ceil(p / 100.0 * static_cast<double>(samples_.size()));
  const size_t index = rank < 1 ? 0 : std::min(samples_.size() - 1, static_cast<size_t>(rank) - 1);
  return samples_[index];
}

absl::Duration LatencyRecorder::Mean() const {
  if (samples_.empty()) return absl::ZeroDuration();
  absl::Duration total;
  for (absl::Duration sample : samples_) total += sample;
  return total / static_cast<int64_t>(samples_.size());
}

std::string FormatLatency(absl::Duration latency) {
  const double us = absl::ToDoubleMicroseconds(latency);
  if (us < 1000.0) return absl::StrFormat("%.0f us", us);
  if (us < 1e6) return absl::StrFormat("%.2f ms", us / 1000.0);
  return absl::StrFormat("%.2f s", us / 1e6);
}

}  // namespace attnd::attnctl
