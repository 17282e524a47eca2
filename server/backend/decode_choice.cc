#include "backend/decode_choice.h"

#include <cstdlib>
#include <string>

#include "absl/status/status.h"

namespace attnd::cuda_backend {

absl::StatusOr<plan::DecodeKernelChoice> ParseDecodeKernelChoice(std::string_view name) {
  if (name == "auto") return plan::DecodeKernelChoice::kAuto;
  if (name == "cuda_core") return plan::DecodeKernelChoice::kCudaCore;
  if (name == "tensor_core") return plan::DecodeKernelChoice::kTensorCore;
  return absl::InvalidArgumentError("ATTND_DECODE_KERNEL: expected auto, cuda_core or tensor_core, got '" +
                                    std::string(name) + "'");
}

absl::StatusOr<plan::DecodeKernelChoice> DecodeKernelChoiceFromEnvironment() {
  const char* value = std::getenv("ATTND_DECODE_KERNEL");
  if (value == nullptr || *value == '\0') return plan::DecodeKernelChoice::kAuto;
  return ParseDecodeKernelChoice(value);
}

plan::DecodeKernelChoice EffectiveDecodeKernelChoice(plan::DecodeKernelChoice requested,
                                                     bool cuda_core_supported,
                                                     bool tensor_core_supported) {
  switch (requested) {
    case plan::DecodeKernelChoice::kCudaCore:
      return cuda_core_supported ? requested : plan::DecodeKernelChoice::kAuto;
    case plan::DecodeKernelChoice::kTensorCore:
      return tensor_core_supported ? requested : plan::DecodeKernelChoice::kAuto;
    case plan::DecodeKernelChoice::kAuto:
      break;
  }
  return plan::DecodeKernelChoice::kAuto;
}

}  // namespace attnd::cuda_backend
