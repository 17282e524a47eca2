#include "channel/channel_layout.h"

namespace attnd {
namespace {

int64_t AlignUp(int64_t bytes, int64_t alignment) {
  return (bytes + alignment - 1) / alignment * alignment;
}

}  // namespace

ChannelLayout MakeChannelLayout(const CacheGeometry& g, int32_t max_tokens, int32_t num_slots,
                                bool with_lse) {
  ChannelLayout layout;
  layout.max_tokens = max_tokens;
  layout.num_slots = num_slots;
  const int64_t element = DTypeBytes(g.q_dtype);
  if (g.mla) {
    layout.q_row = int64_t{g.num_qo_heads} * g.k_head_dim * element;     // q_nope
    layout.q_pe_row = int64_t{g.num_qo_heads} * g.v_head_dim * element;  // q_pe
    layout.ckv_row = int64_t{g.k_head_dim} * element;
    layout.kpe_row = int64_t{g.v_head_dim} * element;
  } else {
    layout.q_row = int64_t{g.num_qo_heads} * g.k_head_dim * element;
    layout.k_row = int64_t{g.num_kv_heads} * g.k_head_dim * element;
    layout.v_row = int64_t{g.num_kv_heads} * g.v_head_dim * element;
  }
  layout.o_row = int64_t{g.num_qo_heads} * g.k_head_dim * element;  // MLA: latent width
  layout.lse_row = with_lse ? int64_t{g.num_qo_heads} * 4 : 0;

  int64_t offset = 0;
  for (int32_t l = 0; l < g.num_layers; ++l) {
    layout.ready.push_back(offset);
    offset += kChannelFlagLine;
  }
  for (int32_t l = 0; l < g.num_layers; ++l) {
    layout.done.push_back(offset);
    offset += kChannelFlagLine;
  }
  layout.aborted = offset;
  offset += kChannelFlagLine;
  for (int32_t s = 0; s < num_slots; ++s) {
    layout.transfer.push_back(offset);
    offset += kChannelFlagLine;
  }
  layout.transfer_end = offset;
  offset += kChannelFlagLine;
  offset = AlignUp(offset, kChannelRegionAlignment);
  // Each region: placed when its row size is not 0; otherwise its offset is the next free byte
  // (a zero-sized region).
  auto region = [&](int64_t row_bytes) {
    const int64_t at = offset;
    offset = AlignUp(offset + row_bytes * max_tokens, kChannelRegionAlignment);
    return at;
  };
  const int64_t first_slot = offset;
  for (int32_t s = 0; s < num_slots; ++s) {
    ChannelSlotLayout slot;
    slot.q = region(layout.q_row);
    slot.k = region(layout.k_row);
    slot.v = region(layout.v_row);
    slot.q_pe = region(layout.q_pe_row);
    slot.ckv = region(layout.ckv_row);
    slot.kpe = region(layout.kpe_row);
    slot.o = region(layout.o_row);
    slot.lse = region(layout.lse_row);
    layout.slots.push_back(slot);
  }
  layout.ring_bytes = offset;
  // Every slot has the same regions, so the same span.
  layout.slot_bytes = (offset - first_slot) / num_slots;
  return layout;
}

}  // namespace attnd
