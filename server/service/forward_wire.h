// The hot path's wire format. A ForwardRequest (alone, or inside a StreamRequest) is parsed from
// the received message's slices without copying its tensors: their `data` fields are located as
// pieces of the slices, which the backend copies once, straight into pinned staging. A
// ForwardResponse is written as slices whose o bytes are the backend's lent output buffer, so
// the bytes go from pinned memory to the socket with no copy in between.
//
// The fast parser accepts what protobuf serializers write (each message field once, scalars and
// `data` last-wins, shape packed or not, unknown fields skipped) and declines anything else (a
// tensor field repeated, a known field with another wire type, `values` instead of `data`,
// groups, truncation); the caller then parses with protobuf, so the language accepted is
// exactly protobuf's and only the cost differs.
#pragma once

#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/slice.h>

#include "backend/backend.h"

namespace attnd {

// A Tensor as found on the wire. Reused across messages: the vectors keep their capacity.
struct WireTensor {
  bool present = false;
  int32_t dtype = 0;  // attnd.v1.DType as sent
  std::vector<int64_t> shape;
  std::vector<std::string_view> pieces;  // the `data` bytes, in order, inside the slices

  void Clear();
};

struct WireForward {
  uint64_t step_id = 0;
  int32_t layer = 0;
  WireTensor q, k, v, q_pe, ckv, kpe;

  void Clear();
};

enum class WireKind {
  kForward,  // a forward in the usual encoding: parsed
  kOther,    // anything else: parse the message with protobuf
};

// `slices` must outlive the pieces. `tag` is set for kForward.
WireKind ParseStreamRequest(std::span<const grpc::Slice> slices, uint64_t& tag,
                            WireForward& forward);
// True when parsed; false: parse with protobuf.
bool ParseForwardRequest(std::span<const grpc::Slice> slices, WireForward& forward);

// A ForwardResponse (or a StreamResponse with `tag` carrying one) as slices: o's bytes are
// `lease.o`, referenced in place and released through the lease once gRPC is done with them
// (the lease is consumed: its release moves into the slice); lse is copied (small).
struct WireResponse {
  DType o_dtype = DType::kBFloat16;
  std::span<const int64_t> o_shape;
  int64_t o_bytes = 0;
  std::span<const int64_t> lse_shape;  // empty: no lse
  int64_t lse_bytes = 0;
  bool step_committed = false;
};
void WriteForwardResponse(const WireResponse& response, OutputLease& lease,
                          grpc::ByteBuffer& out);
void WriteStreamForwardResponse(uint64_t tag, const WireResponse& response, OutputLease& lease,
                                grpc::ByteBuffer& out);

}  // namespace attnd
