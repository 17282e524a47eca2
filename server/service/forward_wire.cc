#include "service/forward_wire.h"

#include <algorithm>
#include <cstring>
#include <string>

namespace attnd {
namespace {

enum WireType : uint32_t { kVarint = 0, kFixed64 = 1, kLength = 2, kFixed32 = 5 };

// Reads a protobuf encoding spread over slices, within a limit (a sub-message's length).
class SliceReader {
 public:
  SliceReader(std::span<const grpc::Slice> slices, int64_t limit)
      : slices_(slices), remaining_(limit) {
    SkipEmptySlices();
  }

  bool done() const { return remaining_ == 0; }

  bool ReadByte(uint8_t& byte) {
    if (remaining_ <= 0 || index_ >= slices_.size()) return false;
    byte = slices_[index_].begin()[offset_];
    Advance(1);
    return true;
  }

  bool ReadVarint(uint64_t& value) {
    value = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      uint8_t byte;
      if (!ReadByte(byte)) return false;
      value |= static_cast<uint64_t>(byte & 0x7f) << shift;
      if ((byte & 0x80) == 0) return true;
    }
    return false;  // more than 10 bytes
  }

  bool Skip(int64_t bytes) {
    if (bytes < 0 || bytes > remaining_) return false;
    while (bytes > 0) {
      if (index_ >= slices_.size()) return false;
      const int64_t step = std::min<int64_t>(bytes, Available());
      Advance(step);
      bytes -= step;
    }
    return true;
  }

  // Appends `bytes` bytes as pieces of the slices (no copy) and moves past them.
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

  // A reader of the next `bytes` bytes; this one moves past them.
  bool Sub(int64_t bytes, SliceReader& sub) {
    if (bytes < 0 || bytes > remaining_) return false;
    sub = *this;
    sub.remaining_ = bytes;
    return Skip(bytes);
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

  // Skips a field of an unknown number; groups (deprecated) are declined.
  bool SkipField(uint32_t wire_type) {
    uint64_t ignored;
    int64_t length;
    switch (wire_type) {
      case kVarint:
        return ReadVarint(ignored);
      case kFixed64:
        return Skip(8);
      case kLength:
        return ReadLength(length) && Skip(length);
      case kFixed32:
        return Skip(4);
      default:
        return false;
    }
  }

 private:
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

bool ParseTensor(SliceReader& reader, WireTensor& tensor) {
  tensor.present = true;
  while (!reader.done()) {
    uint32_t field, wire_type;
    if (!reader.ReadTag(field, wire_type)) return false;
    uint64_t value;
    int64_t length;
    switch (field) {
      case 1:  // dtype
        if (wire_type != kVarint || !reader.ReadVarint(value)) return false;
        tensor.dtype = static_cast<int32_t>(value);
        break;
      case 2:  // shape: packed or one varint per element
        if (wire_type == kVarint) {
          if (!reader.ReadVarint(value)) return false;
          tensor.shape.push_back(static_cast<int64_t>(value));
        } else if (wire_type == kLength) {
          SliceReader packed(std::span<const grpc::Slice>(), 0);
          if (!reader.ReadLength(length) || !reader.Sub(length, packed)) return false;
          while (!packed.done()) {
            if (!packed.ReadVarint(value)) return false;
            tensor.shape.push_back(static_cast<int64_t>(value));
          }
        } else {
          return false;
        }
        break;
      case 3:  // data: the last occurrence wins
        if (wire_type != kLength || !reader.ReadLength(length)) return false;
        tensor.pieces.clear();
        if (!reader.ReadPieces(length, tensor.pieces)) return false;
        break;
      case 4:  // values: the converting path
        return false;
      default:
        if (!reader.SkipField(wire_type)) return false;
    }
  }
  return true;
}

bool ParseForward(SliceReader& reader, WireForward& forward) {
  WireTensor* const tensors[] = {&forward.q,    &forward.k,   &forward.v,
                                 &forward.q_pe, &forward.ckv, &forward.kpe};
  while (!reader.done()) {
    uint32_t field, wire_type;
    if (!reader.ReadTag(field, wire_type)) return false;
    uint64_t value;
    int64_t length;
    if (field == 1 || field == 2) {
      if (wire_type != kVarint || !reader.ReadVarint(value)) return false;
      if (field == 1) {
        forward.step_id = value;
      } else {
        forward.layer = static_cast<int32_t>(value);  // int32 fields keep the low 32 bits
      }
    } else if (field >= 3 && field <= 8) {
      WireTensor& tensor = *tensors[field - 3];
      // A repeated message field merges in protobuf; leave that to protobuf.
      if (wire_type != kLength || tensor.present) return false;
      SliceReader sub(std::span<const grpc::Slice>(), 0);
      if (!reader.ReadLength(length) || !reader.Sub(length, sub)) return false;
      if (!ParseTensor(sub, tensor)) return false;
    } else {
      // A field this parser does not know (use_channel, or one added later) is left to
      // protobuf's parser, which knows every field: never dropped here.
      return false;
    }
  }
  return true;
}

// Varint encoding into `out`; returns the bytes written (at most 10).
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
  while (value >= 0x80) {
    value >>= 7;
    ++n;
  }
  return n;
}

size_t PackedShapeBytes(std::span<const int64_t> shape) {
  size_t bytes = 0;
  for (const int64_t dim : shape) bytes += VarintSize(static_cast<uint64_t>(dim));
  return bytes;
}

// A Tensor's fields before its data bytes: dtype, packed shape, data's key and length.
size_t TensorHead(int32_t dtype, std::span<const int64_t> shape, int64_t data_bytes,
                  uint8_t* out) {
  size_t n = 0;
  if (dtype != 0) {
    out[n++] = 0x08;
    n += PutVarint(static_cast<uint64_t>(dtype), out + n);
  }
  if (!shape.empty()) {
    out[n++] = 0x12;
    n += PutVarint(PackedShapeBytes(shape), out + n);
    for (const int64_t dim : shape) n += PutVarint(static_cast<uint64_t>(dim), out + n);
  }
  if (data_bytes > 0) {
    out[n++] = 0x1a;
    n += PutVarint(static_cast<uint64_t>(data_bytes), out + n);
  }
  return n;
}

// Room for a tensor head: keys, dtype and up to 8 dimensions of 10 bytes, lengths.
constexpr size_t kMaxTensorHead = 4 * 11 + 8 * 10;

void WriteResponse(bool stream, uint64_t tag, const WireResponse& response, OutputLease& lease,
                   grpc::ByteBuffer& out) {
  uint8_t o_head[kMaxTensorHead];
  const int32_t o_dtype = static_cast<int32_t>(response.o_dtype);  // same numbering as v1.DType
  const size_t o_head_bytes = TensorHead(o_dtype, response.o_shape, response.o_bytes, o_head);
  const uint64_t o_message_bytes = o_head_bytes + static_cast<uint64_t>(response.o_bytes);

  std::string tail;
  if (!response.lse_shape.empty()) {
    uint8_t lse_head[kMaxTensorHead];
    const size_t lse_head_bytes =
        TensorHead(/*DTYPE_FLOAT32=*/4, response.lse_shape, response.lse_bytes, lse_head);
    uint8_t key[11];
    key[0] = 0x12;
    const size_t key_bytes =
        1 + PutVarint(lse_head_bytes + static_cast<uint64_t>(response.lse_bytes), key + 1);
    tail.append(reinterpret_cast<const char*>(key), key_bytes);
    tail.append(reinterpret_cast<const char*>(lse_head), lse_head_bytes);
    if (response.lse_bytes > 0) {
      tail.append(reinterpret_cast<const char*>(lease.lse), static_cast<size_t>(response.lse_bytes));
    }
  }
  if (response.step_committed) tail.append("\x18\x01", 2);

  const uint64_t body_bytes = 1 + VarintSize(o_message_bytes) + o_message_bytes + tail.size();
  uint8_t head[32 + kMaxTensorHead];
  size_t n = 0;
  if (stream) {
    if (tag != 0) {
      head[n++] = 0x08;
      n += PutVarint(tag, head + n);
    }
    head[n++] = 0x22;  // StreamResponse.forward
    n += PutVarint(body_bytes, head + n);
  }
  head[n++] = 0x0a;  // ForwardResponse.o
  n += PutVarint(o_message_bytes, head + n);
  std::memcpy(head + n, o_head, o_head_bytes);
  n += o_head_bytes;

  grpc::Slice slices[3];
  size_t count = 0;
  slices[count++] = grpc::Slice(head, n);
  if (response.o_bytes > 0 && lease.release != nullptr) {
    // gRPC unrefs the slice once the bytes are written (or the message dropped): the lease
    // goes back then.
    slices[count++] = grpc::Slice(const_cast<uint8_t*>(lease.o),
                                  static_cast<size_t>(response.o_bytes), lease.release,
                                  lease.release_arg);
    lease.release = nullptr;
  } else if (response.o_bytes > 0) {
    slices[count++] = grpc::Slice(lease.o, static_cast<size_t>(response.o_bytes));
  }
  lease.Release();
  if (!tail.empty()) slices[count++] = grpc::Slice(tail);
  grpc::ByteBuffer buffer(slices, count);
  out.Swap(&buffer);
}

}  // namespace

void WireTensor::Clear() {
  present = false;
  dtype = 0;
  shape.clear();
  pieces.clear();
}

void WireForward::Clear() {
  step_id = 0;
  layer = 0;
  for (WireTensor* tensor : {&q, &k, &v, &q_pe, &ckv, &kpe}) tensor->Clear();
}

WireKind ParseStreamRequest(std::span<const grpc::Slice> slices, uint64_t& tag,
                            WireForward& forward) {
  forward.Clear();
  tag = 0;
  SliceReader reader(slices, TotalBytes(slices));
  bool seen_forward = false;
  while (!reader.done()) {
    uint32_t field, wire_type;
    if (!reader.ReadTag(field, wire_type)) return WireKind::kOther;
    uint64_t value;
    int64_t length;
    if (field == 1) {
      if (wire_type != kVarint || !reader.ReadVarint(value)) return WireKind::kOther;
      tag = value;
    } else if (field == 3) {
      if (wire_type != kLength || seen_forward) return WireKind::kOther;
      seen_forward = true;
      SliceReader sub(std::span<const grpc::Slice>(), 0);
      if (!reader.ReadLength(length) || !reader.Sub(length, sub)) return WireKind::kOther;
      if (!ParseForward(sub, forward)) return WireKind::kOther;
    } else if (field == 2 || field == 4) {
      return WireKind::kOther;  // plan or end_step (or a oneof that changes its mind)
    } else if (!reader.SkipField(wire_type)) {
      return WireKind::kOther;
    }
  }
  return seen_forward ? WireKind::kForward : WireKind::kOther;
}

bool ParseForwardRequest(std::span<const grpc::Slice> slices, WireForward& forward) {
  forward.Clear();
  SliceReader reader(slices, TotalBytes(slices));
  return ParseForward(reader, forward);
}

void WriteForwardResponse(const WireResponse& response, OutputLease& lease,
                          grpc::ByteBuffer& out) {
  WriteResponse(/*stream=*/false, 0, response, lease, out);
}

void WriteStreamForwardResponse(uint64_t tag, const WireResponse& response, OutputLease& lease,
                                grpc::ByteBuffer& out) {
  WriteResponse(/*stream=*/true, tag, response, lease, out);
}

}  // namespace attnd
