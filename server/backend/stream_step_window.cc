#include "backend/stream_step_window.h"

namespace attnd::cuda_backend {

bool LayerTimingDraw::Next(int32_t stride, int64_t rows) {
  state_ ^= state_ >> 12;
  state_ ^= state_ << 25;
  state_ ^= state_ >> 27;
  const uint64_t draw = (state_ * 0x2545F4914F6CDD1Dull) >> 32;
  return stride > 0 && rows > 0 && draw % static_cast<uint64_t>(stride) == 0;
}

}  // namespace attnd::cuda_backend
