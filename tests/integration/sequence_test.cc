// ForkSequence, ExportSequence and ImportSequence over gRPC: a round trip attends bitwise like
// the source, and a corrupt, truncated, misshapen or oversized import changes nothing.
#include <cstdio>
#include <fstream>
#include <random>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "attnd/client/sequence.h"
#include "status_matchers.h"
#include "test_server.h"
#include "test_steps.h"

namespace attnd::integration {
namespace {

using ::testing::HasSubstr;
using SequenceTest = IntegrationTest;

// Each layer's q/k/v for `rows` new tokens.
std::vector<attnd::v1::ForwardRequest> Layers(std::mt19937_64& rng,
                                              const attnd::v1::CacheConfig& config,
                                              int64_t rows) {
  std::vector<attnd::v1::ForwardRequest> layers;
  for (int32_t layer = 0; layer < config.num_layers(); ++layer) {
    layers.push_back(RandomLayer(rng, config, rows, layer));
  }
  return layers;
}

// Runs one step appending `layers` to `sequence`; returns each layer's o bytes.
std::vector<std::string> Step(client::Client& client, const std::string& cache,
                              uint64_t sequence, std::vector<attnd::v1::ForwardRequest> layers) {
  attnd::v1::PlanRequest plan =
      MakePlan(cache, {{sequence, static_cast<int32_t>(layers[0].q().shape(0))}}, false);
  plan.mutable_options()->set_deterministic(true);
  absl::StatusOr<attnd::v1::PlanResponse> planned = client.Plan(plan);
  EXPECT_TRUE(planned.ok()) << planned.status();
  if (!planned.ok()) return {};
  std::vector<std::string> o;
  for (attnd::v1::ForwardRequest& layer : layers) {
    layer.set_step_id(planned->step_id());
    absl::StatusOr<attnd::v1::ForwardResponse> response = client.Forward(layer);
    EXPECT_TRUE(response.ok()) << response.status();
    o.push_back(response.ok() ? response->o().data() : "");
  }
  return o;
}

// Every message of an export, in order.
std::vector<attnd::v1::ExportSequenceResponse> ExportAll(client::Client& client,
                                                         const std::string& cache, uint64_t id,
                                                         int64_t max_chunk_bytes = 0) {
  std::vector<attnd::v1::ExportSequenceResponse> messages;
  EXPECT_OK(client::ExportSequence(
      client, cache, id,
      [&](const attnd::v1::ExportSequenceResponse& message) {
        messages.push_back(message);
        return absl::OkStatus();
      },
      max_chunk_bytes));
  return messages;
}

absl::StatusOr<attnd::v1::ImportSequenceResponse> ImportAll(
    client::Client& client, const std::string& cache, uint64_t id,
    std::vector<attnd::v1::ExportSequenceResponse> messages) {
  size_t next = 0;
  return client::ImportSequence(
      client, cache, id,
      [&](attnd::v1::ExportSequenceResponse& message) -> absl::StatusOr<bool> {
        if (next == messages.size()) return false;
        message = messages[next++];
        return true;
      });
}

class ExportImportTest : public SequenceTest {
 protected:
  void SetUp() override {
    SequenceTest::SetUp();
    ASSERT_OK(client().CreateCache("a", config).status());
    ASSERT_OK(client().CreateCache("b", config).status());
    Step(client(), "a", 1, Layers(rng, config, 13));  // 4 pages, the last holding 1 token
  }

  // Cache "b" as it was: no sequence, no page.
  void ExpectTargetUntouched() {
    ASSERT_OK_AND_ASSIGN(attnd::v1::CacheInfo b, client().GetCache("b"));
    EXPECT_EQ(b.num_sequences(), 0);
    EXPECT_EQ(b.used_pages(), 0);
    EXPECT_EQ(ProbeLength(client(), "b", 1), 0);
  }

  const attnd::v1::CacheConfig config = SmallConfig(64);
  std::mt19937_64 rng{7};
};

TEST_F(ExportImportTest, RoundTripAttendsBitwiseLikeTheSource) {
  // Small chunks: every (layer, pool) spans several.
  std::vector<attnd::v1::ExportSequenceResponse> messages = ExportAll(client(), "a", 1, 3000);
  ASSERT_FALSE(messages.empty());
  const attnd::v1::SequenceHeader& header = messages[0].header();
  EXPECT_EQ(header.sequence_id(), 1u);
  EXPECT_EQ(header.num_tokens(), 13);
  EXPECT_EQ(header.num_pages(), 4);
  EXPECT_EQ(header.config().page_size(), 4);
  EXPECT_EQ(header.num_chunks(), static_cast<int64_t>(messages.size()) - 1);
  EXPECT_GT(header.num_chunks(), 2 * config.num_layers());
  ASSERT_OK_AND_ASSIGN(attnd::v1::ImportSequenceResponse imported,
                       ImportAll(client(), "b", 9, messages));
  EXPECT_EQ(imported.sequence_id(), 9u);
  EXPECT_EQ(imported.num_tokens(), 13);
  EXPECT_EQ(imported.num_pages(), 4);
  EXPECT_EQ(ProbeLength(client(), "b", 9), 13);
  for (const int64_t rows : {1, 5, 1}) {
    const std::vector<attnd::v1::ForwardRequest> layers = Layers(rng, config, rows);
    EXPECT_EQ(Step(client(), "a", 1, layers), Step(client(), "b", 9, layers));
  }
}

TEST_F(ExportImportTest, CopyBetweenClientsAndThroughAFile) {
  std::unique_ptr<client::Client> other = NewClient();
  ASSERT_OK_AND_ASSIGN(attnd::v1::ImportSequenceResponse copied,
                       client::CopySequence(client(), "a", 1, *other, "b", 0));
  EXPECT_EQ(copied.sequence_id(), 1u);
  const std::string path = ::testing::TempDir() + "/attnd_sequence_test.seq";
  ASSERT_OK(client::ExportSequenceToFile(client(), "a", 1, path));
  ASSERT_OK_AND_ASSIGN(attnd::v1::ImportSequenceResponse loaded,
                       client::ImportSequenceFromFile(client(), "b", 2, path));
  EXPECT_EQ(loaded.num_tokens(), 13);
  const std::vector<attnd::v1::ForwardRequest> layers = Layers(rng, config, 2);
  const std::vector<std::string> expected = Step(client(), "a", 1, layers);
  EXPECT_EQ(Step(client(), "b", 1, layers), expected);
  EXPECT_EQ(Step(client(), "b", 2, layers), expected);

  // A file cut short is refused and imports nothing.
  std::string bytes;
  {
    std::ifstream in(path, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), {});
  }
  std::ofstream(path, std::ios::binary | std::ios::trunc).write(bytes.data(), bytes.size() - 100);
  absl::StatusOr<attnd::v1::ImportSequenceResponse> cut =
      client::ImportSequenceFromFile(client(), "b", 3, path);
  EXPECT_EQ(cut.status().code(), absl::StatusCode::kDataLoss) << cut.status();
  EXPECT_EQ(ProbeLength(client(), "b", 3), 0);
  std::remove(path.c_str());
}

TEST_F(ExportImportTest, CorruptChunkIsRefusedAndChangesNothing) {
  std::vector<attnd::v1::ExportSequenceResponse> messages = ExportAll(client(), "a", 1);
  ASSERT_GE(messages.size(), 3u);
  std::string& data = *messages[2].mutable_chunk()->mutable_data();
  data[data.size() / 2] ^= 0x10;
  absl::StatusOr<attnd::v1::ImportSequenceResponse> imported =
      ImportAll(client(), "b", 1, messages);
  EXPECT_EQ(imported.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(imported.status().message()), HasSubstr("crc32"));
  ExpectTargetUntouched();
}

TEST_F(ExportImportTest, TruncatedStreamIsRefusedAndChangesNothing) {
  std::vector<attnd::v1::ExportSequenceResponse> messages = ExportAll(client(), "a", 1);
  messages.pop_back();
  absl::StatusOr<attnd::v1::ImportSequenceResponse> imported =
      ImportAll(client(), "b", 1, messages);
  EXPECT_EQ(imported.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(imported.status().message()), HasSubstr("missing"));
  ExpectTargetUntouched();
  // Header only.
  messages.resize(1);
  EXPECT_EQ(ImportAll(client(), "b", 1, messages).status().code(),
            absl::StatusCode::kDataLoss);
  ExpectTargetUntouched();
}

TEST_F(ExportImportTest, MalformedStreamsAreRefusedByField) {
  const std::vector<attnd::v1::ExportSequenceResponse> good = ExportAll(client(), "a", 1);
  struct Case {
    const char* name;
    std::function<void(std::vector<attnd::v1::ExportSequenceResponse>&)> edit;
    absl::StatusCode code;
    const char* field;
  };
  const Case cases[] = {
      {"no header", [](auto& m) { m.erase(m.begin()); }, absl::StatusCode::kInvalidArgument,
       "header"},
      {"chunk repeated", [](auto& m) { m.insert(m.begin() + 2, m[1]); },
       absl::StatusCode::kInvalidArgument, "earlier chunk"},
      {"layer out of range", [](auto& m) { m[1].mutable_chunk()->set_layer(7); },
       absl::StatusCode::kInvalidArgument, ".layer"},
      {"pool unset", [](auto& m) { m[1].mutable_chunk()->set_pool(attnd::v1::KV_POOL_UNSPECIFIED); },
       absl::StatusCode::kInvalidArgument, ".pool"},
      {"pages out of range", [](auto& m) { m[1].mutable_chunk()->set_first_page(3); },
       absl::StatusCode::kInvalidArgument, "first_page"},
      {"short data",
       [](auto& m) {
         std::string& data = *m[1].mutable_chunk()->mutable_data();
         data.resize(data.size() - 2);
       },
       absl::StatusCode::kInvalidArgument, ".data"},
      {"pages disagree with tokens", [](auto& m) { m[0].mutable_header()->set_num_pages(9); },
       absl::StatusCode::kInvalidArgument, "header.num_pages"},
      {"other shape",
       [](auto& m) { m[0].mutable_header()->mutable_config()->set_layout(attnd::v1::KV_LAYOUT_HND); },
       absl::StatusCode::kFailedPrecondition, "layout"},
      {"bad config", [](auto& m) { m[0].mutable_header()->mutable_config()->set_head_dim(65); },
       absl::StatusCode::kInvalidArgument, "header.config.head_dim"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    std::vector<attnd::v1::ExportSequenceResponse> messages = good;
    c.edit(messages);
    absl::StatusOr<attnd::v1::ImportSequenceResponse> imported =
        ImportAll(client(), "b", 1, messages);
    EXPECT_EQ(imported.status().code(), c.code) << imported.status();
    EXPECT_THAT(std::string(imported.status().message()), HasSubstr(c.field));
    ExpectTargetUntouched();
  }
}

TEST_F(ExportImportTest, ImportThatDoesNotFitIsResourceExhausted) {
  ASSERT_OK(client().CreateCache("tiny", SmallConfig(3)).status());
  absl::StatusOr<attnd::v1::ImportSequenceResponse> imported =
      ImportAll(client(), "tiny", 1, ExportAll(client(), "a", 1));
  EXPECT_EQ(imported.status().code(), absl::StatusCode::kResourceExhausted);
  ASSERT_OK_AND_ASSIGN(attnd::v1::CacheInfo tiny, client().GetCache("tiny"));
  EXPECT_EQ(tiny.used_pages(), 0);
  EXPECT_EQ(tiny.num_sequences(), 0);
}

TEST_F(ExportImportTest, ExportRefusals) {
  auto code = [&](const std::string& cache, uint64_t id) {
    return client::ExportSequence(client(), cache, id,
                                  [](const auto&) { return absl::OkStatus(); })
        .code();
  };
  EXPECT_EQ(code("nope", 1), absl::StatusCode::kNotFound);
  EXPECT_EQ(code("a", 2), absl::StatusCode::kNotFound);
  ASSERT_OK_AND_ASSIGN(attnd::v1::PlanResponse open, client().Plan(MakePlan("a", {{1, 1}})));
  EXPECT_EQ(code("a", 1), absl::StatusCode::kFailedPrecondition);
  ASSERT_OK(client().EndStep(open.step_id(), true).status());
  // An export whose reader stops early unpins its pages.
  absl::Status stopped = client::ExportSequence(
      client(), "a", 1, [](const auto&) { return absl::CancelledError("enough"); });
  EXPECT_EQ(stopped.code(), absl::StatusCode::kCancelled);
  const uint64_t ids[] = {1};
  ASSERT_OK(client().FreeSequences("a", ids).status());
  // The export's pins go when its call ends (at once here, or shortly after the cancel).
  ASSERT_OK_AND_ASSIGN(attnd::v1::CacheInfo a, client().GetCache("a"));
  for (int i = 0; i < 100 && a.used_pages() != 0; ++i) {
    absl::SleepFor(absl::Milliseconds(10));
    ASSERT_OK_AND_ASSIGN(a, client().GetCache("a"));
  }
  EXPECT_EQ(a.used_pages(), 0);
  EXPECT_EQ(a.shared_pages(), 0);
}

TEST_F(SequenceTest, ForkOverGrpcSharesPagesAndAttendsLikeTheSource) {
  const attnd::v1::CacheConfig config = SmallConfig(64);
  ASSERT_OK(client().CreateCache("c", config).status());
  std::mt19937_64 rng(3);
  const std::vector<attnd::v1::ForwardRequest> prompt = Layers(rng, config, 6);
  Step(client(), "c", 1, prompt);
  ASSERT_OK_AND_ASSIGN(attnd::v1::ForkSequenceResponse forked,
                       client::ForkSequence(client(), "c", 1, 2));
  EXPECT_EQ(forked.num_tokens(), 6);
  EXPECT_EQ(forked.shared_pages(), 2);
  ASSERT_OK_AND_ASSIGN(attnd::v1::CacheInfo info, client().GetCache("c"));
  EXPECT_EQ(info.used_pages(), 2);
  EXPECT_EQ(info.shared_pages(), 2);
  EXPECT_EQ(info.num_sequences(), 2);
  // Both branches decode the same token: the same output, and each its own page now.
  const std::vector<attnd::v1::ForwardRequest> token = Layers(rng, config, 1);
  EXPECT_EQ(Step(client(), "c", 1, token), Step(client(), "c", 2, token));
  ASSERT_OK_AND_ASSIGN(info, client().GetCache("c"));
  EXPECT_EQ(info.used_pages(), 3);  // page 0 shared, each branch its own page 1
  EXPECT_EQ(info.shared_pages(), 1);
  EXPECT_EQ(client::ForkSequence(client(), "c", 1, 2).status().code(),
            absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(client::ForkSequence(client(), "c", 1, 3, 8).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace attnd::integration
