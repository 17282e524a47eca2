// ExportSequence and ImportSequence through a HOST_SHM channel: the same bytes as through gRPC
// messages, acknowledged region by region; a client that never acknowledges is timed out with
// nothing left behind; descriptors attnd did not publish, corrupt regions and a channel that is
// busy with a step are refused and change nothing.
#include <cstring>
#include <random>
#include <thread>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "attnd/client/channel.h"
#include "attnd/client/sequence.h"
#include "status_matchers.h"
#include "test_server.h"
#include "test_steps.h"

namespace attnd::integration {
namespace {

using ::testing::HasSubstr;

constexpr absl::Duration kStepTtl = absl::Milliseconds(400);

class SequenceChannelTest : public IntegrationTest {
 protected:
  // A short TTL: the export's wait for acknowledgements is bounded by it.
  ServerOptions Options() const override {
    ServerOptions options = TestServerOptions();
    options.step_ttl = kStepTtl;
    return options;
  }

  void SetUp() override {
    IntegrationTest::SetUp();
    ASSERT_OK(client().CreateCache("a", config).status());
    ASSERT_OK(client().CreateCache("b", config).status());
    Step("a", 1, 13);  // 4 pages, the last holding 1 token
  }

  // Runs one step appending `rows` random tokens to `sequence`; returns each layer's o bytes.
  std::vector<std::string> Step(const std::string& cache, uint64_t sequence, int64_t rows,
                                uint64_t seed = 5) {
    std::mt19937_64 layer_rng(seed);
    attnd::v1::PlanRequest plan = MakePlan(cache, {{sequence, static_cast<int32_t>(rows)}});
    plan.mutable_options()->set_deterministic(true);
    absl::StatusOr<attnd::v1::PlanResponse> planned = client().Plan(plan);
    EXPECT_TRUE(planned.ok()) << planned.status();
    if (!planned.ok()) return {};
    std::vector<std::string> o;
    for (int32_t layer = 0; layer < config.num_layers(); ++layer) {
      attnd::v1::ForwardRequest request = RandomLayer(layer_rng, config, rows, layer);
      request.set_step_id(planned->step_id());
      absl::StatusOr<attnd::v1::ForwardResponse> response = client().Forward(request);
      EXPECT_TRUE(response.ok()) << response.status();
      o.push_back(response.ok() ? response->o().data() : "");
    }
    return o;
  }

  // A HOST_SHM channel on "b" whose regions hold one page (1 KiB) each: small chunks go round
  // the two regions several times.
  std::unique_ptr<client::Channel> OpenChannel(
      const std::string& cache = "b",
      attnd::v1::ChannelKind kind = attnd::v1::CHANNEL_KIND_HOST_SHM) {
    client::ChannelOptions options;
    options.kind = kind;
    options.max_tokens = 1;
    options.slots = 2;
    absl::StatusOr<std::unique_ptr<client::Channel>> channel =
        client::Channel::Open(client(), cache, options);
    EXPECT_TRUE(channel.ok()) << channel.status();
    return channel.ok() ? *std::move(channel) : nullptr;
  }

  std::vector<attnd::v1::ExportSequenceResponse> ExportOverGrpc(int64_t max_chunk_bytes) {
    std::vector<attnd::v1::ExportSequenceResponse> messages;
    EXPECT_OK(client::ExportSequence(
        client(), "a", 1,
        [&](const attnd::v1::ExportSequenceResponse& message) {
          messages.push_back(message);
          return absl::OkStatus();
        },
        max_chunk_bytes));
    return messages;
  }

  void ExpectTargetUntouched() {
    ASSERT_OK_AND_ASSIGN(attnd::v1::CacheInfo b, client().GetCache("b"));
    EXPECT_EQ(b.num_sequences(), 0);
    EXPECT_EQ(b.used_pages(), 0);
  }

  // The source as it was before any export: 4 pages, none pinned.
  void ExpectSourceUnpinned() {
    ASSERT_OK_AND_ASSIGN(attnd::v1::CacheInfo a, client().GetCache("a"));
    EXPECT_EQ(a.used_pages(), 4);
    EXPECT_EQ(a.shared_pages(), 0);
    EXPECT_EQ(ProbeLength(client(), "a", 1), 13);
  }

  const attnd::v1::CacheConfig config = SmallConfig(64);
};

TEST_F(SequenceChannelTest, RoundTripThroughHostShmIsBitwiseTheGrpcPath) {
  std::unique_ptr<client::Channel> out = OpenChannel("a");
  std::unique_ptr<client::Channel> in = OpenChannel("b");
  ASSERT_NE(out, nullptr);
  ASSERT_NE(in, nullptr);
  EXPECT_EQ(in->transfer_regions(), 2);
  EXPECT_GE(in->transfer_region_bytes(), 1024);
  const std::vector<attnd::v1::ExportSequenceResponse> grpc = ExportOverGrpc(1024);
  // The raw descriptors: every chunk's bytes in a published region, round-robin, with
  // sequence numbers 1, 2, ...
  std::vector<attnd::v1::ExportSequenceResponse> through;
  ASSERT_OK(client::ExportSequenceThroughChannel(
      client(), "a", 1, *out,
      [&](const attnd::v1::ExportSequenceResponse& message) {
        through.push_back(message);
        return absl::OkStatus();
      },
      1024));
  ASSERT_EQ(through.size(), grpc.size());
  ASSERT_EQ(grpc[0].header().num_chunks(), 16);
  EXPECT_EQ(through[0].header().SerializeAsString(), grpc[0].header().SerializeAsString());
  for (size_t i = 1; i < grpc.size(); ++i) {
    SCOPED_TRACE(i);
    EXPECT_EQ(through[i].chunk().data(), grpc[i].chunk().data());
    EXPECT_EQ(through[i].chunk().crc32(), grpc[i].chunk().crc32());
    EXPECT_EQ(through[i].chunk().layer(), grpc[i].chunk().layer());
    EXPECT_EQ(through[i].chunk().first_page(), grpc[i].chunk().first_page());
  }
  // Import through the other channel; the pages attend bitwise like the source's.
  size_t next = 0;
  ASSERT_OK_AND_ASSIGN(
      attnd::v1::ImportSequenceResponse imported,
      client::ImportSequenceThroughChannel(
          client(), "b", 9, *in,
          [&](attnd::v1::ExportSequenceResponse& message) -> absl::StatusOr<bool> {
            if (next == through.size()) return false;
            message = through[next++];
            return true;
          }));
  EXPECT_EQ(imported.num_tokens(), 13);
  EXPECT_EQ(imported.bytes(), 2 * 2 * 4 * 1024);
  for (const int64_t rows : {1, 5}) {
    EXPECT_EQ(Step("a", 1, rows, rows), Step("b", 9, rows, rows));
  }
  // A copy through both channels lands the same sequence again.
  ASSERT_OK_AND_ASSIGN(attnd::v1::ImportSequenceResponse copied,
                       client::CopySequenceThroughChannels(client(), "a", 1, out.get(),
                                                           client(), "b", 10, in.get()));
  EXPECT_EQ(copied.num_tokens(), 19);
  EXPECT_EQ(Step("a", 1, 1, 11), Step("b", 10, 1, 11));
  // Between transfers the channels carry steps again.
  ASSERT_OK_AND_ASSIGN(attnd::v1::CacheInfo b, client().GetCache("b"));
  ASSERT_EQ(b.channels_size(), 1);
  attnd::v1::PlanRequest plan = MakePlan("b", {{9, 1}}, /*return_lse=*/false);
  plan.set_channel_id(in->id());
  ASSERT_OK_AND_ASSIGN(attnd::v1::PlanResponse planned, client().Plan(plan));
  ASSERT_OK(client().EndStep(planned.step_id(), /*abort=*/true).status());
}

// The same over CUDA_IPC, where the ring is device memory (ATTND_TEST_BACKEND=cuda on a GPU
// machine; skipped on the CPU backend, which has no such channels).
// The CUDA_IPC round trip runs from a second process (CUDA maps no IPC handle into the process
// that made it): channel_test.cc, SequenceTransfersInAnotherProcessMatchTheGrpcPathBitwise.

TEST_F(SequenceChannelTest, ExportTimesOutWhenTheClientNeverAcknowledges) {
  std::unique_ptr<client::Channel> channel = OpenChannel("a");
  ASSERT_NE(channel, nullptr);
  auto context = client().NewContext(/*with_deadline=*/false);
  attnd::v1::ExportSequenceRequest request;
  request.set_cache("a");
  request.set_sequence_id(1);
  request.set_max_chunk_bytes(1024);
  request.set_channel_id(channel->id());
  auto reader = client().stub().ExportSequence(context.get(), request);
  attnd::v1::ExportSequenceResponse message;
  int chunks = 0;
  const absl::Time start = absl::Now();
  while (reader->Read(&message)) {
    if (message.has_chunk()) {
      ++chunks;
      EXPECT_TRUE(message.chunk().data().empty());
      EXPECT_EQ(message.chunk().ring_offset(), channel->TransferRegionOffset((chunks - 1) % 2));
    }
  }
  const grpc::Status status = reader->Finish();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << status.error_message();
  EXPECT_THAT(status.error_message(), HasSubstr("acknowledge chunk 1"));
  EXPECT_EQ(chunks, 2);  // one per region, then the wait for the first region
  EXPECT_GE(absl::Now() - start, kStepTtl);
  // The pages are unpinned and the channel is free again: a transfer through it completes.
  ExpectSourceUnpinned();
  int64_t bytes = 0;
  ASSERT_OK(client::ExportSequenceThroughChannel(
      client(), "a", 1, *channel,
      [&](const attnd::v1::ExportSequenceResponse& m) {
        bytes += m.chunk().data().size();
        return absl::OkStatus();
      },
      1024));
  EXPECT_EQ(bytes, 2 * 2 * 4 * 1024);
  ExpectSourceUnpinned();
}

// A hand-made import through `channel`: the header, then `chunks` as given.
grpc::Status RawImport(client::Client& client, const client::Channel& channel,
                       const attnd::v1::SequenceHeader& header,
                       const std::vector<attnd::v1::SequenceChunk>& chunks) {
  auto context = client.NewContext(/*with_deadline=*/false);
  attnd::v1::ImportSequenceResponse response;
  auto writer = client.stub().ImportSequence(context.get(), &response);
  attnd::v1::ImportSequenceRequest request;
  request.set_cache("b");
  request.set_sequence_id(1);
  request.set_channel_id(channel.id());
  *request.mutable_header() = header;
  writer->Write(request);
  for (const attnd::v1::SequenceChunk& chunk : chunks) {
    request.Clear();
    *request.mutable_chunk() = chunk;
    if (!writer->Write(request)) break;
  }
  writer->WritesDone();
  return writer->Finish();
}

TEST_F(SequenceChannelTest, ImportRefusesDescriptorsAttndDidNotPublish) {
  std::unique_ptr<client::Channel> channel = OpenChannel("b");
  ASSERT_NE(channel, nullptr);
  const std::vector<attnd::v1::ExportSequenceResponse> grpc = ExportOverGrpc(1024);
  // The first chunk's bytes in region 0, as a descriptor.
  attnd::v1::SequenceChunk good = grpc[1].chunk();
  ASSERT_OK(channel->CopyIn(channel->TransferRegion(0), good.data().data(), good.data().size()));
  good.clear_data();
  good.set_ring_offset(channel->TransferRegionOffset(0));
  good.set_ring_bytes(1024);
  good.set_channel_sequence(1);
  const int64_t ring_bytes = channel->info().layout().ring_bytes();
  struct Case {
    const char* name;
    std::function<void(attnd::v1::SequenceChunk&)> edit;
    const char* field;
  };
  const Case cases[] = {
      {"outside the ring", [&](auto& c) { c.set_ring_offset(ring_bytes + 4096); },
       ".ring_offset"},
      {"negative", [&](auto& c) { c.set_ring_offset(-1024); }, ".ring_offset"},
      {"inside a region", [&](auto& c) { c.set_ring_offset(c.ring_offset() + 256); },
       ".ring_offset"},
      {"the flag words", [&](auto& c) { c.set_ring_offset(channel->info().layout().ready_offsets(0)); },
       ".ring_offset"},
      {"size disagrees with pages", [&](auto& c) { c.set_ring_bytes(512); }, ".ring_bytes"},
      {"past the region", [&](auto& c) { c.set_ring_bytes(int64_t{1} << 40); }, ".ring_bytes"},
      {"data and descriptor", [&](auto& c) { c.set_data("xyz"); }, ".data"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    attnd::v1::SequenceChunk chunk = good;
    c.edit(chunk);
    const grpc::Status status = RawImport(client(), *channel, grpc[0].header(), {chunk});
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << status.error_message();
    EXPECT_THAT(status.error_message(), HasSubstr(c.field));
    ExpectTargetUntouched();
  }
  // A descriptor in an import that named no channel.
  {
    auto context = client().NewContext(/*with_deadline=*/false);
    attnd::v1::ImportSequenceResponse response;
    auto writer = client().stub().ImportSequence(context.get(), &response);
    attnd::v1::ImportSequenceRequest request;
    request.set_cache("b");
    *request.mutable_header() = grpc[0].header();
    writer->Write(request);
    request.Clear();
    *request.mutable_chunk() = good;
    writer->Write(request);
    writer->WritesDone();
    const grpc::Status status = writer->Finish();
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_THAT(status.error_message(), HasSubstr("ring_offset"));
    ExpectTargetUntouched();
  }
  // The good descriptor passes these checks (the import then lacks its other chunks).
  const grpc::Status status = RawImport(client(), *channel, grpc[0].header(), {good});
  EXPECT_EQ(status.error_code(), grpc::StatusCode::DATA_LOSS) << status.error_message();
  EXPECT_THAT(status.error_message(), HasSubstr("missing"));
  // attnd acknowledged the region once the bytes were in its pages.
  EXPECT_EQ(channel->TransferFlag(0), 1u);
  ExpectTargetUntouched();
}

TEST_F(SequenceChannelTest, ImportChecksumMismatchIsDataLossAndChangesNothing) {
  std::unique_ptr<client::Channel> channel = OpenChannel("b");
  ASSERT_NE(channel, nullptr);
  const std::vector<attnd::v1::ExportSequenceResponse> grpc = ExportOverGrpc(1024);
  std::vector<attnd::v1::ExportSequenceResponse> corrupt = grpc;
  // The last chunk's bytes change after its CRC was taken (the import reaches it last).
  std::string& data = *corrupt.back().mutable_chunk()->mutable_data();
  data[100] ^= 0x01;
  size_t next = 0;
  const uint32_t ended = channel->TransfersEnded();
  absl::StatusOr<attnd::v1::ImportSequenceResponse> imported =
      client::ImportSequenceThroughChannel(
          client(), "b", 1, *channel,
          [&](attnd::v1::ExportSequenceResponse& message) -> absl::StatusOr<bool> {
            if (next == corrupt.size()) return false;
            message = corrupt[next++];
            return true;
          });
  EXPECT_EQ(imported.status().code(), absl::StatusCode::kDataLoss) << imported.status();
  EXPECT_THAT(std::string(imported.status().message()), HasSubstr("crc32"));
  EXPECT_EQ(channel->TransfersEnded(), ended + 1);
  ExpectTargetUntouched();
  // An early corrupt chunk: attnd ends the import while the client waits for a region; the
  // client sees the transfer end (no wait for the region timeout) and the call's status.
  corrupt = grpc;
  (*corrupt[1].mutable_chunk()->mutable_data())[7] ^= 0x40;
  next = 0;
  const absl::Time start = absl::Now();
  imported = client::ImportSequenceThroughChannel(
      client(), "b", 1, *channel,
      [&](attnd::v1::ExportSequenceResponse& message) -> absl::StatusOr<bool> {
        if (next == corrupt.size()) return false;
        message = corrupt[next++];
        return true;
      });
  EXPECT_EQ(imported.status().code(), absl::StatusCode::kDataLoss) << imported.status();
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  ExpectTargetUntouched();
}

TEST_F(SequenceChannelTest, ChannelCarriesStepsOrATransferNotBoth) {
  std::unique_ptr<client::Channel> channel = OpenChannel("a");
  ASSERT_NE(channel, nullptr);
  // A step open on the channel: no transfer through it.
  attnd::v1::PlanRequest plan = MakePlan("a", {{2, 1}}, /*return_lse=*/false);
  plan.set_channel_id(channel->id());
  ASSERT_OK_AND_ASSIGN(attnd::v1::PlanResponse planned, client().Plan(plan));
  absl::Status busy = client::ExportSequenceThroughChannel(
      client(), "a", 1, *channel, [](const auto&) { return absl::OkStatus(); });
  EXPECT_EQ(busy.code(), absl::StatusCode::kFailedPrecondition) << busy;
  EXPECT_THAT(std::string(busy.message()), HasSubstr("open steps"));
  ASSERT_OK(client().EndStep(planned.step_id(), /*abort=*/true).status());
  ExpectSourceUnpinned();

  // A transfer under way (an export waiting for its first acknowledgement): no step on it,
  // and no second transfer.
  auto context = client().NewContext(/*with_deadline=*/false);
  attnd::v1::ExportSequenceRequest request;
  request.set_cache("a");
  request.set_sequence_id(1);
  request.set_max_chunk_bytes(1024);
  request.set_channel_id(channel->id());
  auto reader = client().stub().ExportSequence(context.get(), request);
  attnd::v1::ExportSequenceResponse message;
  ASSERT_TRUE(reader->Read(&message));  // the header: the channel is lent from here
  ASSERT_OK_AND_ASSIGN(attnd::v1::CacheInfo lent, client().GetCache("a"));
  ASSERT_EQ(lent.channels_size(), 1);
  EXPECT_TRUE(lent.channels(0).transferring());
  absl::StatusOr<attnd::v1::PlanResponse> refused = client().Plan(plan);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << refused.status();
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("transfer"));
  absl::Status second = client::ExportSequenceThroughChannel(
      client(), "a", 1, *channel, [](const auto&) { return absl::OkStatus(); });
  EXPECT_EQ(second.code(), absl::StatusCode::kFailedPrecondition) << second;
  context->TryCancel();
  while (reader->Read(&message)) {
  }
  EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::CANCELLED);
  // Once the export let go, the channel plans again.
  absl::StatusOr<attnd::v1::PlanResponse> again = client().Plan(plan);
  for (int i = 0; i < 100 && !again.ok(); ++i) {
    absl::SleepFor(absl::Milliseconds(10));
    again = client().Plan(plan);
  }
  ASSERT_OK(again.status());
  ASSERT_OK(client().EndStep(again->step_id(), /*abort=*/true).status());
}

TEST_F(SequenceChannelTest, ChannelClosedMidExportEndsItAndUnpinsThePages) {
  std::unique_ptr<client::Channel> channel = OpenChannel("b");  // a channel of another cache
  ASSERT_NE(channel, nullptr);
  auto context = client().NewContext(/*with_deadline=*/false);
  attnd::v1::ExportSequenceRequest request;
  request.set_cache("a");
  request.set_sequence_id(1);
  request.set_max_chunk_bytes(1024);
  request.set_channel_id(channel->id());
  auto reader = client().stub().ExportSequence(context.get(), request);
  attnd::v1::ExportSequenceResponse message;
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(reader->Read(&message));  // header, regions 0 and 1
  ASSERT_OK_AND_ASSIGN(attnd::v1::CacheInfo pinned, client().GetCache("a"));
  EXPECT_EQ(pinned.shared_pages(), 4);
  channel.reset();  // ends its OpenChannel call: the channel closes under the export
  while (reader->Read(&message)) {
  }
  const grpc::Status status = reader->Finish();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE) << status.error_message();
  EXPECT_THAT(status.error_message(), HasSubstr("closed during the transfer"));
  ExpectSourceUnpinned();
  ASSERT_OK_AND_ASSIGN(attnd::v1::CacheInfo b, client().GetCache("b"));
  EXPECT_EQ(b.channels_size(), 0);
}

// With the default step TTL (60 s), shutdown does not wait for it: an export waiting for a
// client's acknowledgement ends with the server.
class SequenceChannelShutdownTest : public SequenceChannelTest {
 protected:
  ServerOptions Options() const override { return TestServerOptions(); }
};

TEST_F(SequenceChannelShutdownTest, ShutdownEndsAnExportWaitingForAcknowledgements) {
  std::unique_ptr<client::Channel> channel = OpenChannel("a");
  ASSERT_NE(channel, nullptr);
  auto context = client().NewContext(/*with_deadline=*/false);
  attnd::v1::ExportSequenceRequest request;
  request.set_cache("a");
  request.set_sequence_id(1);
  request.set_max_chunk_bytes(1024);
  request.set_channel_id(channel->id());
  auto reader = client().stub().ExportSequence(context.get(), request);
  attnd::v1::ExportSequenceResponse message;
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(reader->Read(&message));
  const absl::Time start = absl::Now();
  server().Shutdown();
  server().Wait();
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  while (reader->Read(&message)) {
  }
  EXPECT_FALSE(reader->Finish().ok());
}

TEST_F(SequenceChannelTest, UnknownChannelIsNotFound) {
  auto context = client().NewContext();
  attnd::v1::ExportSequenceRequest request;
  request.set_cache("a");
  request.set_sequence_id(1);
  request.set_channel_id(777);
  auto reader = client().stub().ExportSequence(context.get(), request);
  attnd::v1::ExportSequenceResponse message;
  while (reader->Read(&message)) {
  }
  const grpc::Status status = reader->Finish();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_THAT(status.error_message(), HasSubstr("channel_id"));
  ExpectSourceUnpinned();
}

}  // namespace
}  // namespace attnd::integration
