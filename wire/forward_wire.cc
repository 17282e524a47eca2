#include "attnd/wire/forward_wire.h"

#include <algorithm>
#include <cstring>
#include <iterator>
#include <utility>

namespace attnd::wire {
namespace {

// ---- the wire format --------------------------------------------------------------------------

enum WireType : uint32_t { kVarint = 0, kFixed64 = 1, kLength = 2, kStartGroup = 3, kFixed32 = 5 };

// Every field number below is the generated constant; the writers put keys in one byte, which a
// field number above 15 would break at compile time here.
consteval uint8_t Key(int field, WireType type) {
  if (field < 1 || field > 15) throw "a one-byte key needs a field number in 1..15";
  return static_cast<uint8_t>((field << 3) | type);
}

// The codec reads and writes by the generated constants, so it follows attnd.proto; these
// pin the numbers themselves: a renumbered field is a wire break for every deployed client.
static_assert(v1::Tensor::kDtypeFieldNumber == 1 && v1::Tensor::kShapeFieldNumber == 2 &&
              v1::Tensor::kDataFieldNumber == 3 && v1::Tensor::kValuesFieldNumber == 4);
static_assert(v1::ForwardRequest::kStepIdFieldNumber == 1 &&
              v1::ForwardRequest::kLayerFieldNumber == 2 &&
              v1::ForwardRequest::kQFieldNumber == 3 && v1::ForwardRequest::kKFieldNumber == 4 &&
              v1::ForwardRequest::kVFieldNumber == 5 &&
              v1::ForwardRequest::kQPeFieldNumber == 6 &&
              v1::ForwardRequest::kCkvFieldNumber == 7 &&
              v1::ForwardRequest::kKpeFieldNumber == 8 &&
              v1::ForwardRequest::kUseChannelFieldNumber == 9);
static_assert(v1::ForwardResponse::kOFieldNumber == 1 &&
              v1::ForwardResponse::kLseFieldNumber == 2 &&
              v1::ForwardResponse::kStepCommittedFieldNumber == 3);
static_assert(v1::StreamRequest::kTagFieldNumber == 1 && v1::StreamRequest::kPlanFieldNumber == 2 &&
              v1::StreamRequest::kForwardFieldNumber == 3 &&
              v1::StreamRequest::kEndStepFieldNumber == 4);
static_assert(v1::StreamResponse::kTagFieldNumber == 1 &&
              v1::StreamResponse::kErrorFieldNumber == 2 &&
              v1::StreamResponse::kPlanFieldNumber == 3 &&
              v1::StreamResponse::kForwardFieldNumber == 4 &&
              v1::StreamResponse::kEndStepFieldNumber == 5);

// ---- reading ----------------------------------------------------------------------------------

// Reads a protobuf encoding spread over slices, within a limit (a sub-message's length). Every
// read fails (false) rather than run past the limit or the slices.
class SliceReader {
 public:
  SliceReader() = default;
  SliceReader(std::span<const grpc::Slice> slices, int64_t limit)
      : slices_(slices), remaining_(limit) {
    SkipEmptySlices();
  }

  bool done() const { return remaining_ == 0; }

  bool ReadVarint(uint64_t& value) {
    value = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      if (remaining_ <= 0 || index_ >= slices_.size()) return false;
      const uint8_t byte = slices_[index_].begin()[offset_];
      Advance(1);
      value |= static_cast<uint64_t>(byte & 0x7f) << shift;
      if ((byte & 0x80) == 0) return true;
    }
    return false;  // more than 10 bytes
  }

  bool ReadTag(uint32_t& field, uint32_t& wire_type) {
    uint64_t key;
    if (!ReadVarint(key) || key > 0xffffffffu) return false;
    field = static_cast<uint32_t>(key >> 3);
    wire_type = static_cast<uint32_t>(key & 7);
    return field != 0;
  }

  // A length-delimited field's length (its key already read).
  bool ReadLength(int64_t& length) {
    uint64_t value;
    if (!ReadVarint(value) || value > static_cast<uint64_t>(remaining_)) return false;
    length = static_cast<int64_t>(value);
    return true;
  }

  // Appends the next `bytes` bytes as pieces of the slices (no copy) and moves past them.
  bool ReadPieces(int64_t bytes, std::vector<std::string_view>& pieces) {
    if (bytes < 0 || bytes > remaining_) return false;
    while (bytes > 0) {
      if (index_ >= slices_.size()) return false;
      const int64_t step = std::min<int64_t>(bytes, Available());
      pieces.emplace_back(reinterpret_cast<const char*>(slices_[index_].begin()) + offset_,
                          static_cast<size_t>(step));
      Advance(step);
      bytes -= step;
    }
    return true;
  }

  // A reader of a length-delimited field's contents (its key already read); this one moves
  // past them.
  bool Sub(SliceReader& sub) {
    int64_t length;
    if (!ReadLength(length)) return false;
    sub = *this;
    sub.remaining_ = length;
    return Skip(length);
  }

 private:
  bool Skip(int64_t bytes) {
    while (bytes > 0) {
      if (index_ >= slices_.size()) return false;
      const int64_t step = std::min<int64_t>(bytes, Available());
      Advance(step);
      bytes -= step;
    }
    return true;
  }
  int64_t Available() const {
    return static_cast<int64_t>(slices_[index_].size()) - static_cast<int64_t>(offset_);
  }
  void Advance(int64_t bytes) {
    offset_ += static_cast<size_t>(bytes);
    remaining_ -= bytes;
    if (offset_ >= slices_[index_].size()) {
      ++index_;
      offset_ = 0;
      SkipEmptySlices();
    }
  }
  void SkipEmptySlices() {
    while (index_ < slices_.size() && slices_[index_].size() == 0) ++index_;
  }

  std::span<const grpc::Slice> slices_;
  size_t index_ = 0;
  size_t offset_ = 0;
  int64_t remaining_ = 0;
};

int64_t TotalBytes(std::span<const grpc::Slice> slices) {
  int64_t total = 0;
  for (const grpc::Slice& slice : slices) total += static_cast<int64_t>(slice.size());
  return total;
}

// A varint scalar field (its key read): protobuf keeps the last occurrence.
bool ReadScalar(SliceReader& reader, uint32_t wire_type, uint64_t& value) {
  return wire_type == kVarint && reader.ReadVarint(value);
}

// A Tensor's contents. Declines `values` (converted by the server from protobuf's parse) and
// every field it does not know.
bool ReadTensor(SliceReader& reader, Tensor& tensor) {
  tensor.present = true;
  while (!reader.done()) {
    uint32_t field, wire_type;
    if (!reader.ReadTag(field, wire_type)) return false;
    uint64_t value;
    switch (field) {
      case v1::Tensor::kDtypeFieldNumber:
        if (!ReadScalar(reader, wire_type, value)) return false;
        tensor.dtype = static_cast<int32_t>(value);  // an enum keeps the low 32 bits
        break;
      case v1::Tensor::kShapeFieldNumber:  // packed, or one varint per element
        if (wire_type == kVarint) {
          if (!reader.ReadVarint(value)) return false;
          tensor.shape.push_back(static_cast<int64_t>(value));
        } else if (wire_type == kLength) {
          SliceReader packed;
          if (!reader.Sub(packed)) return false;
          while (!packed.done()) {
            if (!packed.ReadVarint(value)) return false;
            tensor.shape.push_back(static_cast<int64_t>(value));
          }
        } else {
          return false;
        }
        break;
      case v1::Tensor::kDataFieldNumber: {  // the last occurrence wins
        int64_t length;
        if (wire_type != kLength || !reader.ReadLength(length)) return false;
        tensor.pieces.clear();
        if (!reader.ReadPieces(length, tensor.pieces)) return false;
        break;
      }
      default:  // values, or a field this codec does not carry
        return false;
    }
  }
  return true;
}

// A message field of type Tensor (its key read). Seen twice, protobuf merges the two: declined.
bool ReadTensorField(SliceReader& reader, uint32_t wire_type, Tensor& tensor) {
  if (wire_type != kLength || tensor.present) return false;
  SliceReader sub;
  return reader.Sub(sub) && ReadTensor(sub, tensor);
}

bool ReadForwardRequest(SliceReader& reader, ForwardRequest& out) {
  while (!reader.done()) {
    uint32_t field, wire_type;
    if (!reader.ReadTag(field, wire_type)) return false;
    uint64_t value;
    switch (field) {
      case v1::ForwardRequest::kStepIdFieldNumber:
        if (!ReadScalar(reader, wire_type, out.step_id)) return false;
        break;
      case v1::ForwardRequest::kLayerFieldNumber:
        if (!ReadScalar(reader, wire_type, value)) return false;
        out.layer = static_cast<int32_t>(value);  // int32 fields keep the low 32 bits
        break;
      case v1::ForwardRequest::kQFieldNumber:
        if (!ReadTensorField(reader, wire_type, out.q)) return false;
        break;
      case v1::ForwardRequest::kKFieldNumber:
        if (!ReadTensorField(reader, wire_type, out.k)) return false;
        break;
      case v1::ForwardRequest::kVFieldNumber:
        if (!ReadTensorField(reader, wire_type, out.v)) return false;
        break;
      case v1::ForwardRequest::kQPeFieldNumber:
        if (!ReadTensorField(reader, wire_type, out.q_pe)) return false;
        break;
      case v1::ForwardRequest::kCkvFieldNumber:
        if (!ReadTensorField(reader, wire_type, out.ckv)) return false;
        break;
      case v1::ForwardRequest::kKpeFieldNumber:
        if (!ReadTensorField(reader, wire_type, out.kpe)) return false;
        break;
      default:  // use_channel (its reply differs: the slow path's business), or unknown
        return false;
    }
  }
  return true;
}

bool ReadForwardResponse(SliceReader& reader, ForwardResponse& out) {
  while (!reader.done()) {
    uint32_t field, wire_type;
    if (!reader.ReadTag(field, wire_type)) return false;
    uint64_t value;
    switch (field) {
      case v1::ForwardResponse::kOFieldNumber:
        if (!ReadTensorField(reader, wire_type, out.o)) return false;
        break;
      case v1::ForwardResponse::kLseFieldNumber:
        if (!ReadTensorField(reader, wire_type, out.lse)) return false;
        break;
      case v1::ForwardResponse::kStepCommittedFieldNumber:
        if (!ReadScalar(reader, wire_type, value)) return false;
        out.step_committed = value != 0;
        break;
      default:
        return false;
    }
  }
  return true;
}

// A StreamRequest or StreamResponse whose payload is a forward: `tag` at field 1, the forward at
// `forward_field`; any other field (another payload, an error, an unknown one) declines.
template <typename Message, typename ReadForward>
Decoded ReadStreamMessage(std::span<const grpc::Slice> slices, uint32_t forward_field,
                          uint64_t& tag, Message& out, ReadForward read_forward) {
  out.Clear();
  tag = 0;
  SliceReader reader(slices, TotalBytes(slices));
  bool seen_forward = false;
  while (!reader.done()) {
    uint32_t field, wire_type;
    if (!reader.ReadTag(field, wire_type)) return Decoded::kOther;
    if (field == v1::StreamRequest::kTagFieldNumber) {  // StreamResponse's too (pinned above)
      if (!ReadScalar(reader, wire_type, tag)) return Decoded::kOther;
    } else if (field == forward_field) {
      // Twice: protobuf merges the two.
      if (wire_type != kLength || seen_forward) return Decoded::kOther;
      seen_forward = true;
      SliceReader sub;
      if (!reader.Sub(sub) || !read_forward(sub, out)) return Decoded::kOther;
    } else {
      return Decoded::kOther;
    }
  }
  return seen_forward ? Decoded::kForward : Decoded::kOther;
}

// ---- writing ----------------------------------------------------------------------------------

// Writes protobuf's encoding to `out`, or, with `out` null, only counts the bytes.
class Writer {
 public:
  explicit Writer(uint8_t* out = nullptr) : out_(out) {}
  size_t size() const { return size_; }

  void Byte(uint8_t byte) {
    if (out_ != nullptr) out_[size_] = byte;
    ++size_;
  }
  void Varint(uint64_t value) {
    for (; value >= 0x80; value >>= 7) Byte(static_cast<uint8_t>(value | 0x80));
    Byte(static_cast<uint8_t>(value));
  }
  void Bytes(std::span<const uint8_t> bytes) {
    if (out_ != nullptr && !bytes.empty()) std::memcpy(out_ + size_, bytes.data(), bytes.size());
    size_ += bytes.size();
  }

 private:
  uint8_t* out_;
  size_t size_ = 0;
};

size_t VarintSize(uint64_t value) {
  Writer counter;
  counter.Varint(value);
  return counter.size();
}

// A slice holding what `write(Writer&)` writes: counted first, then written in place.
template <typename Write>
grpc::Slice Head(const Write& write) {
  Writer counter;
  write(counter);
  grpc::Slice slice(counter.size());
  Writer writer(const_cast<uint8_t*>(slice.begin()));  // freshly allocated: ours to fill
  write(writer);
  return slice;
}

// A Tensor's fields before its data bytes: dtype, packed shape, data's key and length. Default
// values are not written (as protobuf does).
void TensorHead(const TensorBytes& tensor, Writer& out) {
  if (tensor.dtype != 0) {
    out.Byte(Key(v1::Tensor::kDtypeFieldNumber, kVarint));
    out.Varint(static_cast<uint64_t>(static_cast<int64_t>(tensor.dtype)));
  }
  if (!tensor.shape.empty()) {
    size_t packed = 0;
    for (const int64_t dim : tensor.shape) packed += VarintSize(static_cast<uint64_t>(dim));
    out.Byte(Key(v1::Tensor::kShapeFieldNumber, kLength));
    out.Varint(packed);
    for (const int64_t dim : tensor.shape) out.Varint(static_cast<uint64_t>(dim));
  }
  if (!tensor.bytes.empty()) {
    out.Byte(Key(v1::Tensor::kDataFieldNumber, kLength));
    out.Varint(tensor.bytes.size());
  }
}

// The encoded size of a Tensor message (without its own key and length).
uint64_t TensorMessageBytes(const TensorBytes& tensor) {
  Writer counter;
  TensorHead(tensor, counter);
  return counter.size() + tensor.bytes.size();
}

// A Tensor as a message field: key, length, head.
void TensorFieldHead(uint8_t key, const TensorBytes& tensor, Writer& out) {
  out.Byte(key);
  out.Varint(TensorMessageBytes(tensor));
  TensorHead(tensor, out);
}

uint64_t TensorFieldBytes(const TensorBytes& tensor) {
  const uint64_t message = TensorMessageBytes(tensor);
  return 1 + VarintSize(message) + message;
}

void StreamHead(std::optional<uint64_t> stream_tag, uint8_t forward_key, uint64_t forward_bytes,
                Writer& out) {
  if (!stream_tag.has_value()) return;
  if (*stream_tag != 0) {
    out.Byte(Key(v1::StreamRequest::kTagFieldNumber, kVarint));
    out.Varint(*stream_tag);
  }
  out.Byte(forward_key);
  out.Varint(forward_bytes);
}

}  // namespace

// ---- read ------------------------------------------------------------------------------------

void Tensor::Clear() {
  present = false;
  dtype = 0;
  shape.clear();
  pieces.clear();
}

int64_t Tensor::size_bytes() const {
  int64_t bytes = 0;
  for (const std::string_view piece : pieces) bytes += static_cast<int64_t>(piece.size());
  return bytes;
}

void Tensor::CopyTo(uint8_t* out) const {
  for (const std::string_view piece : pieces) {
    std::memcpy(out, piece.data(), piece.size());
    out += piece.size();
  }
}

void ForwardRequest::Clear() {
  step_id = 0;
  layer = 0;
  for (Tensor* tensor : {&q, &k, &v, &q_pe, &ckv, &kpe}) tensor->Clear();
}

void ForwardResponse::Clear() {
  o.Clear();
  lse.Clear();
  step_committed = false;
}

Decoded DecodeForwardRequest(std::span<const grpc::Slice> slices, ForwardRequest& out) {
  out.Clear();
  SliceReader reader(slices, TotalBytes(slices));
  return ReadForwardRequest(reader, out) ? Decoded::kForward : Decoded::kOther;
}

Decoded DecodeStreamRequest(std::span<const grpc::Slice> slices, uint64_t& tag,
                            ForwardRequest& out) {
  return ReadStreamMessage(slices, v1::StreamRequest::kForwardFieldNumber, tag, out,
                           &ReadForwardRequest);
}

Decoded DecodeForwardResponse(std::span<const grpc::Slice> slices, ForwardResponse& out) {
  out.Clear();
  SliceReader reader(slices, TotalBytes(slices));
  return ReadForwardResponse(reader, out) ? Decoded::kForward : Decoded::kOther;
}

Decoded DecodeStreamResponse(std::span<const grpc::Slice> slices, uint64_t& tag,
                             ForwardResponse& out) {
  return ReadStreamMessage(slices, v1::StreamResponse::kForwardFieldNumber, tag, out,
                           &ReadForwardResponse);
}

void ViewOf(const v1::Tensor& tensor, Tensor& out) {
  out.Clear();
  out.present = true;
  out.dtype = tensor.dtype();
  out.shape.assign(tensor.shape().begin(), tensor.shape().end());
  if (!tensor.data().empty()) out.pieces.push_back(tensor.data());
}

void ViewOf(const v1::ForwardRequest& request, ForwardRequest& out) {
  out.Clear();
  out.step_id = request.step_id();
  out.layer = request.layer();
  if (request.has_q()) ViewOf(request.q(), out.q);
  if (request.has_k()) ViewOf(request.k(), out.k);
  if (request.has_v()) ViewOf(request.v(), out.v);
  if (request.has_q_pe()) ViewOf(request.q_pe(), out.q_pe);
  if (request.has_ckv()) ViewOf(request.ckv(), out.ckv);
  if (request.has_kpe()) ViewOf(request.kpe(), out.kpe);
}

void ViewOf(const v1::ForwardResponse& response, ForwardResponse& out) {
  out.Clear();
  if (response.has_o()) ViewOf(response.o(), out.o);
  if (response.has_lse()) ViewOf(response.lse(), out.lse);
  out.step_committed = response.step_committed();
}

// ---- write -----------------------------------------------------------------------------------

grpc::ByteBuffer EncodeForwardRequest(const ForwardRequestBytes& request,
                                      std::optional<uint64_t> stream_tag) {
  const struct {
    uint8_t key;
    const std::optional<TensorBytes>& tensor;
  } tensors[] = {
      {Key(v1::ForwardRequest::kQFieldNumber, kLength), request.q},
      {Key(v1::ForwardRequest::kKFieldNumber, kLength), request.k},
      {Key(v1::ForwardRequest::kVFieldNumber, kLength), request.v},
      {Key(v1::ForwardRequest::kQPeFieldNumber, kLength), request.q_pe},
      {Key(v1::ForwardRequest::kCkvFieldNumber, kLength), request.ckv},
      {Key(v1::ForwardRequest::kKpeFieldNumber, kLength), request.kpe},
  };
  // int32 is written as the sign-extended 64-bit value, as protobuf does.
  const uint64_t layer = static_cast<uint64_t>(static_cast<int64_t>(request.layer));
  const auto write_scalars = [&](Writer& out) {
    if (request.step_id != 0) {
      out.Byte(Key(v1::ForwardRequest::kStepIdFieldNumber, kVarint));
      out.Varint(request.step_id);
    }
    if (request.layer != 0) {
      out.Byte(Key(v1::ForwardRequest::kLayerFieldNumber, kVarint));
      out.Varint(layer);
    }
  };
  Writer scalars;
  write_scalars(scalars);
  uint64_t body = scalars.size();
  for (const auto& t : tensors) {
    if (t.tensor.has_value()) body += TensorFieldBytes(*t.tensor);
  }

  // One head slice before each tensor's bytes (the first also carries the scalars and the
  // stream wrapper), each tensor's bytes referenced.
  grpc::Slice slices[2 * std::size(tensors) + 1];
  size_t count = 0;
  bool first = true;
  const auto write_prefix = [&](Writer& out) {
    StreamHead(stream_tag, Key(v1::StreamRequest::kForwardFieldNumber, kLength), body, out);
    write_scalars(out);
  };
  for (const auto& t : tensors) {
    if (!t.tensor.has_value()) continue;
    const TensorBytes& tensor = *t.tensor;
    slices[count++] = Head([&](Writer& out) {
      if (first) write_prefix(out);
      TensorFieldHead(t.key, tensor, out);
    });
    first = false;
    if (!tensor.bytes.empty()) {
      // Referenced in place: the caller keeps the bytes until the call completes.
      slices[count++] =
          grpc::Slice(tensor.bytes.data(), tensor.bytes.size(), grpc::Slice::STATIC_SLICE);
    }
  }
  if (first) slices[count++] = Head(write_prefix);  // no tensors
  return grpc::ByteBuffer(slices, count);
}

void EncodeForwardResponse(const ForwardResponseBytes& response, Lent o_owner,
                           grpc::ByteBuffer& out, std::optional<uint64_t> stream_tag) {
  constexpr uint8_t kOKey = Key(v1::ForwardResponse::kOFieldNumber, kLength);
  uint64_t body = TensorFieldBytes(response.o);

  // After o's bytes: lse (copied) and step_committed.
  const auto write_tail = [&](Writer& writer) {
    if (response.lse.has_value()) {
      TensorFieldHead(Key(v1::ForwardResponse::kLseFieldNumber, kLength), *response.lse, writer);
      writer.Bytes(response.lse->bytes);
    }
    if (response.step_committed) {
      writer.Byte(Key(v1::ForwardResponse::kStepCommittedFieldNumber, kVarint));
      writer.Byte(1);
    }
  };
  Writer tail_counter;
  write_tail(tail_counter);
  body += tail_counter.size();

  // Written before o's owner may get its bytes back: lse may live in the same lent memory.
  grpc::Slice tail = tail_counter.size() > 0 ? Head(write_tail) : grpc::Slice();

  grpc::Slice slices[3];
  size_t count = 0;
  slices[count++] = Head([&](Writer& writer) {
    StreamHead(stream_tag, Key(v1::StreamResponse::kForwardFieldNumber, kLength), body, writer);
    TensorFieldHead(kOKey, response.o, writer);
  });
  const std::span<const uint8_t> o = response.o.bytes;
  if (!o.empty() && o_owner.release != nullptr) {
    // gRPC unrefs the slice once the bytes are written (or the message is dropped): the owner
    // gets them back then.
    slices[count++] = grpc::Slice(const_cast<uint8_t*>(o.data()), o.size(), o_owner.release,
                                  o_owner.release_arg);
  } else {
    if (!o.empty()) slices[count++] = grpc::Slice(o.data(), o.size());  // copied
    if (o_owner.release != nullptr) o_owner.release(o_owner.release_arg);
  }
  if (tail.size() > 0) slices[count++] = std::move(tail);
  grpc::ByteBuffer buffer(slices, count);
  out.Swap(&buffer);
}

}  // namespace attnd::wire
