// What one layer of a CHANNEL_KIND_NCCL channel puts on the wire (attnd.proto): the buffers the
// client sends, in order, and those it receives, in order, for a step of `rows` rows. Plain
// data, no CUDA or NCCL, so the order and sizes that must mirror attnd's NcclChannel
// (server/backend/nccl_channel.cc) are unit-tested on any machine.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "attnd/client/channel.h"
#include "attnd/v1/attnd.pb.h"

namespace attnd::client::internal {

// `bytes` of device memory at `data`, moved as ncclUint8.
struct NcclBuffer {
  void* data = nullptr;
  int64_t bytes = 0;
};

struct NcclLayerBuffers {
  std::vector<NcclBuffer> sends;     // MHA q, k, v; MLA q_nope, q_pe, ckv, kpe
  std::vector<NcclBuffer> receives;  // o, then lse when the step returns it
};

// The layer's buffers from `tensors` (Channel::ExchangeOnStream's), `rows` rows of each at the
// layout's row bytes. INVALID_ARGUMENT when rows is outside [0, max_tokens], a tensor the kind
// needs is null, or lse is asked of a channel opened without it. Empty lists for 0 rows: attnd
// moves nothing for such a step either.
absl::StatusOr<NcclLayerBuffers> NcclLayerBuffersOf(const attnd::v1::ChannelInfo& info,
                                                    int64_t rows, bool return_lse,
                                                    const ChannelSlot& tensors);

}  // namespace attnd::client::internal
