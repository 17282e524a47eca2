// The hot path's wire format: the fast parser reads what protobuf writes (however the bytes are
// split into slices) and declines what it does not expect; the written replies parse back with
// protobuf into the same message.
#include "service/forward_wire.h"

#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "attnd/v1/attnd.pb.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/io/zero_copy_stream_impl_lite.h"
#include "service/convert.h"

namespace attnd {
namespace {

v1::Tensor MakeTensor(std::vector<int64_t> shape, size_t bytes, char fill) {
  v1::Tensor tensor;
  tensor.set_dtype(v1::DTYPE_BFLOAT16);
  for (int64_t dim : shape) tensor.add_shape(dim);
  std::string data(bytes, fill);
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<char>(fill + i % 7);
  tensor.set_data(data);
  return tensor;
}

v1::ForwardRequest SampleRequest() {
  v1::ForwardRequest request;
  request.set_step_id(123456789012ull);
  request.set_layer(31);
  *request.mutable_q() = MakeTensor({4, 8, 16}, 4 * 8 * 16 * 2, 'a');
  *request.mutable_k() = MakeTensor({4, 2, 16}, 4 * 2 * 16 * 2, 'k');
  *request.mutable_v() = MakeTensor({4, 2, 16}, 4 * 2 * 16 * 2, 'v');
  return request;
}

// `bytes` cut into slices of `cut` bytes (the last shorter).
std::vector<grpc::Slice> Slices(const std::string& bytes, size_t cut) {
  std::vector<grpc::Slice> slices;
  for (size_t at = 0; at < bytes.size(); at += cut) {
    slices.emplace_back(bytes.data() + at, std::min(cut, bytes.size() - at));
  }
  return slices;
}

std::string Joined(const std::vector<std::string_view>& pieces) {
  std::string joined;
  for (std::string_view piece : pieces) joined.append(piece);
  return joined;
}

void ExpectSameTensor(const WireTensor& wire, const v1::Tensor& tensor, bool present) {
  ASSERT_EQ(wire.present, present);
  if (!present) return;
  EXPECT_EQ(wire.dtype, tensor.dtype());
  EXPECT_EQ(wire.shape, std::vector<int64_t>(tensor.shape().begin(), tensor.shape().end()));
  EXPECT_EQ(Joined(wire.pieces), tensor.data());
}

void ExpectSameForward(const WireForward& wire, const v1::ForwardRequest& request) {
  EXPECT_EQ(wire.step_id, request.step_id());
  EXPECT_EQ(wire.layer, request.layer());
  ExpectSameTensor(wire.q, request.q(), request.has_q());
  ExpectSameTensor(wire.k, request.k(), request.has_k());
  ExpectSameTensor(wire.v, request.v(), request.has_v());
  ExpectSameTensor(wire.q_pe, request.q_pe(), request.has_q_pe());
  ExpectSameTensor(wire.ckv, request.ckv(), request.has_ckv());
  ExpectSameTensor(wire.kpe, request.kpe(), request.has_kpe());
}

TEST(ForwardWireTest, ReadsWhatProtobufWritesAcrossAnySlicing) {
  v1::StreamRequest message;
  message.set_tag(77);
  *message.mutable_forward() = SampleRequest();
  const std::string bytes = message.SerializeAsString();
  for (size_t cut : {size_t{1}, size_t{3}, size_t{7}, size_t{64}, size_t{1000}, bytes.size()}) {
    SCOPED_TRACE(cut);
    const std::vector<grpc::Slice> slices = Slices(bytes, cut);
    uint64_t tag = 0;
    WireForward forward;
    ASSERT_EQ(ParseStreamRequest(slices, tag, forward), WireKind::kForward);
    EXPECT_EQ(tag, 77u);
    ExpectSameForward(forward, message.forward());
  }
}

TEST(ForwardWireTest, ReadsAUnaryRequestWithNegativeLayerAndMlaTensors) {
  v1::ForwardRequest request;
  request.set_step_id(1);
  request.set_layer(-5);
  *request.mutable_q() = MakeTensor({2, 4, 8}, 128, 'q');
  *request.mutable_q_pe() = MakeTensor({2, 4, 4}, 64, 'p');
  *request.mutable_ckv() = MakeTensor({2, 8}, 32, 'c');
  *request.mutable_kpe() = MakeTensor({2, 4}, 16, 'e');
  const std::vector<grpc::Slice> slices = Slices(request.SerializeAsString(), 5);
  WireForward forward;
  ASSERT_TRUE(ParseForwardRequest(slices, forward));
  ExpectSameForward(forward, request);
}

// Hand-written encodings protobuf accepts: unknown fields inside a tensor, unpacked shape,
// fields out of order, an empty tensor present.
TEST(ForwardWireTest, ReadsUnusualButUnambiguousEncodings) {
  std::string bytes;
  google::protobuf::io::StringOutputStream stream(&bytes);
  {
    google::protobuf::io::CodedOutputStream out(&stream);
    std::string tensor;
    {
      google::protobuf::io::StringOutputStream tensor_stream(&tensor);
      google::protobuf::io::CodedOutputStream t(&tensor_stream);
      t.WriteTag((3 << 3) | 2);  // data first
      t.WriteVarint32(4);
      t.WriteRaw("wxyz", 4);
      t.WriteTag((2 << 3) | 0);  // shape unpacked
      t.WriteVarint64(2);
      t.WriteTag((2 << 3) | 0);
      t.WriteVarint64(1);
      t.WriteTag((9 << 3) | 5);  // unknown fixed32
      t.WriteLittleEndian32(7);
      t.WriteTag((1 << 3) | 0);  // dtype last
      t.WriteVarint32(1);
    }
    out.WriteTag((2 << 3) | 0);  // layer before step_id
    out.WriteVarint32(3);
    out.WriteTag((3 << 3) | 2);  // q
    out.WriteVarint32(static_cast<uint32_t>(tensor.size()));
    out.WriteRaw(tensor.data(), static_cast<int>(tensor.size()));
    out.WriteTag((5 << 3) | 2);  // v: present, empty
    out.WriteVarint32(0);
    out.WriteTag((1 << 3) | 0);
    out.WriteVarint64(9);
  }
  v1::ForwardRequest request;
  ASSERT_TRUE(request.ParseFromString(bytes));
  // The parsed tensors are views into the slices: keep them alive.
  const std::vector<grpc::Slice> slices = Slices(bytes, 2);
  WireForward forward;
  ASSERT_TRUE(ParseForwardRequest(slices, forward));
  ExpectSameForward(forward, request);
}

TEST(ForwardWireTest, DeclinesWhatProtobufShouldRead) {
  WireForward forward;
  uint64_t tag;
  {
    // A ForwardRequest field the fast parser does not know is never dropped: protobuf reads it.
    v1::ForwardRequest channel;
    channel.set_step_id(3);
    channel.set_use_channel(true);
    EXPECT_FALSE(ParseForwardRequest(Slices(channel.SerializeAsString(), 16), forward));
    v1::StreamRequest streamed;
    *streamed.mutable_forward() = channel;
    EXPECT_EQ(ParseStreamRequest(Slices(streamed.SerializeAsString(), 16), tag, forward),
              WireKind::kOther);
    std::string unknown = channel.SerializeAsString();
    v1::ForwardRequest plain;
    plain.set_step_id(3);
    unknown = plain.SerializeAsString() + std::string("\xa2\x01\x02??", 5);  // field 20, 2 bytes
    ASSERT_TRUE(v1::ForwardRequest().ParseFromString(unknown));
    EXPECT_FALSE(ParseForwardRequest(Slices(unknown, 16), forward));
  }
  {
    v1::StreamRequest plan;
    plan.set_tag(1);
    plan.mutable_plan()->set_cache("c");
    EXPECT_EQ(ParseStreamRequest(Slices(plan.SerializeAsString(), 16), tag, forward),
              WireKind::kOther);
  }
  {
    v1::StreamRequest end;
    end.mutable_end_step()->set_step_id(3);
    EXPECT_EQ(ParseStreamRequest(Slices(end.SerializeAsString(), 16), tag, forward),
              WireKind::kOther);
  }
  {
    v1::StreamRequest empty;
    EXPECT_EQ(ParseStreamRequest(Slices(empty.SerializeAsString() + "", 16), tag, forward),
              WireKind::kOther);
  }
  {
    v1::ForwardRequest values = SampleRequest();
    values.mutable_q()->clear_data();
    values.mutable_q()->add_values(1.0f);
    EXPECT_FALSE(ParseForwardRequest(Slices(values.SerializeAsString(), 16), forward));
  }
  {
    // q twice: protobuf merges the two messages.
    v1::ForwardRequest first = SampleRequest();
    v1::ForwardRequest second;
    *second.mutable_q() = first.q();
    EXPECT_FALSE(ParseForwardRequest(
        Slices(first.SerializeAsString() + second.SerializeAsString(), 16), forward));
  }
  {
    // Truncated: a length beyond the end.
    std::string bytes = SampleRequest().SerializeAsString();
    bytes.resize(bytes.size() - 3);
    EXPECT_FALSE(ParseForwardRequest(Slices(bytes, 16), forward));
  }
}

TEST(ForwardWireTest, ArgsFromTheWireMatchArgsFromProtobuf) {
  const v1::ForwardRequest request = SampleRequest();
  const std::vector<grpc::Slice> slices = Slices(request.SerializeAsString(), 100);
  WireForward wire;
  ASSERT_TRUE(ParseForwardRequest(slices, wire));
  ForwardArgs from_wire;
  ASSERT_TRUE(ForwardArgsFromWire(wire, from_wire).ok());
  ForwardArgs from_proto;
  std::vector<std::string> scratch;
  ASSERT_TRUE(ForwardArgsFromProto(request, from_proto, scratch).ok());
  EXPECT_EQ(from_wire.step_id, from_proto.step_id);
  EXPECT_EQ(from_wire.layer, from_proto.layer);
  for (auto [a, b] : {std::pair{&from_wire.q, &from_proto.q}, {&from_wire.k, &from_proto.k},
                      {&from_wire.v, &from_proto.v}}) {
    EXPECT_EQ(a->present, b->present);
    EXPECT_EQ(a->dtype, b->dtype);
    EXPECT_EQ(a->shape, b->shape);
    EXPECT_EQ(a->size_bytes(), b->size_bytes());
    EXPECT_EQ(Joined({a->pieces.begin(), a->pieces.end()}), std::string(b->data));
  }
  // The same errors, naming the field.
  wire.k.dtype = 99;
  const absl::Status status = ForwardArgsFromWire(wire, from_wire);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("k.dtype"), std::string_view::npos) << status;
  wire.k.dtype = v1::DTYPE_BFLOAT16;
  wire.v.shape = {-1};
  EXPECT_NE(ForwardArgsFromWire(wire, from_wire).message().find("v.shape[0]"),
            std::string_view::npos);
}

struct Released {
  int count = 0;
  static void Release(void* arg) { ++static_cast<Released*>(arg)->count; }
};

TEST(ForwardWireTest, WrittenRepliesParseBackWithProtobuf) {
  std::vector<uint8_t> o(4 * 8 * 16 * 2);
  std::mt19937 rng(3);
  for (uint8_t& byte : o) byte = static_cast<uint8_t>(rng());
  std::vector<float> lse(4 * 8);
  for (size_t i = 0; i < lse.size(); ++i) lse[i] = 0.5f * static_cast<float>(i) - 3.0f;
  const int64_t o_shape[] = {4, 8, 16};
  const int64_t lse_shape[] = {4, 8};
  for (bool with_lse : {false, true}) {
    for (bool stream : {false, true}) {
      SCOPED_TRACE(testing::Message() << "lse " << with_lse << " stream " << stream);
      Released released;
      OutputLease lease;
      lease.o = o.data();
      lease.lse = lse.data();
      lease.release = &Released::Release;
      lease.release_arg = &released;
      WireResponse response;
      response.o_dtype = DType::kBFloat16;
      response.o_shape = o_shape;
      response.o_bytes = static_cast<int64_t>(o.size());
      if (with_lse) {
        response.lse_shape = lse_shape;
        response.lse_bytes = static_cast<int64_t>(lse.size() * sizeof(float));
      }
      response.step_committed = with_lse;
      grpc::ByteBuffer buffer;
      if (stream) {
        WriteStreamForwardResponse(1u << 20, response, lease, buffer);
      } else {
        WriteForwardResponse(response, lease, buffer);
      }
      EXPECT_EQ(lease.release, nullptr);
      EXPECT_EQ(released.count, 0);  // the slice still references o
      std::vector<grpc::Slice> slices;
      ASSERT_TRUE(buffer.Dump(&slices).ok());
      std::string bytes;
      for (const grpc::Slice& slice : slices) {
        bytes.append(reinterpret_cast<const char*>(slice.begin()), slice.size());
      }
      slices.clear();
      buffer.Clear();
      EXPECT_EQ(released.count, 1);  // gRPC let go: the lease went back, once

      v1::ForwardResponse forward;
      if (stream) {
        v1::StreamResponse message;
        ASSERT_TRUE(message.ParseFromString(bytes));
        EXPECT_EQ(message.tag(), 1u << 20);
        ASSERT_TRUE(message.has_forward());
        forward = message.forward();
      } else {
        ASSERT_TRUE(forward.ParseFromString(bytes));
      }
      v1::ForwardResponse expected;
      v1::Tensor* expected_o = expected.mutable_o();
      expected_o->set_dtype(v1::DTYPE_BFLOAT16);
      for (int64_t dim : o_shape) expected_o->add_shape(dim);
      expected_o->set_data(std::string(o.begin(), o.end()));
      if (with_lse) {
        v1::Tensor* expected_lse = expected.mutable_lse();
        expected_lse->set_dtype(v1::DTYPE_FLOAT32);
        for (int64_t dim : lse_shape) expected_lse->add_shape(dim);
        expected_lse->set_data(std::string(reinterpret_cast<const char*>(lse.data()),
                                           lse.size() * sizeof(float)));
        expected.set_step_committed(true);
      }
      EXPECT_EQ(forward.SerializeAsString(), expected.SerializeAsString());
    }
  }
}

}  // namespace
}  // namespace attnd
