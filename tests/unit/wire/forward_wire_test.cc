// The hot path's codec against protobuf's own parser and serializer, both directions: what the
// decoder reads (however the bytes are split into slices) is exactly what protobuf reads, and
// everything else it hands to protobuf (kOther); what the encoders write is byte for byte what
// protobuf writes for the same message.
#include "attnd/wire/forward_wire.h"

#include <memory>
#include <optional>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include <gtest/gtest.h>

#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/io/zero_copy_stream_impl_lite.h"
#include "google/protobuf/util/message_differencer.h"

namespace attnd::wire {
namespace {

using google::protobuf::util::MessageDifferencer;

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

v1::ForwardResponse SampleResponse() {
  v1::ForwardResponse response;
  *response.mutable_o() = MakeTensor({4, 8, 16}, 4 * 8 * 16 * 2, 'o');
  *response.mutable_lse() = MakeTensor({4, 8}, 4 * 8 * 4, 'l');
  response.mutable_lse()->set_dtype(v1::DTYPE_FLOAT32);
  response.set_step_committed(true);
  return response;
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

std::string Flatten(const grpc::ByteBuffer& buffer) {
  std::vector<grpc::Slice> slices;
  EXPECT_TRUE(buffer.Dump(&slices).ok());
  std::string bytes;
  for (const grpc::Slice& slice : slices) {
    bytes.append(reinterpret_cast<const char*>(slice.begin()), slice.size());
  }
  return bytes;
}

// The codec's form back as a protobuf message: what the decoder understood.
void ToProto(const Tensor& tensor, v1::Tensor* out) {
  out->set_dtype(static_cast<v1::DType>(tensor.dtype));
  for (int64_t dim : tensor.shape) out->add_shape(dim);
  out->set_data(Joined(tensor.pieces));
}

v1::ForwardRequest ToProto(const ForwardRequest& request) {
  v1::ForwardRequest out;
  out.set_step_id(request.step_id);
  out.set_layer(request.layer);
  if (request.q.present) ToProto(request.q, out.mutable_q());
  if (request.k.present) ToProto(request.k, out.mutable_k());
  if (request.v.present) ToProto(request.v, out.mutable_v());
  if (request.q_pe.present) ToProto(request.q_pe, out.mutable_q_pe());
  if (request.ckv.present) ToProto(request.ckv, out.mutable_ckv());
  if (request.kpe.present) ToProto(request.kpe, out.mutable_kpe());
  return out;
}

v1::ForwardResponse ToProto(const ForwardResponse& response) {
  v1::ForwardResponse out;
  if (response.o.present) ToProto(response.o, out.mutable_o());
  if (response.lse.present) ToProto(response.lse, out.mutable_lse());
  out.set_step_committed(response.step_committed);
  return out;
}

// Decodes `bytes` (sliced by `cut`) as a message of type M with the codec and with protobuf.
// Whenever the codec reads it, protobuf must read the same message. Returns the codec's answer.
template <typename M>
Decoded DecodeAndCompare(const std::string& bytes, size_t cut) {
  const std::vector<grpc::Slice> slices = Slices(bytes, cut);
  M parsed;
  const bool protobuf_ok = parsed.ParseFromString(bytes);
  Decoded decoded;
  if constexpr (std::is_same_v<M, v1::ForwardRequest>) {
    ForwardRequest view;
    decoded = DecodeForwardRequest(slices, view);
    if (decoded == Decoded::kForward) {
      EXPECT_TRUE(protobuf_ok);
      EXPECT_TRUE(MessageDifferencer::Equals(ToProto(view), parsed))
          << ToProto(view).ShortDebugString() << "\nvs " << parsed.ShortDebugString();
    }
  } else if constexpr (std::is_same_v<M, v1::ForwardResponse>) {
    ForwardResponse view;
    decoded = DecodeForwardResponse(slices, view);
    if (decoded == Decoded::kForward) {
      EXPECT_TRUE(protobuf_ok);
      EXPECT_TRUE(MessageDifferencer::Equals(ToProto(view), parsed));
    }
  } else if constexpr (std::is_same_v<M, v1::StreamRequest>) {
    ForwardRequest view;
    uint64_t tag = 0;
    decoded = DecodeStreamRequest(slices, tag, view);
    if (decoded == Decoded::kForward) {
      EXPECT_TRUE(protobuf_ok);
      EXPECT_EQ(tag, parsed.tag());
      EXPECT_TRUE(parsed.has_forward());
      EXPECT_TRUE(MessageDifferencer::Equals(ToProto(view), parsed.forward()));
    }
  } else {
    ForwardResponse view;
    uint64_t tag = 0;
    decoded = DecodeStreamResponse(slices, tag, view);
    if (decoded == Decoded::kForward) {
      EXPECT_TRUE(protobuf_ok);
      EXPECT_EQ(tag, parsed.tag());
      EXPECT_TRUE(parsed.has_forward());
      EXPECT_TRUE(MessageDifferencer::Equals(ToProto(view), parsed.forward()));
    }
  }
  return decoded;
}

// ---- reading ---------------------------------------------------------------------------------

TEST(ForwardWireTest, ReadsWhatProtobufWritesAcrossAnySlicing) {
  v1::StreamRequest request;
  request.set_tag(77);
  *request.mutable_forward() = SampleRequest();
  v1::StreamResponse response;
  response.set_tag(1ull << 40);
  *response.mutable_forward() = SampleResponse();
  for (size_t cut : {size_t{1}, size_t{3}, size_t{7}, size_t{64}, size_t{1000}, size_t{1} << 20}) {
    SCOPED_TRACE(cut);
    EXPECT_EQ(DecodeAndCompare<v1::StreamRequest>(request.SerializeAsString(), cut),
              Decoded::kForward);
    EXPECT_EQ(DecodeAndCompare<v1::ForwardRequest>(request.forward().SerializeAsString(), cut),
              Decoded::kForward);
    EXPECT_EQ(DecodeAndCompare<v1::StreamResponse>(response.SerializeAsString(), cut),
              Decoded::kForward);
    EXPECT_EQ(DecodeAndCompare<v1::ForwardResponse>(response.forward().SerializeAsString(), cut),
              Decoded::kForward);
  }
}

// Each form a tensor takes on the wire reads into the one form (pieces), as protobuf reads it:
// with data, present but empty, absent; MHA and MLA sets; a negative layer.
TEST(ForwardWireTest, ReadsEveryTensorForm) {
  v1::ForwardRequest mla;
  mla.set_step_id(1);
  mla.set_layer(-5);
  *mla.mutable_q() = MakeTensor({2, 4, 8}, 128, 'q');
  *mla.mutable_q_pe() = MakeTensor({2, 4, 4}, 64, 'p');
  *mla.mutable_ckv() = MakeTensor({2, 8}, 32, 'c');
  *mla.mutable_kpe() = MakeTensor({2, 4}, 16, 'e');
  v1::ForwardRequest empty_tensors;
  empty_tensors.mutable_q();                               // present, nothing set
  empty_tensors.mutable_k()->add_shape(0);                 // a shape, no data
  empty_tensors.mutable_v()->set_dtype(v1::DTYPE_FLOAT16);  // a dtype only
  v1::ForwardRequest none;
  none.set_step_id(9);
  v1::ForwardResponse no_lse = SampleResponse();
  no_lse.clear_lse();
  no_lse.set_step_committed(false);
  v1::ForwardResponse empty_o;
  empty_o.mutable_o();
  for (size_t cut : {size_t{1}, size_t{5}, size_t{4096}}) {
    SCOPED_TRACE(cut);
    for (const v1::ForwardRequest& request : {mla, empty_tensors, none}) {
      EXPECT_EQ(DecodeAndCompare<v1::ForwardRequest>(request.SerializeAsString(), cut),
                Decoded::kForward);
    }
    for (const v1::ForwardResponse& response : {no_lse, empty_o, v1::ForwardResponse()}) {
      EXPECT_EQ(DecodeAndCompare<v1::ForwardResponse>(response.SerializeAsString(), cut),
                Decoded::kForward);
    }
  }
  // Presence is kept apart from emptiness, and the bytes are pieces of the slices (no copy).
  const std::string bytes = mla.SerializeAsString();
  const std::vector<grpc::Slice> slices = Slices(bytes, 16);
  ForwardRequest view;
  ASSERT_EQ(DecodeForwardRequest(slices, view), Decoded::kForward);
  EXPECT_FALSE(view.k.present);
  EXPECT_TRUE(view.q_pe.present);
  EXPECT_GT(view.q.pieces.size(), 1u);
  for (std::string_view piece : view.q.pieces) {
    bool inside = false;
    for (const grpc::Slice& slice : slices) {
      const char* begin = reinterpret_cast<const char*>(slice.begin());
      inside |= piece.data() >= begin && piece.data() + piece.size() <= begin + slice.size();
    }
    EXPECT_TRUE(inside);
  }
  std::vector<uint8_t> copied(view.q.size_bytes());
  view.q.CopyTo(copied.data());
  EXPECT_EQ(std::string(copied.begin(), copied.end()), mla.q().data());
}

// Hand-written encodings protobuf reads the same way: unpacked shape, fields out of order,
// scalars and data repeated (the last wins), an empty tensor present.
TEST(ForwardWireTest, ReadsUnusualButUnambiguousEncodings) {
  std::string bytes;
  {
    google::protobuf::io::StringOutputStream stream(&bytes);
    google::protobuf::io::CodedOutputStream out(&stream);
    std::string tensor;
    {
      google::protobuf::io::StringOutputStream tensor_stream(&tensor);
      google::protobuf::io::CodedOutputStream t(&tensor_stream);
      t.WriteTag((3 << 3) | 2);  // data first, then again: the last wins
      t.WriteVarint32(2);
      t.WriteRaw("ab", 2);
      t.WriteTag((2 << 3) | 0);  // shape unpacked, then packed: both append
      t.WriteVarint64(2);
      t.WriteTag((2 << 3) | 2);
      t.WriteVarint32(1);
      t.WriteVarint64(1);
      t.WriteTag((3 << 3) | 2);
      t.WriteVarint32(4);
      t.WriteRaw("wxyz", 4);
      t.WriteTag((1 << 3) | 0);  // dtype last
      t.WriteVarint32(1);
    }
    out.WriteTag((2 << 3) | 0);  // layer before step_id, twice
    out.WriteVarint32(3);
    out.WriteTag((2 << 3) | 0);
    out.WriteVarint32(4);
    out.WriteTag((3 << 3) | 2);  // q
    out.WriteVarint32(static_cast<uint32_t>(tensor.size()));
    out.WriteRaw(tensor.data(), static_cast<int>(tensor.size()));
    out.WriteTag((5 << 3) | 2);  // v: present, empty
    out.WriteVarint32(0);
    out.WriteTag((1 << 3) | 0);
    out.WriteVarint64(9);
  }
  for (size_t cut : {size_t{1}, size_t{2}, bytes.size()}) {
    EXPECT_EQ(DecodeAndCompare<v1::ForwardRequest>(bytes, cut), Decoded::kForward);
  }
}

// Everything the codec does not carry goes to protobuf: never dropped, never misread.
TEST(ForwardWireTest, HandsEverythingElseToProtobuf) {
  const auto other_request = [](const std::string& bytes) {
    return DecodeAndCompare<v1::ForwardRequest>(bytes, 16) == Decoded::kOther;
  };
  const auto other_stream_request = [](const std::string& bytes) {
    return DecodeAndCompare<v1::StreamRequest>(bytes, 16) == Decoded::kOther;
  };
  const auto other_response = [](const std::string& bytes) {
    return DecodeAndCompare<v1::ForwardResponse>(bytes, 16) == Decoded::kOther;
  };
  const auto other_stream_response = [](const std::string& bytes) {
    return DecodeAndCompare<v1::StreamResponse>(bytes, 16) == Decoded::kOther;
  };
  const std::string request = SampleRequest().SerializeAsString();
  const std::string response = SampleResponse().SerializeAsString();
  const std::string unknown_field("\xa2\x01\x02??", 5);  // field 20, 2 bytes
  ASSERT_TRUE(v1::ForwardRequest().ParseFromString(request + unknown_field));

  // Unknown fields, at every level.
  EXPECT_TRUE(other_request(request + unknown_field));
  EXPECT_TRUE(other_response(response + unknown_field));
  {
    v1::StreamRequest stream_request;
    stream_request.set_tag(5);
    *stream_request.mutable_forward() = SampleRequest();
    EXPECT_TRUE(other_stream_request(stream_request.SerializeAsString() + unknown_field));
    v1::StreamResponse stream_response;
    stream_response.set_tag(5);
    *stream_response.mutable_forward() = SampleResponse();
    EXPECT_TRUE(other_stream_response(stream_response.SerializeAsString() + unknown_field));
  }
  {
    v1::ForwardRequest inner = SampleRequest();
    std::string q = inner.q().SerializeAsString() + unknown_field;
    inner.clear_q();
    std::string bytes = inner.SerializeAsString();
    bytes += '\x1a';  // q
    bytes += static_cast<char>((q.size() & 0x7f) | 0x80);
    bytes += static_cast<char>(q.size() >> 7);
    bytes += q;
    ASSERT_TRUE(v1::ForwardRequest().ParseFromString(bytes));
    EXPECT_TRUE(other_request(bytes));
  }
  // use_channel: a field the codec knows and leaves to protobuf (its reply has no tensors).
  v1::ForwardRequest channel;
  channel.set_step_id(3);
  channel.set_use_channel(true);
  EXPECT_TRUE(other_request(channel.SerializeAsString()));
  // `values`: converted by the server from protobuf's parse.
  v1::ForwardRequest values = SampleRequest();
  values.mutable_q()->clear_data();
  values.mutable_q()->add_values(1.0f);
  EXPECT_TRUE(other_request(values.SerializeAsString()));
  // A tensor field twice: protobuf merges the two messages.
  v1::ForwardRequest second;
  *second.mutable_q() = SampleRequest().q();
  EXPECT_TRUE(other_request(request + second.SerializeAsString()));
  v1::ForwardResponse second_o;
  second_o.mutable_o()->set_data("x");
  EXPECT_TRUE(other_response(response + second_o.SerializeAsString()));
  // A known field with another wire type; a group.
  EXPECT_TRUE(other_request(request + std::string("\x0a\x01\x01", 3)));  // step_id as bytes
  EXPECT_TRUE(other_request(request + std::string("\x0b\x0c", 2)));  // step_id as a group
  // Other payloads of a stream.
  v1::StreamRequest plan;
  plan.set_tag(1);
  plan.mutable_plan()->set_cache("c");
  EXPECT_TRUE(other_stream_request(plan.SerializeAsString()));
  v1::StreamRequest end;
  end.mutable_end_step()->set_step_id(3);
  EXPECT_TRUE(other_stream_request(end.SerializeAsString()));
  EXPECT_TRUE(other_stream_request(""));
  v1::StreamResponse error;
  error.set_tag(4);
  error.mutable_error()->set_code(3);
  EXPECT_TRUE(other_stream_response(error.SerializeAsString()));
  v1::StreamResponse end_response;
  end_response.mutable_end_step()->set_layers_run(2);
  EXPECT_TRUE(other_stream_response(end_response.SerializeAsString()));
}

// A message cut anywhere: the codec reads it only where protobuf reads the same (a cut at a
// field boundary is itself a valid message), and declines the rest.
TEST(ForwardWireTest, TruncatedMessagesAreDeclined) {
  v1::StreamRequest stream_request;
  stream_request.set_tag(300);
  *stream_request.mutable_forward() = SampleRequest();
  v1::StreamResponse stream_response;
  stream_response.set_tag(300);
  *stream_response.mutable_forward() = SampleResponse();
  const std::string request = SampleRequest().SerializeAsString();
  const std::string response = SampleResponse().SerializeAsString();
  int declined = 0;
  for (size_t length = 0; length < request.size(); ++length) {
    const std::string cut = request.substr(0, length);
    declined += DecodeAndCompare<v1::ForwardRequest>(cut, 7) == Decoded::kOther;
    declined += DecodeAndCompare<v1::StreamRequest>(
                    stream_request.SerializeAsString().substr(0, length), 7) == Decoded::kOther;
  }
  for (size_t length = 0; length < response.size(); ++length) {
    declined += DecodeAndCompare<v1::ForwardResponse>(response.substr(0, length), 7) ==
                Decoded::kOther;
    declined += DecodeAndCompare<v1::StreamResponse>(
                    stream_response.SerializeAsString().substr(0, length), 7) == Decoded::kOther;
  }
  EXPECT_GT(declined, 0);
  // A length beyond the end.
  EXPECT_EQ(DecodeAndCompare<v1::ForwardRequest>(request.substr(0, request.size() - 3), 16),
            Decoded::kOther);
}

// Random damage to valid messages: whatever the codec still reads, protobuf reads the same.
TEST(ForwardWireTest, DamagedMessagesNeverReadDifferentlyFromProtobuf) {
  v1::ForwardRequest small;
  small.set_step_id(5);
  small.set_layer(1);
  *small.mutable_q() = MakeTensor({2, 3}, 12, 'q');
  *small.mutable_kpe() = MakeTensor({1}, 3, 'e');
  v1::StreamRequest stream_request;
  stream_request.set_tag(6);
  *stream_request.mutable_forward() = small;
  v1::ForwardResponse response;
  *response.mutable_o() = MakeTensor({2}, 4, 'o');
  *response.mutable_lse() = MakeTensor({1}, 4, 'l');
  response.set_step_committed(true);
  v1::StreamResponse stream_response;
  stream_response.set_tag(7);
  *stream_response.mutable_forward() = response;
  std::mt19937 rng(16);
  int read = 0;
  for (int round = 0; round < 4000; ++round) {
    const int which = round % 4;
    std::string bytes = which == 0   ? small.SerializeAsString()
                        : which == 1 ? stream_request.SerializeAsString()
                        : which == 2 ? response.SerializeAsString()
                                     : stream_response.SerializeAsString();
    for (int damage = 1 + rng() % 3; damage > 0; --damage) {
      const size_t at = rng() % bytes.size();
      switch (rng() % 3) {
        case 0:
          bytes[at] = static_cast<char>(rng());
          break;
        case 1:
          bytes.erase(at, 1);
          break;
        default:
          bytes.insert(at, 1, static_cast<char>(rng()));
      }
      if (bytes.empty()) bytes = "\x08";
    }
    const size_t cut = 1 + rng() % 9;
    Decoded decoded = which == 0   ? DecodeAndCompare<v1::ForwardRequest>(bytes, cut)
                      : which == 1 ? DecodeAndCompare<v1::StreamRequest>(bytes, cut)
                      : which == 2 ? DecodeAndCompare<v1::ForwardResponse>(bytes, cut)
                                   : DecodeAndCompare<v1::StreamResponse>(bytes, cut);
    read += decoded == Decoded::kForward;
    if (HasFailure()) {
      ADD_FAILURE() << "round " << round;
      return;
    }
  }
  EXPECT_GT(read, 0);  // the damage left some messages readable: the comparison ran
}

// ViewOf (the slow path) gives the same form as the decoder.
TEST(ForwardWireTest, ProtobufsParseViewsAsTheDecoderReads) {
  const v1::ForwardRequest request = SampleRequest();
  const std::vector<grpc::Slice> slices = Slices(request.SerializeAsString(), 100);
  ForwardRequest decoded, viewed;
  ASSERT_EQ(DecodeForwardRequest(slices, decoded), Decoded::kForward);
  ViewOf(request, viewed);
  EXPECT_TRUE(MessageDifferencer::Equals(ToProto(decoded), ToProto(viewed)));
  EXPECT_EQ(viewed.q.pieces.size(), 1u);
  EXPECT_EQ(viewed.q.pieces[0].data(), request.q().data().data());  // referenced, not copied
  EXPECT_FALSE(viewed.q_pe.present);
  const v1::ForwardResponse response = SampleResponse();
  ForwardResponse response_view;
  ViewOf(response, response_view);
  EXPECT_TRUE(MessageDifferencer::Equals(ToProto(response_view), response));
}

// Every field of the messages the codec reads is either carried or handed to protobuf: a field
// added to attnd.proto without the codec learning it cannot be dropped by the fast path.
TEST(ForwardWireTest, NoFieldOfTheMessagesIsDropped) {
  const auto check_fields = [](google::protobuf::Message& base, auto decode_as) {
    const google::protobuf::Descriptor* descriptor = base.GetDescriptor();
    const google::protobuf::Reflection* reflection = base.GetReflection();
    for (int i = 0; i < descriptor->field_count(); ++i) {
      const google::protobuf::FieldDescriptor* field = descriptor->field(i);
      SCOPED_TRACE(field->full_name());
      std::unique_ptr<google::protobuf::Message> message(base.New());
      message->CopyFrom(base);
      using Type = google::protobuf::FieldDescriptor;
      switch (field->cpp_type()) {
        case Type::CPPTYPE_UINT64:
          reflection->SetUInt64(message.get(), field, 1234567);
          break;
        case Type::CPPTYPE_INT32:
          reflection->SetInt32(message.get(), field, -3);
          break;
        case Type::CPPTYPE_BOOL:
          reflection->SetBool(message.get(), field, true);
          break;
        case Type::CPPTYPE_MESSAGE:
          reflection->MutableMessage(message.get(), field);  // present, empty
          break;
        default:
          FAIL() << "a field type this test does not set: teach it, and the codec";
      }
      decode_as(message->SerializeAsString());  // compares whenever the codec reads it
    }
  };
  v1::ForwardRequest request;
  check_fields(request, [](const std::string& bytes) {
    DecodeAndCompare<v1::ForwardRequest>(bytes, 3);
  });
  v1::ForwardResponse response;
  check_fields(response, [](const std::string& bytes) {
    DecodeAndCompare<v1::ForwardResponse>(bytes, 3);
  });
  v1::StreamRequest stream_request;
  check_fields(stream_request, [](const std::string& bytes) {
    DecodeAndCompare<v1::StreamRequest>(bytes, 3);
  });
  v1::StreamResponse stream_response;
  check_fields(stream_response, [](const std::string& bytes) {
    DecodeAndCompare<v1::StreamResponse>(bytes, 3);
  });
  // Tensor's own fields, inside q.
  const google::protobuf::Descriptor* tensor = v1::Tensor::descriptor();
  for (int i = 0; i < tensor->field_count(); ++i) {
    const google::protobuf::FieldDescriptor* field = tensor->field(i);
    SCOPED_TRACE(field->full_name());
    v1::ForwardRequest message;
    v1::Tensor* q = message.mutable_q();
    const google::protobuf::Reflection* reflection = q->GetReflection();
    if (field->is_repeated() && field->cpp_type() == field->CPPTYPE_INT64) {
      reflection->AddInt64(q, field, 7);
    } else if (field->is_repeated() && field->cpp_type() == field->CPPTYPE_FLOAT) {
      reflection->AddFloat(q, field, 0.5f);
    } else if (field->cpp_type() == field->CPPTYPE_ENUM) {
      reflection->SetEnumValue(q, field, 2);
    } else if (field->cpp_type() == field->CPPTYPE_STRING) {
      reflection->SetString(q, field, "xy");
    } else {
      FAIL() << "a Tensor field type this test does not set: teach it, and the codec";
    }
    DecodeAndCompare<v1::ForwardRequest>(message.SerializeAsString(), 3);
  }
}

// ---- writing ---------------------------------------------------------------------------------

TensorBytes BytesOf(const v1::Tensor& tensor) {
  return TensorBytes{
      tensor.dtype(),
      {tensor.shape().data(), static_cast<size_t>(tensor.shape_size())},
      {reinterpret_cast<const uint8_t*>(tensor.data().data()), tensor.data().size()}};
}

// The request writer writes what protobuf writes, for each tensor form, unary and streamed; the
// tensors' bytes are the caller's memory, referenced.
TEST(ForwardWireTest, WrittenRequestsAreWhatProtobufWrites) {
  v1::ForwardRequest mha = SampleRequest();
  v1::ForwardRequest mla;
  mla.set_step_id(2);
  mla.set_layer(-1);
  *mla.mutable_q() = MakeTensor({2, 4, 8}, 128, 'q');
  *mla.mutable_q_pe() = MakeTensor({2, 4, 4}, 64, 'p');
  *mla.mutable_ckv() = MakeTensor({2, 8}, 32, 'c');
  *mla.mutable_kpe() = MakeTensor({2, 4}, 16, 'e');
  v1::ForwardRequest empty;
  empty.mutable_q();
  empty.mutable_k()->add_shape(0);
  empty.mutable_v()->set_dtype(v1::DTYPE_FLOAT16);
  for (const v1::ForwardRequest& message : {mha, mla, empty, v1::ForwardRequest()}) {
    SCOPED_TRACE(message.ShortDebugString().substr(0, 80));
    ForwardRequestBytes request;
    request.step_id = message.step_id();
    request.layer = message.layer();
    if (message.has_q()) request.q = BytesOf(message.q());
    if (message.has_k()) request.k = BytesOf(message.k());
    if (message.has_v()) request.v = BytesOf(message.v());
    if (message.has_q_pe()) request.q_pe = BytesOf(message.q_pe());
    if (message.has_ckv()) request.ckv = BytesOf(message.ckv());
    if (message.has_kpe()) request.kpe = BytesOf(message.kpe());
    const grpc::ByteBuffer unary = EncodeForwardRequest(request);
    EXPECT_EQ(Flatten(unary), message.SerializeAsString());
    for (uint64_t tag : {uint64_t{0}, uint64_t{1} << 33}) {
      v1::StreamRequest stream;
      stream.set_tag(tag);
      *stream.mutable_forward() = message;
      EXPECT_EQ(Flatten(EncodeForwardRequest(request, tag)), stream.SerializeAsString());
    }
    if (message.has_q() && !message.q().data().empty()) {
      std::vector<grpc::Slice> slices;
      ASSERT_TRUE(unary.Dump(&slices).ok());
      bool referenced = false;
      for (const grpc::Slice& slice : slices) {
        referenced |= reinterpret_cast<const char*>(slice.begin()) == message.q().data().data();
      }
      EXPECT_TRUE(referenced) << "q's bytes were copied";
    }
  }
}

struct Released {
  int count = 0;
  static void Release(void* arg) { ++static_cast<Released*>(arg)->count; }
};

// The response writer writes what protobuf writes; o's bytes go back to their owner once gRPC
// lets go of them, exactly once.
TEST(ForwardWireTest, WrittenResponsesAreWhatProtobufWrites) {
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
      ForwardResponseBytes response;
      response.o = {v1::DTYPE_BFLOAT16, o_shape, o};
      if (with_lse) {
        response.lse = TensorBytes{v1::DTYPE_FLOAT32, lse_shape,
                                   {reinterpret_cast<const uint8_t*>(lse.data()),
                                    lse.size() * sizeof(float)}};
      }
      response.step_committed = with_lse;
      grpc::ByteBuffer buffer;
      EncodeForwardResponse(response, Lent{&Released::Release, &released}, buffer,
                            stream ? std::optional<uint64_t>(1u << 20) : std::nullopt);
      EXPECT_EQ(released.count, 0);  // a slice still references o
      const std::string bytes = Flatten(buffer);
      buffer.Clear();
      EXPECT_EQ(released.count, 1);  // gRPC let go: o went back, once

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
      if (stream) {
        v1::StreamResponse message;
        message.set_tag(1u << 20);
        *message.mutable_forward() = expected;
        EXPECT_EQ(bytes, message.SerializeAsString());
      } else {
        EXPECT_EQ(bytes, expected.SerializeAsString());
      }
    }
  }
}

TEST(ForwardWireTest, AnEmptyOGoesBackAtOnceAndUnownedBytesAreCopied) {
  Released released;
  ForwardResponseBytes response;
  grpc::ByteBuffer buffer;
  EncodeForwardResponse(response, Lent{&Released::Release, &released}, buffer);
  EXPECT_EQ(released.count, 1);
  v1::ForwardResponse empty_o;
  empty_o.mutable_o();
  EXPECT_EQ(Flatten(buffer), empty_o.SerializeAsString());

  std::vector<uint8_t> o = {1, 2, 3, 4};
  response.o.bytes = o;
  EncodeForwardResponse(response, Lent{}, buffer);
  o.assign(4, 0);  // the caller's memory is free again: the message holds a copy
  v1::ForwardResponse parsed;
  ASSERT_TRUE(parsed.ParseFromString(Flatten(buffer)));
  EXPECT_EQ(parsed.o().data(), std::string("\x01\x02\x03\x04", 4));
}

}  // namespace
}  // namespace attnd::wire
