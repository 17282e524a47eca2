// A 32-bit word that a launch sets itself once its results are visible (DESIGN 3b: a channel
// layer's done word), from the last of its CTAs to finish, instead of a stream operation after
// it: a reader polling the word (another process, or a peer GPU) sees it as soon as the grid's
// last stores land, without the grid's completion and a following stream operation between.
#pragma once

#include <cstdint>

namespace attnd::cuda {

struct GridSignal {
  // Device memory (this GPU's, or mapped from a peer's); null: no signal. Set to `value` with a
  // system-scope release store by the last CTA, after every CTA's stores are fenced.
  uint32_t* word = nullptr;
  uint32_t value = 0;
  // A 32-bit word of this GPU, zero, that no other launch uses at the same time: the CTAs count
  // themselves there, and the last one sets it back to zero.
  uint32_t* counter = nullptr;

  bool active() const { return word != nullptr; }
};

}  // namespace attnd::cuda
