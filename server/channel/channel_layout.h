// Where a channel's tensors and flags sit in its ring. attnd computes the layout from the
// cache's geometry and the channel's size and owns it: clients read offsets from OpenChannel's
// answer, and the only ones they send back (an import's chunk descriptors) must name one of
// the transfer regions below exactly.
//
// Ring: [header lines][slot 0][slot 1]...
//   header: one 64-byte line per flag word: ready[0..L), done[0..L), aborted, transfer[0..S),
//           transfer_end.
//   slot:   q | k | v | q_pe | ckv | kpe | o | lse, each region max_tokens rows, 256-aligned;
//           MHA uses q, k, v, o (lse); MLA uses q (q_nope), q_pe, ckv, kpe, o (lse).
#pragma once

#include <cstdint>
#include <vector>

#include "backend/backend.h"

namespace attnd {

struct ChannelSlotLayout {
  int64_t q = 0, k = 0, v = 0, q_pe = 0, ckv = 0, kpe = 0, o = 0, lse = 0;  // byte offsets
};

struct ChannelLayout {
  int32_t max_tokens = 0;
  int32_t num_slots = 0;
  int64_t ring_bytes = 0;
  std::vector<int64_t> ready;  // [num_layers] byte offsets of the 32-bit ready words
  std::vector<int64_t> done;   // [num_layers] byte offsets of the 32-bit done words
  int64_t aborted = 0;         // byte offset of the aborted word
  // Sequence transfers (ExportSequence/ImportSequence through the channel) use slot s's whole
  // byte span as region s, [slots[s].q, slots[s].q + slot_bytes), and transfer[s] as its flag.
  std::vector<int64_t> transfer;  // [num_slots] byte offsets of the 32-bit transfer words
  int64_t transfer_end = 0;       // a count of the transfers that ended (ChannelTransfer)
  int64_t slot_bytes = 0;
  std::vector<ChannelSlotLayout> slots;
  // Bytes of one row of each tensor (0 when the cache kind does not use it).
  int64_t q_row = 0, k_row = 0, v_row = 0, q_pe_row = 0, ckv_row = 0, kpe_row = 0;
  int64_t o_row = 0, lse_row = 0;

  int32_t SlotOf(int32_t layer) const { return layer % num_slots; }
  int64_t TransferRegion(int32_t slot) const { return slots[slot].q; }
  // Bytes a step of `num_tokens` rows moves through one layer (inputs, outputs).
  int64_t InputBytes(int64_t num_tokens) const {
    return num_tokens * (q_row + k_row + v_row + q_pe_row + ckv_row + kpe_row);
  }
  int64_t OutputBytes(int64_t num_tokens, bool with_lse) const {
    return num_tokens * (o_row + (with_lse ? lse_row : 0));
  }
};

inline constexpr int64_t kChannelFlagLine = 64;
inline constexpr int64_t kChannelRegionAlignment = 256;

// The layout of a channel of `max_tokens` rows and `num_slots` slots on a cache of this
// geometry; lse regions only when with_lse. The caller has checked the sizes' ranges.
ChannelLayout MakeChannelLayout(const CacheGeometry& geometry, int32_t max_tokens,
                                int32_t num_slots, bool with_lse);

}  // namespace attnd
