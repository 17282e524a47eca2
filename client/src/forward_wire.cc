#include "forward_wire.h"

#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "attnd/client/status.h"
#include "attnd/status_macros.h"
#include "attnd/v1/attnd.grpc.pb.h"  // SerializationTraits of the messages

namespace attnd::client {
namespace {

std::optional<wire::TensorBytes> Bytes(const TensorView& tensor) {
  return wire::TensorBytes{tensor.dtype, tensor.shape, tensor.bytes};
}

absl::Status CheckSize(const char* field, const wire::Tensor& tensor, size_t buffer_bytes) {
  const int64_t reply_bytes = tensor.size_bytes();
  if (reply_bytes == static_cast<int64_t>(buffer_bytes)) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(field, ": the output buffer holds ",
                                                 buffer_bytes, " bytes, the reply ",
                                                 reply_bytes));
}

// A forward's outputs, in the codec's form, into the caller's buffers: o exactly its size; lse
// when the reply has one. Nothing is written unless every size matches.
absl::StatusOr<ForwardOutcome> CopyOutputs(const wire::ForwardResponse& response,
                                           const ForwardOutputBuffers& outputs) {
  const size_t lse_bytes = outputs.lse.size() * sizeof(float);
  const bool has_lse = response.lse.size_bytes() > 0;
  RETURN_IF_ERROR(CheckSize("o", response.o, outputs.o.size()));
  if (has_lse) RETURN_IF_ERROR(CheckSize("lse", response.lse, lse_bytes));
  response.o.CopyTo(outputs.o.data());
  if (has_lse) response.lse.CopyTo(reinterpret_cast<uint8_t*>(outputs.lse.data()));
  ForwardOutcome outcome;
  outcome.step_committed = response.step_committed;
  return outcome;
}

std::vector<grpc::Slice> SlicesOf(const grpc::ByteBuffer& message) {
  std::vector<grpc::Slice> slices;
  if (!message.Dump(&slices).ok()) slices.clear();
  return slices;
}

}  // namespace

grpc::ByteBuffer EncodeForwardRequest(bool stream, uint64_t tag, uint64_t step_id, int32_t layer,
                                      const TensorView& q, const TensorView& k,
                                      const TensorView& v) {
  wire::ForwardRequestBytes request;
  request.step_id = step_id;
  request.layer = layer;
  request.q = Bytes(q);
  request.k = Bytes(k);
  request.v = Bytes(v);
  return wire::EncodeForwardRequest(request,
                                    stream ? std::optional<uint64_t>(tag) : std::nullopt);
}

absl::StatusOr<ForwardOutcome> DecodeForwardResponse(const grpc::ByteBuffer& message,
                                                     const ForwardOutputBuffers& outputs) {
  const std::vector<grpc::Slice> slices = SlicesOf(message);
  wire::ForwardResponse forward;
  if (wire::DecodeForwardResponse(slices, forward) == wire::Decoded::kForward) {
    return CopyOutputs(forward, outputs);
  }
  grpc::ByteBuffer copy(message);  // shares the slices
  attnd::v1::ForwardResponse response;
  if (!grpc::SerializationTraits<attnd::v1::ForwardResponse>::Deserialize(&copy, &response)
           .ok()) {
    return absl::InternalError("Forward: the reply is not a ForwardResponse");
  }
  wire::ViewOf(response, forward);
  return CopyOutputs(forward, outputs);
}

StreamReply::StreamReply(const grpc::ByteBuffer& message)
    : message_(message), slices_(SlicesOf(message)) {
  decoded_ = wire::DecodeStreamResponse(slices_, tag_, forward_) == wire::Decoded::kForward;
  if (decoded_) return;
  // Not a forward the codec reads (another payload, an error, or an encoding left to
  // protobuf): protobuf reads the message once, for the tag and for whoever takes it.
  grpc::ByteBuffer copy(message_);
  parsed_.emplace();
  valid_ = grpc::SerializationTraits<attnd::v1::StreamResponse>::Deserialize(&copy, &*parsed_)
               .ok();
  tag_ = valid_ ? parsed_->tag() : 0;
}

absl::StatusOr<ForwardOutcome> StreamReply::ForwardOutputs(
    const ForwardOutputBuffers& outputs) const {
  if (decoded_) return CopyOutputs(forward_, outputs);
  if (!valid_) return absl::InternalError("ForwardStream: a reply is not a StreamResponse");
  if (parsed_->has_error()) return FromStreamError(parsed_->error());
  if (!parsed_->has_forward()) {
    return absl::InternalError("stream response to a forward carries no forward");
  }
  wire::ForwardResponse forward;
  wire::ViewOf(parsed_->forward(), forward);
  return CopyOutputs(forward, outputs);
}

absl::StatusOr<attnd::v1::StreamResponse> StreamReply::Parsed() {
  if (!parsed_.has_value()) {
    grpc::ByteBuffer copy(message_);
    parsed_.emplace();
    valid_ = grpc::SerializationTraits<attnd::v1::StreamResponse>::Deserialize(&copy, &*parsed_)
                 .ok();
  }
  if (!valid_) return absl::InternalError("ForwardStream: a reply is not a StreamResponse");
  return std::move(*parsed_);
}

}  // namespace attnd::client
