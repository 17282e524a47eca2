#include "plan/decode_choice.h"

#include <cstdlib>
#include <string>

#include "absl/status/status.h"

namespace attnd::plan {

absl::StatusOr<DecodeKernelChoice> ParseDecodeKernelChoice(std::string_view name) {
  if (name == "auto") return DecodeKernelChoice::kAuto;
  if (name == "cuda_core") return DecodeKernelChoice::kCudaCore;
  if (name == "tensor_core") return DecodeKernelChoice::kTensorCore;
  return absl::InvalidArgumentError("expected auto, cuda_core or tensor_core, got '" +
                                    std::string(name) + "'");
}

absl::StatusOr<DecodeKernelChoice> DecodeKernelChoiceFromEnvironment() {
  const char* value = std::getenv("ATTND_DECODE_KERNEL");
  if (value == nullptr || *value == '\0') return DecodeKernelChoice::kAuto;
  absl::StatusOr<DecodeKernelChoice> choice = ParseDecodeKernelChoice(value);
  if (!choice.ok()) {
    return absl::InvalidArgumentError("ATTND_DECODE_KERNEL: " + std::string(choice.status().message()));
  }
  return choice;
}

DecodeKernelChoice EffectiveDecodeKernelChoice(DecodeKernelChoice requested,
                                               bool cuda_core_supported,
                                               bool tensor_core_supported) {
  switch (requested) {
    case DecodeKernelChoice::kCudaCore:
      return cuda_core_supported ? requested : DecodeKernelChoice::kAuto;
    case DecodeKernelChoice::kTensorCore:
      return tensor_core_supported ? requested : DecodeKernelChoice::kAuto;
    case DecodeKernelChoice::kAuto:
      break;
  }
  return DecodeKernelChoice::kAuto;
}

}  // namespace attnd::plan
