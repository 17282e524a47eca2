#include "plan/pod_choice.h"

#include <cstdlib>
#include <string>

#include "absl/status/status.h"

namespace attnd::plan {

absl::StatusOr<PodMode> ParsePodMode(std::string_view name) {
  if (name == "auto") return PodMode::kAuto;
  if (name == "on") return PodMode::kOn;
  if (name == "off") return PodMode::kOff;
  return absl::InvalidArgumentError("expected auto, on or off, got '" + std::string(name) + "'");
}

absl::StatusOr<PodMode> PodModeFromEnvironment() {
  const char* value = std::getenv("ATTND_POD");
  if (value == nullptr || *value == '\0') return PodMode::kAuto;
  absl::StatusOr<PodMode> mode = ParsePodMode(value);
  if (!mode.ok()) return absl::InvalidArgumentError("ATTND_POD: " + std::string(mode.status().message()));
  return mode;
}

PodStepShape PodShapeOf(const StepBatch& batch, int32_t page_size, bool hopper_prefill) {
  PodStepShape shape;
  shape.page_size = page_size;
  shape.hopper_prefill = hopper_prefill;
  shape.deterministic = batch.options.deterministic;
  for (int32_t b = 0; b < batch.batch_size; ++b) {
    const int32_t rows = batch.Rows(b);
    if (rows == 1) ++shape.num_decode_requests;
    if (rows > 1) {
      ++shape.num_prefill_requests;
      shape.num_prefill_rows += rows;
    }
  }
  return shape;
}

bool PodAutoPicks(const PodStepShape& shape) {
  return !shape.hopper_prefill;
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

}  // namespace attnd::plan
