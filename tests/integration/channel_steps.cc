#include "channel_steps.h"

#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "attnd/client/tensor.h"
#include "attnd/client/client.h"
#include "attnd/client/sequence.h"
#include "attnd/status_macros.h"
#include "test_steps.h"

namespace attnd::integration {

absl::StatusOr<attnd::v1::ForwardResponse> ForwardThroughChannel(
    client::Channel& channel, uint32_t sequence, const attnd::v1::ForwardRequest& request,
    const attnd::v1::CacheConfig& config, int64_t rows, bool with_lse) {
  const int32_t layer = request.layer();
  const client::ChannelSlot slot = channel.Slot(layer);
  RETURN_IF_ERROR(channel.CopyIn(slot.q, request.q().data().data(), request.q().data().size()));
  RETURN_IF_ERROR(channel.CopyIn(slot.k, request.k().data().data(), request.k().data().size()));
  RETURN_IF_ERROR(channel.CopyIn(slot.v, request.v().data().data(), request.v().data().size()));
  if (channel.kind() == attnd::v1::CHANNEL_KIND_NCCL) {
    // On the legacy default stream (null), which CopyOut's cudaMemcpy below waits for.
    RETURN_IF_ERROR(channel.ExchangeOnStream(layer, rows, with_lse, slot, /*stream=*/nullptr));
  } else {
    channel.SetReady(layer, sequence);
    RETURN_IF_ERROR(channel.WaitDone(layer, sequence, absl::Seconds(30)));
  }
  attnd::v1::ForwardResponse response;
  attnd::v1::Tensor* o = response.mutable_o();
  o->set_dtype(config.q_dtype());
  o->add_shape(rows);
  o->add_shape(config.num_qo_heads());
  o->add_shape(config.head_dim());
  ASSIGN_OR_RETURN(const DType dtype, client::FromProto(config.q_dtype()));
  std::string o_bytes(rows * config.num_qo_heads() * config.head_dim() * DTypeBytes(dtype), '\0');
  RETURN_IF_ERROR(channel.CopyOut(o_bytes.data(), slot.o, o_bytes.size()));
  o->set_data(std::move(o_bytes));
  if (with_lse) {
    attnd::v1::Tensor* lse = response.mutable_lse();
    lse->set_dtype(attnd::v1::DTYPE_FLOAT32);
    lse->add_shape(rows);
    lse->add_shape(config.num_qo_heads());
    std::string lse_bytes(rows * config.num_qo_heads() * sizeof(float), '\0');
    RETURN_IF_ERROR(channel.CopyOut(lse_bytes.data(), slot.lse, lse_bytes.size()));
    lse->set_data(std::move(lse_bytes));
  }
  return response;
}

std::string DiffOutputs(const attnd::v1::ForwardResponse& expected,
                        const attnd::v1::ForwardResponse& actual) {
  if (expected.o().data() != actual.o().data()) {
    const std::string& a = expected.o().data();
    const std::string& b = actual.o().data();
    if (a.size() != b.size()) return absl::StrCat("o: ", a.size(), " vs ", b.size(), " bytes");
    size_t first = 0;
    while (first < a.size() && a[first] == b[first]) ++first;
    return absl::StrCat("o differs from byte ", first, " of ", a.size());
  }
  if (expected.lse().data() != actual.lse().data()) return "lse differs";
  return "";
}

absl::Status CompareChannelWithGrpc(client::Client& client, const std::string& prefix,
                                    attnd::v1::ChannelKind kind,
                                    const attnd::v1::CacheConfig& config, int decode_steps,
                                    uint64_t seed, bool chained, int32_t client_device,
                                    std::optional<int32_t> cache_device) {
  std::vector<Entries> steps = {{{1, 5}, {2, 9}, {3, 1}}};
  for (int i = 0; i < decode_steps; ++i) steps.push_back({{1, 1}, {9, 0}, {2, 1}, {3, 1}});
  return CompareChannelStepsWithGrpc(client, prefix, kind, config, steps, seed,
                                     /*max_tokens=*/64, chained, client_device, cache_device);
}

absl::Status CompareChannelStepsWithGrpc(client::Client& client, const std::string& prefix,
                                         attnd::v1::ChannelKind kind,
                                         const attnd::v1::CacheConfig& config,
                                         const std::vector<Entries>& steps, uint64_t seed,
                                         int32_t max_tokens, bool chained,
                                         int32_t client_device,
                                         std::optional<int32_t> cache_device) {
  const std::string grpc_cache = prefix + "-grpc";
  const std::string channel_cache = prefix + "-channel";
  RETURN_IF_ERROR(client.CreateCache(grpc_cache, config, cache_device).status());
  RETURN_IF_ERROR(client.CreateCache(channel_cache, config, cache_device).status());
  client::ChannelOptions options;
  options.kind = kind;
  options.max_tokens = max_tokens;
  options.with_lse = true;
  options.cuda_device = client_device;
  ASSIGN_OR_RETURN(std::unique_ptr<client::Channel> channel,
                   client::Channel::Open(client, channel_cache, options));
  std::mt19937_64 rng(seed);
  auto plan_on_channel = [&](size_t s) {
    attnd::v1::PlanRequest request = MakePlan(channel_cache, steps[s], true);
    request.set_channel_id(channel->id());
    return client.Plan(request);
  };
  ASSIGN_OR_RETURN(attnd::v1::PlanResponse channel_plan, plan_on_channel(0));
  for (size_t s = 0; s < steps.size(); ++s) {
    ASSIGN_OR_RETURN(const attnd::v1::PlanResponse grpc_plan,
                     client.Plan(MakePlan(grpc_cache, steps[s], /*return_lse=*/true)));
    if (channel_plan.channel_sequence() == 0) {
      return absl::InternalError("Plan on a channel answered no channel_sequence");
    }
    // Chained: the next step is planned now, on top of this one, before any of its layers ran.
    attnd::v1::PlanResponse next_plan;
    if (chained && s + 1 < steps.size()) {
      ASSIGN_OR_RETURN(next_plan, plan_on_channel(s + 1));
    }
    for (int e = 0; e < grpc_plan.entries_size(); ++e) {
      if (grpc_plan.entries(e).start_position() != channel_plan.entries(e).start_position()) {
        return absl::InternalError(absl::StrCat("step ", s, " entry ", e, ": start_position ",
                                                channel_plan.entries(e).start_position(),
                                                " on the channel, ",
                                                grpc_plan.entries(e).start_position(),
                                                " through Forward"));
      }
    }
    for (int32_t layer = 0; layer < config.num_layers(); ++layer) {
      attnd::v1::ForwardRequest request = RandomLayer(rng, config, grpc_plan.num_tokens(), layer);
      request.set_step_id(grpc_plan.step_id());
      ASSIGN_OR_RETURN(const attnd::v1::ForwardResponse expected, client.Forward(request));
      ASSIGN_OR_RETURN(const attnd::v1::ForwardResponse actual,
                       ForwardThroughChannel(*channel, channel_plan.channel_sequence(), request,
                                             config, channel_plan.num_tokens(), true));
      if (const std::string diff = DiffOutputs(expected, actual); !diff.empty()) {
        return absl::InternalError(
            absl::StrCat("step ", s, " layer ", layer, ": channel vs Forward: ", diff));
      }
    }
    // The channel step committed after its last layer, as the Forward one did.
    ASSIGN_OR_RETURN(const attnd::v1::EndStepResponse ended,
                     client.EndStep(channel_plan.step_id(), false));
    if (ended.outcome() != attnd::v1::STEP_OUTCOME_COMMITTED ||
        ended.layers_run() != config.num_layers()) {
      return absl::InternalError(absl::StrCat("channel step ", s, " ended ",
                                              ended.ShortDebugString()));
    }
    if (s + 1 == steps.size()) break;
    if (chained) {
      channel_plan = next_plan;
    } else {
      ASSIGN_OR_RETURN(channel_plan, plan_on_channel(s + 1));
    }
  }
  return absl::OkStatus();
}

namespace {

// One deterministic step of `rows` new tokens for `sequence` through Forward; each layer's o.
absl::StatusOr<std::vector<std::string>> DeterministicStep(client::Client& client,
                                                           const std::string& cache,
                                                           const attnd::v1::CacheConfig& config,
                                                           uint64_t sequence, int32_t rows,
                                                           uint64_t seed) {
  std::mt19937_64 rng(seed);
  attnd::v1::PlanRequest plan = MakePlan(cache, {{sequence, rows}});
  plan.mutable_options()->set_deterministic(true);
  ASSIGN_OR_RETURN(const attnd::v1::PlanResponse planned, client.Plan(plan));
  std::vector<std::string> o;
  for (int32_t layer = 0; layer < config.num_layers(); ++layer) {
    attnd::v1::ForwardRequest request = RandomLayer(rng, config, rows, layer);
    request.set_step_id(planned.step_id());
    ASSIGN_OR_RETURN(const attnd::v1::ForwardResponse response, client.Forward(request));
    o.push_back(response.o().data());
  }
  return o;
}

}  // namespace

absl::Status CompareTransferWithGrpc(client::Client& client, const std::string& prefix,
                                     attnd::v1::ChannelKind kind) {
  const attnd::v1::CacheConfig config = SmallConfig(64);
  const std::string a = prefix + "-a";
  const std::string b = prefix + "-b";
  RETURN_IF_ERROR(client.CreateCache(a, config).status());
  RETURN_IF_ERROR(client.CreateCache(b, config).status());
  RETURN_IF_ERROR(DeterministicStep(client, a, config, 1, 13, 5).status());
  constexpr int64_t kChunkBytes = 1024;
  std::vector<attnd::v1::ExportSequenceResponse> grpc;
  RETURN_IF_ERROR(client::ExportSequence(
      client, a, 1,
      [&](const attnd::v1::ExportSequenceResponse& message) {
        grpc.push_back(message);
        return absl::OkStatus();
      },
      kChunkBytes));
  client::ChannelOptions options;
  options.kind = kind;
  options.max_tokens = 1;
  options.slots = 2;
  ASSIGN_OR_RETURN(std::unique_ptr<client::Channel> out, client::Channel::Open(client, a, options));
  ASSIGN_OR_RETURN(std::unique_ptr<client::Channel> in, client::Channel::Open(client, b, options));
  std::vector<attnd::v1::ExportSequenceResponse> through;
  RETURN_IF_ERROR(client::ExportSequenceThroughChannel(
      client, a, 1, *out,
      [&](const attnd::v1::ExportSequenceResponse& message) {
        through.push_back(message);
        return absl::OkStatus();
      },
      kChunkBytes));
  if (through.size() != grpc.size()) {
    return absl::InternalError(absl::StrCat("the channel's export has ", through.size(),
                                            " messages, gRPC's ", grpc.size()));
  }
  // Message 0 is the header (the same sequence described); the chunks carry the bytes.
  for (size_t i = 1; i < grpc.size(); ++i) {
    if (through[i].chunk().data() != grpc[i].chunk().data()) {
      return absl::InternalError(absl::StrCat("exported chunk ", i, " differs from gRPC's"));
    }
  }
  size_t next = 0;
  RETURN_IF_ERROR(client::ImportSequenceThroughChannel(
                      client, b, 9, *in,
                      [&](attnd::v1::ExportSequenceResponse& message) -> absl::StatusOr<bool> {
                        if (next == through.size()) return false;
                        message = through[next++];
                        return true;
                      })
                      .status());
  ASSIGN_OR_RETURN(const std::vector<std::string> source,
                   DeterministicStep(client, a, config, 1, 2, 3));
  ASSIGN_OR_RETURN(const std::vector<std::string> imported,
                   DeterministicStep(client, b, config, 9, 2, 3));
  if (source != imported) {
    return absl::InternalError("a step over the imported sequence differs from the source's");
  }
  out.reset();
  in.reset();
  RETURN_IF_ERROR(client.DeleteCache(a, /*force=*/true));
  return client.DeleteCache(b, /*force=*/true);
}

int PortFromServingLine(const std::string& line) {
  const size_t at = line.find("on port ");
  if (at == std::string::npos) return 0;
  const size_t begin = at + 8;
  size_t end = begin;
  while (end < line.size() && line[end] >= '0' && line[end] <= '9') ++end;
  int port = 0;
  if (!absl::SimpleAtoi(line.substr(begin, end - begin), &port)) return 0;
  return port;
}

}  // namespace attnd::integration
