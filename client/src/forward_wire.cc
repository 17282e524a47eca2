#include "forward_wire.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "attnd/client/status.h"
#include "attnd/v1/attnd.grpc.pb.h"

namespace attnd::client {
namespace {

// ---- writing ----------------------------------------------------------------------------------

size_t PutVarint(uint64_t value, uint8_t* out) {
  size_t n = 0;
  while (value >= 0x80) {
    out[n++] = static_cast<uint8_t>(value | 0x80);
    value >>= 7;
  }
  out[n++] = static_cast<uint8_t>(value);
  return n;
}

size_t VarintSize(uint64_t value) {
  size_t n = 1;
  for (; value >= 0x80; value >>= 7) ++n;
  return n;
}

// A Tensor's fields before its data: dtype, packed shape, data's key and length.
std::string TensorHead(const TensorView& tensor) {
  uint8_t buffer[16];
  std::string head;
  if (tensor.dtype != 0) {
    buffer[0] = 0x08;
    head.append(reinterpret_cast<char*>(buffer),
                1 + PutVarint(static_cast<uint64_t>(tensor.dtype), buffer + 1));
  }
  if (!tensor.shape.empty()) {
    size_t packed = 0;
    for (const int64_t dim : tensor.shape) packed += VarintSize(static_cast<uint64_t>(dim));
    buffer[0] = 0x12;
    head.append(reinterpret_cast<char*>(buffer), 1 + PutVarint(packed, buffer + 1));
    for (const int64_t dim : tensor.shape) {
      head.append(reinterpret_cast<char*>(buffer), PutVarint(static_cast<uint64_t>(dim), buffer));
    }
  }
  if (!tensor.bytes.empty()) {
    buffer[0] = 0x1a;
    head.append(reinterpret_cast<char*>(buffer), 1 + PutVarint(tensor.bytes.size(), buffer + 1));
  }
  return head;
}

void AppendKey(std::string& out, uint8_t key, uint64_t length) {
  uint8_t buffer[11];
  buffer[0] = key;
  out.append(reinterpret_cast<char*>(buffer), 1 + PutVarint(length, buffer + 1));
}

// ---- reading ----------------------------------------------------------------------------------

enum WireType : uint32_t { kVarint = 0, kFixed64 = 1, kLength = 2, kFixed32 = 5 };

// Reads a protobuf encoding spread over slices, within a limit.
class SliceReader {
 public:
  SliceReader() = default;
  SliceReader(const std::vector<grpc::Slice>* slices, int64_t limit)
      : slices_(slices), remaining_(limit) {
    SkipEmpty();
  }
  bool done() const { return remaining_ == 0; }

  bool ReadVarint(uint64_t& value) {
    value = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      if (remaining_ <= 0 || index_ >= slices_->size()) return false;
      const uint8_t byte = (*slices_)[index_].begin()[offset_];
      Advance(1);
      value |= static_cast<uint64_t>(byte & 0x7f) << shift;
      if ((byte & 0x80) == 0) return true;
    }
    return false;
  }
  bool ReadTag(uint32_t& field, uint32_t& wire_type) {
    uint64_t key;
    if (!ReadVarint(key) || key > 0xffffffffu) return false;
    field = static_cast<uint32_t>(key >> 3);
    wire_type = static_cast<uint32_t>(key & 7);
    return field != 0;
  }
  bool ReadLength(int64_t& length) {
    uint64_t value;
    if (!ReadVarint(value) || value > static_cast<uint64_t>(remaining_)) return false;
    length = static_cast<int64_t>(value);
    return true;
  }
  // Copies the next `bytes` bytes to `out` (null: skips them).
  bool Read(int64_t bytes, uint8_t* out) {
    if (bytes < 0 || bytes > remaining_) return false;
    while (bytes > 0) {
      if (index_ >= slices_->size()) return false;
      const int64_t available =
          static_cast<int64_t>((*slices_)[index_].size()) - static_cast<int64_t>(offset_);
      const int64_t step = std::min(bytes, available);
      if (out != nullptr) {
        std::memcpy(out, (*slices_)[index_].begin() + offset_, static_cast<size_t>(step));
        out += step;
      }
      Advance(step);
      bytes -= step;
    }
    return true;
  }
  bool Sub(int64_t bytes, SliceReader& sub) {
    if (bytes < 0 || bytes > remaining_) return false;
    sub = *this;
    sub.remaining_ = bytes;
    return Read(bytes, nullptr);
  }
  bool SkipField(uint32_t wire_type) {
    uint64_t ignored;
    int64_t length;
    switch (wire_type) {
      case kVarint:
        return ReadVarint(ignored);
      case kFixed64:
        return Read(8, nullptr);
      case kLength:
        return ReadLength(length) && Read(length, nullptr);
      case kFixed32:
        return Read(4, nullptr);
      default:
        return false;
    }
  }

 private:
  void Advance(int64_t bytes) {
    offset_ += static_cast<size_t>(bytes);
    remaining_ -= bytes;
    if (offset_ >= (*slices_)[index_].size()) {
      ++index_;
      offset_ = 0;
      SkipEmpty();
    }
  }
  void SkipEmpty() {
    while (index_ < slices_->size() && (*slices_)[index_].size() == 0) ++index_;
  }

  const std::vector<grpc::Slice>* slices_ = nullptr;
  size_t index_ = 0;
  size_t offset_ = 0;
  int64_t remaining_ = 0;
};

int64_t TotalBytes(const std::vector<grpc::Slice>& slices) {
  int64_t total = 0;
  for (const grpc::Slice& slice : slices) total += static_cast<int64_t>(slice.size());
  return total;
}

// A Tensor's data copied into `out`, which must be exactly its size. false: an encoding this
// reader does not take (protobuf will).
bool ReadTensorData(SliceReader& reader, std::span<uint8_t> out, const char* field,
                    absl::Status& status) {
  bool seen = false;
  while (!reader.done()) {
    uint32_t number, wire_type;
    if (!reader.ReadTag(number, wire_type)) return false;
    if (number == 3) {
      int64_t length;
      if (wire_type != kLength || !reader.ReadLength(length)) return false;
      if (length != static_cast<int64_t>(out.size())) {
        if (!reader.Read(length, nullptr)) return false;
        status = absl::InvalidArgumentError(
            absl::StrCat(field, ": the output buffer holds ", out.size(), " bytes, the reply ",
                         length));
        seen = true;
        continue;
      }
      if (!reader.Read(length, out.data())) return false;
      seen = true;
    } else if (number == 4) {
      return false;  // values
    } else if (!reader.SkipField(wire_type)) {
      return false;
    }
  }
  if (!seen && !out.empty() && status.ok()) {
    status = absl::InvalidArgumentError(absl::StrCat(field, ": the reply has no data"));
  }
  return true;
}

bool ReadForwardResponse(SliceReader& reader, const ForwardOutputBuffers& outputs,
                         ForwardOutcome& outcome, absl::Status& status) {
  bool seen_o = false;
  while (!reader.done()) {
    uint32_t number, wire_type;
    if (!reader.ReadTag(number, wire_type)) return false;
    int64_t length;
    if (number == 1 || number == 2) {
      if (wire_type != kLength || !reader.ReadLength(length)) return false;
      SliceReader tensor;
      if (!reader.Sub(length, tensor)) return false;
      if (number == 1) {
        if (seen_o) return false;  // a repeated message field merges: protobuf's business
        seen_o = true;
        if (!ReadTensorData(tensor, outputs.o, "o", status)) return false;
      } else {
        std::span<uint8_t> lse(reinterpret_cast<uint8_t*>(outputs.lse.data()),
                               outputs.lse.size() * sizeof(float));
        if (!ReadTensorData(tensor, lse, "lse", status)) return false;
      }
    } else if (number == 3) {
      uint64_t value;
      if (wire_type != kVarint || !reader.ReadVarint(value)) return false;
      outcome.step_committed = value != 0;
    } else if (!reader.SkipField(wire_type)) {
      return false;
    }
  }
  if (!seen_o && !outputs.o.empty() && status.ok()) {
    status = absl::InvalidArgumentError("o: the reply has none");
  }
  return true;
}

// The slow path: protobuf, then copy.
absl::StatusOr<ForwardOutcome> FromProto(const attnd::v1::ForwardResponse& response,
                                         const ForwardOutputBuffers& outputs) {
  const std::string& o = response.o().data();
  if (o.size() != outputs.o.size()) {
    return absl::InvalidArgumentError(absl::StrCat("o: the output buffer holds ",
                                                   outputs.o.size(), " bytes, the reply ",
                                                   o.size()));
  }
  std::memcpy(outputs.o.data(), o.data(), o.size());
  const std::string& lse = response.lse().data();
  if (!lse.empty()) {
    if (lse.size() != outputs.lse.size() * sizeof(float)) {
      return absl::InvalidArgumentError("lse: the output buffer does not match the reply");
    }
    std::memcpy(outputs.lse.data(), lse.data(), lse.size());
  }
  ForwardOutcome outcome;
  outcome.step_committed = response.step_committed();
  return outcome;
}

}  // namespace

grpc::ByteBuffer EncodeForwardRequest(bool stream, uint64_t tag, uint64_t step_id, int32_t layer,
                                      const TensorView& q, const TensorView& k,
                                      const TensorView& v) {
  const TensorView* tensors[] = {&q, &k, &v};
  std::string heads[3];
  uint64_t body = 0;
  if (step_id != 0) body += 1 + VarintSize(step_id);
  const uint64_t layer_bits = static_cast<uint64_t>(static_cast<int64_t>(layer));
  if (layer != 0) body += 1 + VarintSize(layer_bits);
  for (int i = 0; i < 3; ++i) {
    heads[i] = TensorHead(*tensors[i]);
    const uint64_t message = heads[i].size() + tensors[i]->bytes.size();
    body += 1 + VarintSize(message) + message;
  }
  std::string first;
  uint8_t buffer[11];
  if (stream) {
    if (tag != 0) {
      buffer[0] = 0x08;
      first.append(reinterpret_cast<char*>(buffer), 1 + PutVarint(tag, buffer + 1));
    }
    AppendKey(first, 0x1a, body);  // StreamRequest.forward
  }
  if (step_id != 0) {
    buffer[0] = 0x08;
    first.append(reinterpret_cast<char*>(buffer), 1 + PutVarint(step_id, buffer + 1));
  }
  if (layer != 0) {
    buffer[0] = 0x10;
    first.append(reinterpret_cast<char*>(buffer), 1 + PutVarint(layer_bits, buffer + 1));
  }
  grpc::Slice slices[6];
  size_t count = 0;
  for (int i = 0; i < 3; ++i) {
    std::string head = i == 0 ? std::move(first) : std::string();
    AppendKey(head, static_cast<uint8_t>(0x1a + 8 * i), heads[i].size() + tensors[i]->bytes.size());
    head += heads[i];
    slices[count++] = grpc::Slice(head);
    if (!tensors[i]->bytes.empty()) {
      // Referenced in place: the caller keeps the bytes until the call's callback.
      slices[count++] = grpc::Slice(tensors[i]->bytes.data(), tensors[i]->bytes.size(),
                                    grpc::Slice::STATIC_SLICE);
    }
  }
  return grpc::ByteBuffer(slices, count);
}

uint64_t StreamResponseTag(const grpc::ByteBuffer& message) {
  std::vector<grpc::Slice> slices;
  if (!message.Dump(&slices).ok()) return 0;
  SliceReader reader(&slices, TotalBytes(slices));
  uint64_t tag = 0;
  while (!reader.done()) {
    uint32_t number, wire_type;
    if (!reader.ReadTag(number, wire_type)) return tag;
    if (number == 1 && wire_type == kVarint) {
      if (!reader.ReadVarint(tag)) return 0;
    } else if (!reader.SkipField(wire_type)) {
      return tag;
    }
  }
  return tag;
}

absl::StatusOr<ForwardOutcome> DecodeForwardResponse(const grpc::ByteBuffer& message, bool stream,
                                                     const ForwardOutputBuffers& outputs) {
  std::vector<grpc::Slice> slices;
  if (message.Dump(&slices).ok()) {
    SliceReader reader(&slices, TotalBytes(slices));
    ForwardOutcome outcome;
    absl::Status status;
    bool parsed = true;
    bool seen_forward = false;
    if (!stream) {
      parsed = ReadForwardResponse(reader, outputs, outcome, status);
      seen_forward = true;
    } else {
      while (parsed && !reader.done()) {
        uint32_t number, wire_type;
        int64_t length;
        if (!reader.ReadTag(number, wire_type)) {
          parsed = false;
        } else if (number == 4 && wire_type == kLength && !seen_forward) {
          SliceReader sub;
          seen_forward = true;
          parsed = reader.ReadLength(length) && reader.Sub(length, sub) &&
                   ReadForwardResponse(sub, outputs, outcome, status);
        } else if (number == 2 || number == 3 || number == 4 || number == 5) {
          parsed = false;  // an error, another payload, or a repeat: protobuf reads it
        } else {
          parsed = reader.SkipField(wire_type);
        }
      }
    }
    if (parsed && seen_forward) {
      if (!status.ok()) return status;
      return outcome;
    }
  }
  grpc::ByteBuffer copy(message);
  if (!stream) {
    attnd::v1::ForwardResponse response;
    if (!grpc::SerializationTraits<attnd::v1::ForwardResponse>::Deserialize(&copy, &response)
             .ok()) {
      return absl::InternalError("Forward: the reply is not a ForwardResponse");
    }
    return FromProto(response, outputs);
  }
  attnd::v1::StreamResponse response;
  if (!grpc::SerializationTraits<attnd::v1::StreamResponse>::Deserialize(&copy, &response).ok()) {
    return absl::InternalError("ForwardStream: a reply is not a StreamResponse");
  }
  if (response.has_error()) return FromStreamError(response.error());
  if (!response.has_forward()) {
    return absl::InternalError("stream response to a forward carries no forward");
  }
  return FromProto(response.forward(), outputs);
}

}  // namespace attnd::client
