// Validation of requests that needs no server state: every error names its field.
#include "service/convert.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <ostream>
#include <string>
#include <vector>

namespace absl {
ABSL_NAMESPACE_BEGIN
inline void PrintTo(absl::string_view text, std::ostream* os) { *os << '"' << text << '"'; }
ABSL_NAMESPACE_END
}  // namespace absl

namespace attnd {
namespace {

using ::testing::HasSubstr;

v1::CreateCacheRequest ValidRequest() {
  v1::CreateCacheRequest request;
  request.set_name("llama-8b.0");
  v1::CacheConfig* config = request.mutable_config();
  config->set_num_layers(32);
  config->set_num_qo_heads(32);
  config->set_num_kv_heads(8);
  config->set_head_dim(128);
  config->set_num_pages(1000);
  return request;
}

TEST(CacheSpecFromProtoTest, ResolvesDefaults) {
  auto spec = CacheSpecFromProto(ValidRequest());
  ASSERT_TRUE(spec.ok()) << spec.status();
  const CacheGeometry& g = spec->geometry;
  EXPECT_EQ(g.page_size, 16);
  EXPECT_EQ(g.q_dtype, DType::kBFloat16);
  EXPECT_EQ(g.kv_dtype, DType::kBFloat16);
  EXPECT_EQ(g.layout, KvLayout::kNHD);
  EXPECT_EQ(g.k_scale, 1.0f);
  EXPECT_EQ(g.rope.style, RopeStyle::kNone);
  EXPECT_FALSE(spec->external_pages);
  EXPECT_EQ(g.num_pages, 1000);
}

TEST(CacheSpecFromProtoTest, DerivesPagesFromAByteBudget) {
  v1::CreateCacheRequest request = ValidRequest();
  // One page: 16 tokens x 8 heads x 128 dims x 2 bytes x (K + V) x 32 layers = 2 MiB.
  request.mutable_config()->set_memory_bytes((10ll << 20) + 5);
  auto spec = CacheSpecFromProto(request);
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->geometry.num_pages, 5);
}

TEST(CacheSpecFromProtoTest, ResolvesMlaShapes) {
  v1::CreateCacheRequest request = ValidRequest();
  request.mutable_config()->set_kind(v1::ATTENTION_KIND_MLA);
  request.mutable_config()->set_num_qo_heads(128);
  request.mutable_config()->mutable_rope()->set_style(v1::ROPE_STYLE_INTERLEAVED);
  auto spec = CacheSpecFromProto(request);
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_TRUE(spec->geometry.mla);
  EXPECT_EQ(spec->geometry.k_head_dim, 512);
  EXPECT_EQ(spec->geometry.v_head_dim, 64);
  EXPECT_EQ(spec->geometry.num_kv_heads, 1);
  EXPECT_EQ(spec->geometry.rope.rotary_dim, 64);
}

struct BadConfigCase {
  const char* name;
  void (*mutate)(v1::CreateCacheRequest&);
  const char* field;
};

// gtest prints a parameter in test listings and failures; without this, as raw bytes
// (padding included), which change from build to build.
void PrintTo(const BadConfigCase& c, std::ostream* os) { *os << c.name; }

class BadConfigTest : public ::testing::TestWithParam<BadConfigCase> {};

TEST_P(BadConfigTest, NamesTheField) {
  v1::CreateCacheRequest request = ValidRequest();
  GetParam().mutate(request);
  auto spec = CacheSpecFromProto(request);
  ASSERT_EQ(spec.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(spec.status().message(), HasSubstr(GetParam().field));
}

INSTANTIATE_TEST_SUITE_P(
    Fields, BadConfigTest,
    ::testing::Values(
        BadConfigCase{"EmptyName", [](auto& r) { r.set_name(""); }, "name: expected"},
        BadConfigCase{"NameWithSlash", [](auto& r) { r.set_name("a/b"); }, "name: expected"},
        BadConfigCase{"NoLayers", [](auto& r) { r.mutable_config()->set_num_layers(0); },
                      "config.num_layers"},
        BadConfigCase{"GroupTooLarge", [](auto& r) { r.mutable_config()->set_num_kv_heads(2); },
                      "config.num_kv_heads"},
        BadConfigCase{"NotADivisor", [](auto& r) { r.mutable_config()->set_num_kv_heads(5); },
                      "config.num_kv_heads"},
        BadConfigCase{"HeadDim96", [](auto& r) { r.mutable_config()->set_head_dim(96); },
                      "config.head_dim: expected 64, 128 or 256, got 96"},
        BadConfigCase{"PageSize24", [](auto& r) { r.mutable_config()->set_page_size(24); },
                      "config.page_size"},
        BadConfigCase{"PageSize256", [](auto& r) { r.mutable_config()->set_page_size(256); },
                      "config.page_size"},
        BadConfigCase{"Fp8Query",
                      [](auto& r) { r.mutable_config()->set_q_dtype(v1::DTYPE_FLOAT8_E4M3); },
                      "config.q_dtype"},
        BadConfigCase{"Fp32Cache",
                      [](auto& r) { r.mutable_config()->set_kv_dtype(v1::DTYPE_FLOAT32); },
                      "config.kv_dtype"},
        BadConfigCase{"NegativeScale", [](auto& r) { r.mutable_config()->set_k_scale(-1); },
                      "config.k_scale"},
        BadConfigCase{"NoCapacity", [](auto& r) { r.mutable_config()->clear_capacity(); },
                      "config.capacity"},
        BadConfigCase{"ZeroPages", [](auto& r) { r.mutable_config()->set_num_pages(0); },
                      "config.num_pages"},
        BadConfigCase{"TinyBudget", [](auto& r) { r.mutable_config()->set_memory_bytes(100); },
                      "config.memory_bytes"},
        // Names the field the caller set, not the page count derived from it.
        BadConfigCase{"HugeBudget",
                      [](auto& r) { r.mutable_config()->set_memory_bytes(int64_t{1} << 62); },
                      "config.memory_bytes: expected one page"},
        BadConfigCase{"UnknownQDtype",
                      [](auto& r) { r.mutable_config()->set_q_dtype(static_cast<v1::DType>(77)); },
                      "config.q_dtype: expected FLOAT16 or BFLOAT16 (default BFLOAT16), got 77 "
                      "(not a defined value)"},
        BadConfigCase{"OddRotaryDim",
                      [](auto& r) {
                        r.mutable_config()->mutable_rope()->set_style(v1::ROPE_STYLE_NEOX);
                        r.mutable_config()->mutable_rope()->set_rotary_dim(33);
                      },
                      "config.rope.rotary_dim"},
        BadConfigCase{"Llama3BadBand",
                      [](auto& r) {
                        auto* rope = r.mutable_config()->mutable_rope();
                        rope->set_style(v1::ROPE_STYLE_NEOX);
                        rope->set_scaling(v1::ROPE_SCALING_LLAMA3);
                        rope->set_low_freq_factor(4);
                        rope->set_high_freq_factor(2);
                      },
                      "config.rope.high_freq_factor"},
        BadConfigCase{"SeparateKvManaged",
                      [](auto& r) {
                        r.mutable_config()->set_page_table_form(v1::PAGE_TABLE_FORM_SEPARATE_KV);
                      },
                      "config.page_table_form"},
        BadConfigCase{"UnknownKind",
                      [](auto& r) { r.mutable_config()->set_kind(static_cast<v1::AttentionKind>(9)); },
                      "config.kind"},
        BadConfigCase{"MlaRank128",
                      [](auto& r) {
                        r.mutable_config()->set_kind(v1::ATTENTION_KIND_MLA);
                        r.mutable_config()->set_kv_lora_rank(128);
                      },
                      "config.kv_lora_rank"}),
    [](const auto& info) { return info.param.name; });

// The slow path as the service runs it: protobuf's message into the codec's form, then checked.
absl::Status ForwardArgsFromProto(const v1::ForwardRequest& request, wire::ForwardRequest& wire,
                                  ForwardArgs& args, std::vector<std::string>& scratch) {
  const absl::Status status = WireForwardFromProto(request, wire, scratch);
  return status.ok() ? ForwardArgsFromWire(wire, args) : status;
}

TEST(ForwardArgsFromProtoTest, ConvertsFloatValuesToTheTensorDtype) {
  v1::ForwardRequest request;
  v1::Tensor* q = request.mutable_q();
  q->set_dtype(v1::DTYPE_BFLOAT16);
  q->add_shape(1);
  q->add_shape(2);
  q->add_values(1.0f);
  q->add_values(-2.5f);
  wire::ForwardRequest wire;
  ForwardArgs args;
  std::vector<std::string> scratch;
  ASSERT_TRUE(ForwardArgsFromProto(request, wire, args, scratch).ok());
  ASSERT_TRUE(args.q.present);
  EXPECT_FALSE(args.k.present);
  // One form: the converted bytes are the tensor's one piece.
  ASSERT_EQ(args.q.pieces.size(), 1u);
  ASSERT_EQ(args.q.size_bytes(), 4);
  EXPECT_EQ(LoadAsFloat(DType::kBFloat16, args.q.pieces[0].data(), 0), 1.0f);
  EXPECT_EQ(LoadAsFloat(DType::kBFloat16, args.q.pieces[0].data(), 1), -2.5f);
}

TEST(ForwardArgsFromProtoTest, RejectsMismatchedValuesAndBadShapes) {
  v1::ForwardRequest request;
  v1::Tensor* k = request.mutable_k();
  k->set_dtype(v1::DTYPE_FLOAT16);
  k->add_shape(3);
  k->add_values(1.0f);
  wire::ForwardRequest wire;
  ForwardArgs args;
  std::vector<std::string> scratch;
  absl::Status status = ForwardArgsFromProto(request, wire, args, scratch);
  EXPECT_THAT(status.message(), HasSubstr("k.values: expected 3 values"));

  k->clear_values();
  k->set_shape(0, -4);
  ForwardArgs again;
  status = ForwardArgsFromProto(request, wire, again, scratch);
  EXPECT_THAT(status.message(), HasSubstr("k.shape[0]"));

  v1::ForwardRequest unset;
  unset.mutable_v()->add_shape(1);
  ForwardArgs third;
  status = ForwardArgsFromProto(unset, wire, third, scratch);
  EXPECT_THAT(status.message(), HasSubstr("v.dtype"));

  v1::ForwardRequest unknown;
  unknown.mutable_q()->set_dtype(static_cast<v1::DType>(42));
  unknown.mutable_q()->add_shape(1);
  ForwardArgs fourth;
  status = ForwardArgsFromProto(unknown, wire, fourth, scratch);
  EXPECT_THAT(status.message(), HasSubstr("q.dtype: expected FLOAT16, BFLOAT16, FLOAT8_E4M3 or "
                                          "FLOAT32, got 42 (not a defined value)"));
}

// The fast path and the slow path end in the same arguments: every tensor's bytes as pieces
// (the received slices, or the parsed message's one string), the same checks, the same errors.
TEST(ForwardArgsFromWireTest, FastAndSlowPathsGiveTheSameArgs) {
  v1::ForwardRequest request;
  request.set_step_id(7);
  request.set_layer(3);
  for (v1::Tensor* tensor : {request.mutable_q(), request.mutable_k(), request.mutable_v()}) {
    tensor->set_dtype(v1::DTYPE_BFLOAT16);
    for (int64_t dim : {4, 2, 16}) tensor->add_shape(dim);
    std::string data(4 * 2 * 16 * 2, '\0');
    for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<char>(i * 7);
    tensor->set_data(data);
  }
  const std::string bytes = request.SerializeAsString();
  std::vector<grpc::Slice> slices;
  for (size_t at = 0; at < bytes.size(); at += 100) {
    slices.emplace_back(bytes.data() + at, std::min<size_t>(100, bytes.size() - at));
  }
  wire::ForwardRequest fast_wire;
  ASSERT_EQ(wire::DecodeForwardRequest(slices, fast_wire), wire::Decoded::kForward);
  ForwardArgs fast;
  ASSERT_TRUE(ForwardArgsFromWire(fast_wire, fast).ok());
  wire::ForwardRequest slow_wire;
  ForwardArgs slow;
  std::vector<std::string> scratch;
  ASSERT_TRUE(ForwardArgsFromProto(request, slow_wire, slow, scratch).ok());
  EXPECT_EQ(fast.step_id, slow.step_id);
  EXPECT_EQ(fast.layer, slow.layer);
  const auto joined = [](const TensorArg& arg) {
    std::string out;
    for (std::string_view piece : arg.pieces) out.append(piece);
    return out;
  };
  for (auto [a, b] : {std::pair{&fast.q, &slow.q}, {&fast.k, &slow.k}, {&fast.v, &slow.v},
                      {&fast.q_pe, &slow.q_pe}}) {
    EXPECT_EQ(a->present, b->present);
    EXPECT_EQ(a->dtype, b->dtype);
    EXPECT_EQ(a->shape, b->shape);
    EXPECT_EQ(a->size_bytes(), b->size_bytes());
    EXPECT_EQ(joined(*a), joined(*b));
  }
  EXPECT_GT(fast.q.pieces.size(), 1u);  // the slices, not a copy
  EXPECT_EQ(slow.q.pieces.size(), 1u);  // the parsed message's string, not a copy
  EXPECT_EQ(slow.q.pieces[0].data(), request.q().data().data());

  // The same errors, naming the field.
  fast_wire.k.dtype = 99;
  const absl::Status status = ForwardArgsFromWire(fast_wire, fast);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("k.dtype"));
  request.mutable_k()->set_dtype(static_cast<v1::DType>(99));
  EXPECT_EQ(ForwardArgsFromProto(request, slow_wire, slow, scratch).message(), status.message());
  fast_wire.k.dtype = v1::DTYPE_BFLOAT16;
  fast_wire.v.shape = {-1};
  EXPECT_THAT(ForwardArgsFromWire(fast_wire, fast).message(), HasSubstr("v.shape[0]"));
}

TEST(ChannelOpenSpecFromProtoTest, TakesEveryKindAndNormalisesTheClientsBusId) {
  v1::OpenChannelRequest request;
  request.set_cache("c");
  request.set_max_tokens(8);
  request.set_kind(v1::CHANNEL_KIND_NCCL);
  absl::StatusOr<ChannelOpenSpec> spec = ChannelOpenSpecFromProto(request);
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->kind, ChannelKind::kNccl);
  EXPECT_EQ(spec->client_pci_bus_id, "");
  request.set_kind(v1::CHANNEL_KIND_CUDA_IPC);
  request.set_client_pci_bus_id("00000000:3B:00.0");
  spec = ChannelOpenSpecFromProto(request);
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->kind, ChannelKind::kCudaIpc);
  EXPECT_EQ(spec->client_pci_bus_id, "0000:3b:00.0");
}

TEST(ChannelOpenSpecFromProtoTest, RefusesAMalformedBusIdWhateverTheKind) {
  v1::OpenChannelRequest request;
  request.set_kind(v1::CHANNEL_KIND_HOST_SHM);
  request.set_client_pci_bus_id("gpu0");
  const absl::Status refused = ChannelOpenSpecFromProto(request).status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(refused.message(), HasSubstr("client_pci_bus_id"));
  request.set_client_pci_bus_id("");
  request.set_kind(static_cast<v1::ChannelKind>(77));
  EXPECT_THAT(ChannelOpenSpecFromProto(request).status().message(),
              HasSubstr("CHANNEL_KIND_NCCL"));
}

TEST(ChannelStatusToProtoTest, CarriesPeerAccessAndTheNcclUniqueIdThroughTheWire) {
  ChannelStatus status;
  status.id = 7;
  status.kind = ChannelKind::kNccl;
  status.nccl_unique_id = std::string(128, '\x5a');
  status.nccl_unique_id[0] = '\0';  // bytes, not a C string
  status.peer_access = true;
  v1::OpenChannelResponse response;
  ChannelStatusToProto(status, response.mutable_channel());
  v1::OpenChannelResponse parsed;
  ASSERT_TRUE(parsed.ParseFromString(response.SerializeAsString()));
  EXPECT_EQ(parsed.channel().kind(), v1::CHANNEL_KIND_NCCL);
  EXPECT_EQ(parsed.channel().nccl_unique_id(), status.nccl_unique_id);
  EXPECT_TRUE(parsed.channel().peer_access());
  EXPECT_EQ(ChannelKindToProto(ChannelKind::kCudaIpc), v1::CHANNEL_KIND_CUDA_IPC);
  EXPECT_EQ(ChannelKindToProto(ChannelKind::kHostShm), v1::CHANNEL_KIND_HOST_SHM);
}

TEST(OpenChannelRequestTest, TheClientsBusIdRoundTrips) {
  v1::OpenChannelRequest request;
  request.set_kind(v1::CHANNEL_KIND_CUDA_IPC);
  request.set_client_pci_bus_id("0000:3b:00.0");
  v1::OpenChannelRequest parsed;
  ASSERT_TRUE(parsed.ParseFromString(request.SerializeAsString()));
  EXPECT_EQ(parsed.client_pci_bus_id(), "0000:3b:00.0");
}

}  // namespace
}  // namespace attnd
