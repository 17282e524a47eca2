// The client's side of the hot path, over the shared codec (attnd/wire/forward_wire.h): a
// ForwardRequest (alone or in a StreamRequest) written as slices whose tensor bytes are the
// caller's memory, referenced and not copied, and a ForwardResponse (alone or in a
// StreamResponse) read into the codec's one form, then copied from the received slices into
// the caller's output buffers (the one copy of the way back). What the codec leaves to protobuf
// is parsed by protobuf and ends in the same form.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include <grpcpp/support/byte_buffer.h>

#include "absl/status/statusor.h"
#include "attnd/client/step.h"
#include "attnd/v1/attnd.pb.h"
#include "attnd/wire/forward_wire.h"

namespace attnd::client {

// `tag` is written when `stream`.
grpc::ByteBuffer EncodeForwardRequest(bool stream, uint64_t tag, uint64_t step_id, int32_t layer,
                                      const TensorView& q, const TensorView& k,
                                      const TensorView& v);

// Reads a unary Forward's reply into `outputs`: o (and lse when the reply has one) must match
// their sizes exactly.
absl::StatusOr<ForwardOutcome> DecodeForwardResponse(const grpc::ByteBuffer& message,
                                                     const ForwardOutputBuffers& outputs);

// A StreamResponse as received, read once: its tag, then either a forward's outputs (raw calls)
// or the whole message (typed calls). Keeps `message` referenced while it lives.
class StreamReply {
 public:
  explicit StreamReply(const grpc::ByteBuffer& message);

  // 0 when the message has none or is not a StreamResponse.
  uint64_t tag() const { return tag_; }
  // A forward's outputs into `outputs`, as DecodeForwardResponse; the message's error (a
  // per-message failure) as its status.
  absl::StatusOr<ForwardOutcome> ForwardOutputs(const ForwardOutputBuffers& outputs) const;
  // The message parsed by protobuf.
  absl::StatusOr<attnd::v1::StreamResponse> Parsed();

 private:
  grpc::ByteBuffer message_;  // shares the received slices
  std::vector<grpc::Slice> slices_;
  uint64_t tag_ = 0;
  bool decoded_ = false;  // the codec read a forward into forward_
  wire::ForwardResponse forward_;
  std::optional<attnd::v1::StreamResponse> parsed_;  // protobuf's parse, when it took one
  bool valid_ = true;  // false: not a StreamResponse
};

}  // namespace attnd::client
