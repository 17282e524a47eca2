// The transfer parts of a channel's layout (ExportSequence/ImportSequence through a channel):
// one region per slot, each the slot's whole span, and flag words apart from every region.
#include "channel/channel_layout.h"

#include <algorithm>
#include <vector>

#include <gtest/gtest.h>

namespace attnd {
namespace {

CacheGeometry Gqa(int32_t layers) {
  CacheGeometry g;
  g.num_layers = layers;
  g.num_qo_heads = 32;
  g.num_kv_heads = 8;
  g.k_head_dim = 128;
  g.v_head_dim = 128;
  g.page_size = 16;
  return g;
}

TEST(ChannelLayoutTest, TransferRegionsAreTheSlotsWholeSpans) {
  for (const bool lse : {false, true}) {
    const ChannelLayout layout = MakeChannelLayout(Gqa(4), /*max_tokens=*/64, /*num_slots=*/3, lse);
    ASSERT_EQ(layout.transfer.size(), 3u);
    ASSERT_EQ(layout.slots.size(), 3u);
    for (int32_t slot = 0; slot < 3; ++slot) {
      const int64_t begin = layout.TransferRegion(slot);
      EXPECT_EQ(begin % kChannelRegionAlignment, 0);
      EXPECT_EQ(begin + layout.slot_bytes,
                slot + 1 < 3 ? layout.TransferRegion(slot + 1) : layout.ring_bytes);
      // Every tensor region of the slot lies inside it.
      const ChannelSlotLayout& s = layout.slots[slot];
      EXPECT_LE(s.o + 64 * layout.o_row, begin + layout.slot_bytes);
      EXPECT_GE(s.q, begin);
    }
  }
}

TEST(ChannelLayoutTest, TransferFlagsHaveTheirOwnLinesBeforeTheRegions) {
  const ChannelLayout layout = MakeChannelLayout(Gqa(2), 8, 2, true);
  std::vector<int64_t> words = layout.ready;
  words.insert(words.end(), layout.done.begin(), layout.done.end());
  words.push_back(layout.aborted);
  words.insert(words.end(), layout.transfer.begin(), layout.transfer.end());
  words.push_back(layout.transfer_end);
  std::sort(words.begin(), words.end());
  for (size_t i = 0; i < words.size(); ++i) {
    EXPECT_EQ(words[i] % kChannelFlagLine, 0);
    if (i > 0) {
      EXPECT_GE(words[i] - words[i - 1], kChannelFlagLine);
    }
  }
  EXPECT_LE(words.back() + kChannelFlagLine, layout.TransferRegion(0));
}

}  // namespace
}  // namespace attnd
