// The client's side of an NCCL channel layer on the wire (client/src/nccl_wire.h): the buffers,
// order and sizes attnd's NcclChannel receives and sends (server/backend/nccl_channel.cc, and
// attnd.proto's CHANNEL_KIND_NCCL), so a mismatch shows here rather than as a hung GPU.
#include "nccl_wire.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>

namespace attnd::client::internal {
namespace {

using ::testing::HasSubstr;

constexpr int32_t kMaxTokens = 16;

// Row bytes of Hq 4 / Hkv 2 / D 64 fp16, lse float32 per head (as MakeChannelLayout).
attnd::v1::ChannelInfo MhaInfo(bool with_lse) {
  attnd::v1::ChannelInfo info;
  info.set_kind(attnd::v1::CHANNEL_KIND_NCCL);
  info.set_max_tokens(kMaxTokens);
  attnd::v1::ChannelLayout& layout = *info.mutable_layout();
  layout.set_q_row_bytes(4 * 64 * 2);
  layout.set_k_row_bytes(2 * 64 * 2);
  layout.set_v_row_bytes(2 * 64 * 2);
  layout.set_o_row_bytes(4 * 64 * 2);
  layout.set_lse_row_bytes(with_lse ? 4 * 4 : 0);
  return info;
}

attnd::v1::ChannelInfo MlaInfo() {
  attnd::v1::ChannelInfo info;
  info.set_kind(attnd::v1::CHANNEL_KIND_NCCL);
  info.set_max_tokens(kMaxTokens);
  attnd::v1::ChannelLayout& layout = *info.mutable_layout();
  layout.set_q_row_bytes(16 * 512 * 2);
  layout.set_q_pe_row_bytes(16 * 64 * 2);
  layout.set_ckv_row_bytes(512 * 2);
  layout.set_kpe_row_bytes(64 * 2);
  layout.set_o_row_bytes(16 * 512 * 2);
  layout.set_lse_row_bytes(16 * 4);
  return info;
}

// Distinct fake device addresses: only their identity matters here.
ChannelSlot FakeSlot() {
  static uint8_t memory[8];
  ChannelSlot slot;
  slot.q = memory + 0;
  slot.k = memory + 1;
  slot.v = memory + 2;
  slot.q_pe = memory + 3;
  slot.ckv = memory + 4;
  slot.kpe = memory + 5;
  slot.o = memory + 6;
  slot.lse = reinterpret_cast<float*>(memory + 7);
  return slot;
}

TEST(NcclWireTest, MhaSendsQKVThenReceivesOAndLseInThatOrder) {
  const ChannelSlot slot = FakeSlot();
  absl::StatusOr<NcclLayerBuffers> buffers =
      NcclLayerBuffersOf(MhaInfo(/*with_lse=*/true), 5, /*return_lse=*/true, slot);
  ASSERT_TRUE(buffers.ok()) << buffers.status();
  ASSERT_EQ(buffers->sends.size(), 3u);
  EXPECT_EQ(buffers->sends[0].data, slot.q);
  EXPECT_EQ(buffers->sends[0].bytes, 5 * 4 * 64 * 2);
  EXPECT_EQ(buffers->sends[1].data, slot.k);
  EXPECT_EQ(buffers->sends[1].bytes, 5 * 2 * 64 * 2);
  EXPECT_EQ(buffers->sends[2].data, slot.v);
  EXPECT_EQ(buffers->sends[2].bytes, 5 * 2 * 64 * 2);
  ASSERT_EQ(buffers->receives.size(), 2u);
  EXPECT_EQ(buffers->receives[0].data, slot.o);
  EXPECT_EQ(buffers->receives[0].bytes, 5 * 4 * 64 * 2);
  EXPECT_EQ(buffers->receives[1].data, slot.lse);
  EXPECT_EQ(buffers->receives[1].bytes, 5 * 4 * 4);
}

TEST(NcclWireTest, LseTravelsOnlyWhenTheStepReturnsIt) {
  absl::StatusOr<NcclLayerBuffers> buffers =
      NcclLayerBuffersOf(MhaInfo(/*with_lse=*/true), 3, /*return_lse=*/false, FakeSlot());
  ASSERT_TRUE(buffers.ok()) << buffers.status();
  ASSERT_EQ(buffers->receives.size(), 1u);
  EXPECT_EQ(buffers->receives[0].data, FakeSlot().o);
  // A channel without lse regions cannot carry a step that returns lse (Plan refuses it too).
  absl::StatusOr<NcclLayerBuffers> refused =
      NcclLayerBuffersOf(MhaInfo(/*with_lse=*/false), 3, /*return_lse=*/true, FakeSlot());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("with_lse"));
}

TEST(NcclWireTest, MlaSendsQNopeQPeCkvKpe) {
  const ChannelSlot slot = FakeSlot();
  absl::StatusOr<NcclLayerBuffers> buffers =
      NcclLayerBuffersOf(MlaInfo(), 2, /*return_lse=*/false, slot);
  ASSERT_TRUE(buffers.ok()) << buffers.status();
  ASSERT_EQ(buffers->sends.size(), 4u);
  EXPECT_EQ(buffers->sends[0].data, slot.q);
  EXPECT_EQ(buffers->sends[0].bytes, 2 * 16 * 512 * 2);
  EXPECT_EQ(buffers->sends[1].data, slot.q_pe);
  EXPECT_EQ(buffers->sends[1].bytes, 2 * 16 * 64 * 2);
  EXPECT_EQ(buffers->sends[2].data, slot.ckv);
  EXPECT_EQ(buffers->sends[2].bytes, 2 * 512 * 2);
  EXPECT_EQ(buffers->sends[3].data, slot.kpe);
  EXPECT_EQ(buffers->sends[3].bytes, 2 * 64 * 2);
  ASSERT_EQ(buffers->receives.size(), 1u);
  EXPECT_EQ(buffers->receives[0].bytes, 2 * 16 * 512 * 2);
}

TEST(NcclWireTest, AStepWithNoRowsMovesNothing) {
  absl::StatusOr<NcclLayerBuffers> buffers =
      NcclLayerBuffersOf(MhaInfo(true), 0, /*return_lse=*/true, ChannelSlot{});
  ASSERT_TRUE(buffers.ok()) << buffers.status();
  EXPECT_TRUE(buffers->sends.empty());
  EXPECT_TRUE(buffers->receives.empty());
}

TEST(NcclWireTest, RowsBeyondTheChannelAndMissingTensorsAreRefused) {
  absl::StatusOr<NcclLayerBuffers> too_many =
      NcclLayerBuffersOf(MhaInfo(true), kMaxTokens + 1, false, FakeSlot());
  EXPECT_EQ(too_many.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(too_many.status().message()), HasSubstr("max_tokens"));
  ChannelSlot no_v = FakeSlot();
  no_v.v = nullptr;
  absl::StatusOr<NcclLayerBuffers> missing = NcclLayerBuffersOf(MhaInfo(true), 1, false, no_v);
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(missing.status().message()), HasSubstr("v: null"));
}

}  // namespace
}  // namespace attnd::client::internal
