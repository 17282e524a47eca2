#include "backend/pod_choice.h"

#include <cstdlib>
#include <string>

#include "absl/status/status.h"

namespace attnd::cuda_backend {

absl::StatusOr<PodMode> ParsePodMode(std::string_view name) {
  if (name == "auto") return PodMode::kAuto;
  if (name == "on") return PodMode::kOn;
  if (name == "off") return PodMode::kOff;
  return absl::InvalidArgumentError("ATTND_POD: expected auto, on or off, got '" + std::string(name) + "'");
}

absl::StatusOr<PodMode> PodModeFromEnvironment() {
  const char* value = std::getenv("ATTND_POD");
  if (value == nullptr || *value == '\0') return PodMode::kAuto;
  return ParsePodMode(value);
}

bool PodAutoPicks(const PodStepShape& shape) {
  return !shape.hopper_prefill || shape.page_size == 1;
}

bool ChoosePod(PodMode mode, const PodStepShape& shape) {
  if (shape.num_prefill_requests <= 0 || shape.num_decode_requests <= 0 || shape.deterministic) return false;
  switch (mode) {
    case PodMode::kOn: return true;
    case PodMode::kOff: return false;
    case PodMode::kAuto: return PodAutoPicks(shape);
  }
  return false;
}

}  // namespace attnd::cuda_backend
