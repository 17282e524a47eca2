// The hot path's wire codec, shared by the daemon and the client: ForwardRequest and
// ForwardResponse (alone, or inside a StreamRequest / StreamResponse) read from and written as
// gRPC slices without copying tensor bytes.
//
// Reading: a message is decoded into one form, whatever way it came: a Tensor's `data` is a list
// of pieces of the received slices (`Tensor::pieces`, no copy). The slow path (protobuf's parser)
// ends in the same form: ViewOf() makes pieces of a parsed message's strings.
//
// The fast decoder reads exactly the encodings protobuf serializers write plus the harmless
// variants (fields in any order, shape packed or not, scalars and `data` last-wins). Anything
// else answers kOther, and the caller parses the message with protobuf: a field this codec does
// not carry (use_channel, `values`, a field added to attnd.proto later, an unknown field), a
// message field repeated (protobuf merges), a wire type that does not match the field, a group,
// truncation. So the language accepted is protobuf's, only the cost differs, and no field is
// ever dropped here. Field numbers are the generated k...FieldNumber constants.
//
// Writing: tensor bytes are referenced in place (see each writer for who keeps them alive);
// only the small heads (keys, lengths, dtype, shape) are written into new memory.
//
// Thread-compatible: the functions keep no state; a Tensor or ForwardRequest may be reused
// across messages (its vectors keep their capacity).
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string_view>
#include <vector>

#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/slice.h>

#include "attnd/v1/attnd.pb.h"

namespace attnd::wire {

// ---- read ------------------------------------------------------------------------------------

// An attnd.v1.Tensor as read. `pieces` are views into the received slices (or, from ViewOf,
// into the parsed message): whoever holds them keeps those alive.
struct Tensor {
  bool present = false;
  int32_t dtype = 0;  // attnd.v1.DType as sent (not checked here)
  std::vector<int64_t> shape;  // as sent (not checked here)
  std::vector<std::string_view> pieces;  // `data`: the concatenation of the pieces

  void Clear();
  int64_t size_bytes() const;
  // Copies the bytes to `out`, which must hold size_bytes().
  void CopyTo(uint8_t* out) const;
};

struct ForwardRequest {
  uint64_t step_id = 0;
  int32_t layer = 0;
  Tensor q, k, v, q_pe, ckv, kpe;

  void Clear();
};

struct ForwardResponse {
  Tensor o, lse;
  bool step_committed = false;

  void Clear();
};

enum class Decoded {
  kForward,  // a forward in an encoding this codec reads: decoded
  kOther,    // anything else (another payload, or see the top of this file): use protobuf
};

// `out` is cleared first; on kOther its contents are unspecified. `slices` must outlive the
// pieces. `tag` (streams) is set on kForward.
Decoded DecodeForwardRequest(std::span<const grpc::Slice> slices, ForwardRequest& out);
Decoded DecodeStreamRequest(std::span<const grpc::Slice> slices, uint64_t& tag,
                            ForwardRequest& out);
Decoded DecodeForwardResponse(std::span<const grpc::Slice> slices, ForwardResponse& out);
Decoded DecodeStreamResponse(std::span<const grpc::Slice> slices, uint64_t& tag,
                             ForwardResponse& out);

// A message parsed by protobuf, in the same form (pieces of its `data` strings; `message` must
// outlive them). A Tensor's `values` are not read: the caller converts them (the server does).
void ViewOf(const v1::Tensor& tensor, Tensor& out);
void ViewOf(const v1::ForwardRequest& request, ForwardRequest& out);
void ViewOf(const v1::ForwardResponse& response, ForwardResponse& out);

// ---- write -----------------------------------------------------------------------------------

// A Tensor to write: `bytes` are referenced, not copied.
struct TensorBytes {
  int32_t dtype = 0;  // attnd.v1.DType
  std::span<const int64_t> shape;
  std::span<const uint8_t> bytes;
};

struct ForwardRequestBytes {
  uint64_t step_id = 0;
  int32_t layer = 0;
  std::optional<TensorBytes> q, k, v, q_pe, ckv, kpe;  // nullopt: not written
};

// A ForwardRequest, or with `stream_tag` a StreamRequest carrying it. Every tensor's bytes are
// referenced in place: the caller keeps them unchanged until gRPC is done with the message (the
// call's completion).
grpc::ByteBuffer EncodeForwardRequest(const ForwardRequestBytes& request,
                                      std::optional<uint64_t> stream_tag = std::nullopt);

struct ForwardResponseBytes {
  TensorBytes o;  // always written
  std::optional<TensorBytes> lse;
  bool step_committed = false;
};

// Who owns o's bytes: `release(release_arg)` runs exactly once, from any thread, when gRPC no
// longer references them (possibly before EncodeForwardResponse returns: when o is empty).
// Without `release` the bytes are copied.
struct Lent {
  void (*release)(void*) = nullptr;
  void* release_arg = nullptr;
};

// A ForwardResponse, or with `stream_tag` a StreamResponse carrying it, into `out`. o's bytes
// are referenced in place (see Lent); lse's are copied (they are few).
void EncodeForwardResponse(const ForwardResponseBytes& response, Lent o_owner,
                           grpc::ByteBuffer& out,
                           std::optional<uint64_t> stream_tag = std::nullopt);

}  // namespace attnd::wire
