// The client's side of the hot path's wire format (the server's is server/service/
// forward_wire.h): a ForwardRequest (alone or in a StreamRequest) written as slices whose tensor
// bytes are the caller's memory, referenced and not copied, and a ForwardResponse (alone or in
// a StreamResponse) read straight from the received slices into the caller's output buffers
// (the one copy of the way back). A response in an unexpected encoding is parsed with protobuf.
#pragma once

#include <cstdint>
#include <span>

#include <grpcpp/support/byte_buffer.h>

#include "absl/status/statusor.h"
#include "attnd/client/step.h"

namespace attnd::client {

// `tag` is written when `stream`.
grpc::ByteBuffer EncodeForwardRequest(bool stream, uint64_t tag, uint64_t step_id, int32_t layer,
                                      const TensorView& q, const TensorView& k,
                                      const TensorView& v);

// The tag of a StreamResponse (0 when it has none or cannot be read).
uint64_t StreamResponseTag(const grpc::ByteBuffer& message);

// Reads a forward's reply into `outputs`: o (and lse when the reply has one) must match their
// sizes exactly. A StreamResponse's per-message error comes back as its status.
absl::StatusOr<ForwardOutcome> DecodeForwardResponse(const grpc::ByteBuffer& message, bool stream,
                                                     const ForwardOutputBuffers& outputs);

}  // namespace attnd::client
