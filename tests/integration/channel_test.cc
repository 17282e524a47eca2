// Channels (DESIGN 3b) through the real server: HOST_SHM steps equal to the gRPC path byte for
// byte (in this process and with the client in another), the RPC-completed mode, what GetCache
// and GetServerInfo say, and refusals that name their field. Faults (TTL, close mid-step, a
// killed client, tenants) are in fault_test.cc.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "attnd/client/channel.h"
#include "attnd/status_macros.h"
#include "channel_steps.h"
#include "status_matchers.h"
#include "test_server.h"
#include "test_steps.h"

namespace attnd::integration {
namespace {

using Code = absl::StatusCode;
using ::testing::HasSubstr;

client::ChannelOptions HostShm(int32_t max_tokens, bool with_lse = true) {
  client::ChannelOptions options;
  options.kind = attnd::v1::CHANNEL_KIND_HOST_SHM;
  options.max_tokens = max_tokens;
  options.with_lse = with_lse;
  return options;
}

class ChannelTest : public IntegrationTest {};

TEST_F(ChannelTest, HostShmStepsMatchForwardBitwise) {
  ASSERT_OK(CompareChannelWithGrpc(client(), "same-process", attnd::v1::CHANNEL_KIND_HOST_SHM,
                                   SmallConfig(256), /*decode_steps=*/4, /*seed=*/3));
}

// Decode steps of many rows, some of whose requests' keys the decode plan splits (long
// prompts), so that the CUDA backend runs each HOST_SHM layer in parts of its rows
// (--host_shm_parts, default 2: each part's copies, append, decode slice and merges), against
// Forward's one launch, byte for byte.
TEST_F(ChannelTest, HostShmDecodeInPartsMatchesForwardBitwise) {
  std::vector<Entries> steps;
  Entries prompt;
  Entries decode;
  for (uint64_t id = 1; id <= 13; ++id) {
    // Lengths from 3 to 1100 keys: the long ones are split into chunks whose partials merge.
    prompt.push_back({id, static_cast<int32_t>(id % 4 == 0 ? 700 + 100 * id / 4 : 3 * id)});
    decode.push_back({id, 1});
  }
  decode.insert(decode.begin() + 5, {99, 0});  // a padding slot among the rows
  steps.push_back(prompt);
  for (int i = 0; i < 3; ++i) steps.push_back(decode);
  ASSERT_OK(CompareChannelStepsWithGrpc(client(), "parts", attnd::v1::CHANNEL_KIND_HOST_SHM,
                                        SmallConfig(2048), steps, /*seed=*/11,
                                        /*max_tokens=*/4096));
}

// A step planned on top of an open one (DESIGN 3b): its positions follow the open step's new
// tokens and every output equals the sequential steps' through Forward, byte for byte.
TEST_F(ChannelTest, HostShmChainedStepsMatchForwardBitwise) {
  ASSERT_OK(CompareChannelWithGrpc(client(), "chained", attnd::v1::CHANNEL_KIND_HOST_SHM,
                                   SmallConfig(256), /*decode_steps=*/4, /*seed=*/4,
                                   /*chained=*/true));
}

// Runs every layer of a channel step from random inputs.
void RunChannelStep(client::Channel& channel, const attnd::v1::PlanResponse& planned,
                    const attnd::v1::CacheConfig& config, std::mt19937_64& rng) {
  for (int32_t layer = 0; layer < config.num_layers(); ++layer) {
    ASSERT_OK(ForwardThroughChannel(channel, planned.channel_sequence(),
                                    RandomLayer(rng, config, planned.num_tokens(), layer),
                                    config, planned.num_tokens(), true)
                  .status());
  }
}

TEST_F(ChannelTest, ChainedStepsCommitInOrderAndAbortWithTheirParent) {
  const attnd::v1::CacheConfig config = SmallConfig(64);
  ASSERT_OK(client().CreateCache("c", config).status());
  ASSERT_OK_AND_ASSIGN(auto channel, client::Channel::Open(client(), "c", HostShm(16)));
  std::mt19937_64 rng(9);
  auto plan_on_channel = [&](std::vector<std::pair<uint64_t, int32_t>> entries) {
    attnd::v1::PlanRequest plan = MakePlan("c", entries);
    plan.set_channel_id(channel->id());
    return client().Plan(plan);
  };
  // A prompt, a decode step on top of it and one on top of that, planned before anything ran.
  ASSERT_OK_AND_ASSIGN(auto prompt, plan_on_channel({{1, 5}, {2, 3}}));
  ASSERT_OK_AND_ASSIGN(auto first, plan_on_channel({{1, 1}, {2, 1}}));
  ASSERT_OK_AND_ASSIGN(auto second, plan_on_channel({{1, 1}}));
  EXPECT_EQ(first.entries(0).start_position(), 5);
  EXPECT_EQ(first.entries(1).start_position(), 3);
  EXPECT_EQ(second.entries(0).start_position(), 6);
  ASSERT_OK_AND_ASSIGN(auto cache, client().GetCache("c"));
  EXPECT_EQ(cache.open_steps(), 3);
  // Only the prompt's layers run: it commits; its children stay open.
  RunChannelStep(*channel, prompt, config, rng);
  ASSERT_OK_AND_ASSIGN(auto ended, client().EndStep(prompt.step_id(), /*abort=*/false));
  EXPECT_EQ(ended.outcome(), attnd::v1::STEP_OUTCOME_COMMITTED);
  // Aborting the first decode step takes the one planned on top of it along, and rolls both
  // back to the prompt's lengths and pages.
  ASSERT_OK_AND_ASSIGN(ended, client().EndStep(first.step_id(), /*abort=*/true));
  EXPECT_EQ(ended.outcome(), attnd::v1::STEP_OUTCOME_ABORTED);
  ASSERT_OK_AND_ASSIGN(ended, client().EndStep(second.step_id(), /*abort=*/false));
  EXPECT_EQ(ended.outcome(), attnd::v1::STEP_OUTCOME_ABORTED);
  ASSERT_OK_AND_ASSIGN(cache, client().GetCache("c"));
  EXPECT_EQ(cache.open_steps(), 0);
  EXPECT_EQ(ProbeLength(client(), "c", 1), 5);
  EXPECT_EQ(ProbeLength(client(), "c", 2), 3);
  const int32_t page_size = config.page_size();
  EXPECT_EQ(cache.used_pages(), (5 + page_size - 1) / page_size + (3 + page_size - 1) / page_size);

  // Committed in order: a child that ran waits for nothing, its parent having committed first.
  ASSERT_OK_AND_ASSIGN(auto parent, plan_on_channel({{1, 1}, {2, 1}}));
  ASSERT_OK_AND_ASSIGN(auto child, plan_on_channel({{2, 1}}));
  EXPECT_EQ(child.entries(0).start_position(), 4);
  RunChannelStep(*channel, parent, config, rng);
  RunChannelStep(*channel, child, config, rng);
  ASSERT_OK_AND_ASSIGN(ended, client().EndStep(child.step_id(), /*abort=*/false));
  EXPECT_EQ(ended.outcome(), attnd::v1::STEP_OUTCOME_COMMITTED);
  ASSERT_OK_AND_ASSIGN(ended, client().EndStep(parent.step_id(), /*abort=*/false));
  EXPECT_EQ(ended.outcome(), attnd::v1::STEP_OUTCOME_COMMITTED);
  EXPECT_EQ(ProbeLength(client(), "c", 1), 6);
  EXPECT_EQ(ProbeLength(client(), "c", 2), 5);

  // A child aborted alone leaves its parent to commit.
  ASSERT_OK_AND_ASSIGN(parent, plan_on_channel({{1, 2}}));
  ASSERT_OK_AND_ASSIGN(child, plan_on_channel({{1, 1}}));
  ASSERT_OK_AND_ASSIGN(ended, client().EndStep(child.step_id(), /*abort=*/true));
  EXPECT_EQ(ended.outcome(), attnd::v1::STEP_OUTCOME_ABORTED);
  RunChannelStep(*channel, parent, config, rng);
  ASSERT_OK_AND_ASSIGN(ended, client().EndStep(parent.step_id(), /*abort=*/false));
  EXPECT_EQ(ended.outcome(), attnd::v1::STEP_OUTCOME_COMMITTED);
  EXPECT_EQ(ProbeLength(client(), "c", 1), 8);
}

TEST_F(ChannelTest, AStepChainsOnlyThroughTheSameChannel) {
  const attnd::v1::CacheConfig config = SmallConfig(64);
  ASSERT_OK(client().CreateCache("c", config).status());
  ASSERT_OK_AND_ASSIGN(auto channel, client::Channel::Open(client(), "c", HostShm(8)));
  ASSERT_OK_AND_ASSIGN(auto other, client::Channel::Open(client(), "c", HostShm(8)));
  attnd::v1::PlanRequest plan = MakePlan("c", {{1, 3}});
  plan.set_channel_id(channel->id());
  ASSERT_OK_AND_ASSIGN(auto planned, client().Plan(plan));
  attnd::v1::PlanRequest on_top = MakePlan("c", {{2, 1}, {1, 1}});
  EXPECT_ERROR(client().Plan(on_top), Code::kFailedPrecondition, "entries[1].sequence_id");
  on_top.set_channel_id(other->id());
  EXPECT_ERROR(client().Plan(on_top), Code::kFailedPrecondition, "same channel");
  ASSERT_OK_AND_ASSIGN(auto cache, client().GetCache("c"));
  EXPECT_EQ(cache.open_steps(), 1) << "a refused plan opened a step";
  EXPECT_EQ(cache.used_pages(), 1) << "a refused plan allocated pages";
  // And a plain step's sequences take no step on top.
  ASSERT_OK(client().EndStep(planned.step_id(), /*abort=*/true).status());
  ASSERT_OK_AND_ASSIGN(auto plain, client().Plan(MakePlan("c", {{3, 2}})));
  on_top = MakePlan("c", {{3, 1}});
  on_top.set_channel_id(channel->id());
  EXPECT_ERROR(client().Plan(on_top), Code::kFailedPrecondition, "end that step first");
  ASSERT_OK(client().EndStep(plain.step_id(), /*abort=*/true).status());
}

// The client program: its build path, or ATTND_CHANNEL_TEST_CLIENT (a bundle on a GPU machine).
std::string ClientProgram() {
  const char* given = std::getenv("ATTND_CHANNEL_TEST_CLIENT");
  return given != nullptr && *given != '\0' ? given : CHANNEL_TEST_CLIENT;
}

std::string RunClient(const std::string& mode, const std::string& address, int* status,
                      const std::string& extra = "") {
  const std::string command = absl::StrCat("timeout -k 5 60 ", ClientProgram(), " ", mode,
                                           " ", address, " other-process ", extra, " 2>&1");
  FILE* child = popen(command.c_str(), "r");
  if (child == nullptr) return "popen failed";
  std::string output;
  char buffer[512];
  while (std::fgets(buffer, sizeof(buffer), child) != nullptr) output += buffer;
  *status = pclose(child);
  return output;
}

// The GPU backend only: the ring in attnd's device memory, mapped by a client process on the
// same GPU, inputs and outputs bitwise equal to the gRPC path's (ATTND_TEST_BACKEND=cuda).
TEST_F(ChannelTest, CudaIpcClientInAnotherProcessMatchesForwardBitwise) {
  if (TestBackendName() != "cuda") GTEST_SKIP() << "CUDA_IPC needs the cuda backend";
  int status = -1;
  const std::string output = RunClient("compare-cuda-ipc", address(), &status);
  EXPECT_EQ(status, 0) << output;
  EXPECT_THAT(output, HasSubstr("PASS"));
}

// Issue 19, on a machine with two GPUs that attnd serves both of (the test server takes every
// visible GPU; the caches live on device 0): the client process on GPU 1.
// The cache once it has no channel and no open step, or as it is at `timeout`.
absl::StatusOr<attnd::v1::CacheInfo> WaitForNoChannelsOrSteps(client::Client& client,
                                                              const std::string& cache,
                                                              absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  for (;;) {
    ASSIGN_OR_RETURN(attnd::v1::CacheInfo info, client.GetCache(cache));
    if ((info.channels_size() == 0 && info.open_steps() == 0) || absl::Now() >= deadline) {
      return info;
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
}

bool TwoGpusServed(client::Client& client) {
  const absl::StatusOr<attnd::v1::GetServerInfoResponse> info = client.GetServerInfo();
  return TestBackendName() == "cuda" && info.ok() && info->devices_size() >= 2;
}

// The ring in GPU 0's memory, mapped by a client on GPU 1 with peer access (its kernels write
// over NVLink or PCIe): bitwise the gRPC path.
TEST_F(ChannelTest, CudaIpcClientOnAPeerGpuMatchesForwardBitwise) {
  if (!TwoGpusServed(client())) GTEST_SKIP() << "needs the cuda backend on two GPUs";
  int status = -1;
  const std::string output =
      RunClient("compare-cuda-ipc", address(), &status, "--client_device=1");
  EXPECT_EQ(status, 0) << output;
  EXPECT_THAT(output, HasSubstr("PASS"));
}

// An NCCL channel: attnd rank 0 on GPU 0, the client process rank 1 on GPU 1; q/k/v sent and
// o/lse received per layer: bitwise the gRPC path, plain and chained steps.
TEST_F(ChannelTest, NcclClientOnAnotherGpuMatchesForwardBitwise) {
  if (!TwoGpusServed(client())) GTEST_SKIP() << "needs the cuda backend on two GPUs";
  ASSERT_OK_AND_ASSIGN(auto info, client().GetServerInfo());
  if (std::find(info.extensions().begin(), info.extensions().end(), "channel_nccl") ==
      info.extensions().end()) {
    GTEST_SKIP() << "libnccl.so.2 does not load here (GetServerInfo lists no channel_nccl)";
  }
  int status = -1;
  const std::string output = RunClient("compare-nccl", address(), &status, "--client_device=1");
  EXPECT_EQ(status, 0) << output;
  EXPECT_THAT(output, HasSubstr("PASS"));
}

// A CUDA_IPC client killed between two layers of a step (on attnd's GPU, and on GPU 1 where
// attnd serves two), and an NCCL client on GPU 1 killed the same way (attnd's NCCL kernels are
// then waiting for a peer that is gone): attnd closes the channel when the client's connection
// drops, rolls the step back (the new sequence and its pages are gone, no step stays open) and
// serves on: a committed sequence keeps its length and a HOST_SHM channel step still equals
// the gRPC path bitwise.
TEST_F(ChannelTest, CudaClientsKilledMidStepLeaveAttndServing) {
  if (TestBackendName() != "cuda") GTEST_SKIP() << "CUDA_IPC and NCCL need the cuda backend";
  ASSERT_OK_AND_ASSIGN(auto info, client().GetServerInfo());
  // (mode, client device): -1 is the client's current GPU, attnd's device 0.
  std::vector<std::pair<std::string, int32_t>> modes = {{"hang-cuda-ipc", -1}};
  if (TwoGpusServed(client())) {
    modes.emplace_back("hang-cuda-ipc", 1);
    if (std::find(info.extensions().begin(), info.extensions().end(), "channel_nccl") !=
        info.extensions().end()) {
      modes.emplace_back("hang-nccl", 1);
    }
  }
  const attnd::v1::CacheConfig config = SmallConfig(256);
  std::mt19937_64 rng(21);
  for (const auto& [mode, client_device] : modes) {
    SCOPED_TRACE(absl::StrCat(mode, " from GPU ", client_device));
    const std::string cache = absl::StrCat("killed-", mode, client_device < 0 ? "" : "-peer");
    ASSERT_OK(client().CreateCache(cache, config, /*device=*/0).status());
    // A committed sequence (id 3, 5 tokens) beside the step the client will leave behind.
    ASSERT_OK_AND_ASSIGN(auto step, client().BeginStep(MakePlan(cache, {{3, 5}})));
    for (int32_t layer = 0; layer < config.num_layers(); ++layer) {
      ASSERT_OK(step->Forward(RandomLayer(rng, config, 5, layer)).status());
    }
    const std::string command =
        absl::StrCat("exec timeout -k 5 120 ", ClientProgram(), " ", mode, " ", address(), " ",
                     cache, client_device < 0 ? "" : absl::StrCat(" --client_device=", client_device));
    FILE* child = popen(command.c_str(), "r");
    ASSERT_NE(child, nullptr);
    char line[512] = {};
    const bool printed = std::fgets(line, sizeof(line), child) != nullptr;
    if (!printed || !absl::StrContains(line, "hanging")) {
      pclose(child);
      FAIL() << "the client did not reach the middle of its step: " << line;
    }
    ASSERT_OK_AND_ASSIGN(auto mid, client().GetCache(cache));
    EXPECT_EQ(mid.channels_size(), 1);
    EXPECT_EQ(mid.open_steps(), 1);
    // "[h]ang-...": the pattern does not match the shell that runs pkill.
    std::system(absl::StrCat("pkill -KILL -f '[", mode.substr(0, 1), "]", mode.substr(1), " .* ",
                             cache, "( |$)' >/dev/null 2>&1")
                    .c_str());
    pclose(child);
    // attnd sees the connection go: the channel closes, the step rolls back.
    ASSERT_OK_AND_ASSIGN(const attnd::v1::CacheInfo after,
                         WaitForNoChannelsOrSteps(client(), cache, absl::Seconds(30)));
    EXPECT_EQ(after.channels_size(), 0);
    EXPECT_EQ(after.open_steps(), 0);
    EXPECT_EQ(after.num_sequences(), 1);
    EXPECT_EQ(after.used_pages(), 2);  // sequence 3's 5 tokens in 4-token pages
    EXPECT_EQ(ProbeLength(client(), cache, 3), 5);
    EXPECT_EQ(ProbeLength(client(), cache, 7), 0);
    ASSERT_OK(client().DeleteCache(cache));
  }
  // Still serving: health and info answer, and a channel step runs bitwise as before.
  ASSERT_OK(client().GetServerInfo().status());
  ASSERT_OK(CompareChannelWithGrpc(client(), "after-kills", attnd::v1::CHANNEL_KIND_HOST_SHM,
                                   config, /*decode_steps=*/2, /*seed=*/22));
}

// An NCCL client on another GPU that joined and planned a step but sends nothing, and stays
// alive: attnd's receive of layer 0 waits for it (on the device, or on the host inside NCCL's
// set-up of the connection's first use, holding the communicator). Aborting the step must
// still break the channel at once (the communicator aborted from under that wait), roll the
// step back, and leave attnd serving.
TEST_F(ChannelTest, AbortingAStepOfASilentNcclClientClosesTheChannel) {
  ASSERT_OK_AND_ASSIGN(auto info, client().GetServerInfo());
  if (!TwoGpusServed(client()) ||
      std::find(info.extensions().begin(), info.extensions().end(), "channel_nccl") ==
          info.extensions().end()) {
    GTEST_SKIP() << "needs NCCL channels and the cuda backend on two GPUs";
  }
  const attnd::v1::CacheConfig config = SmallConfig(256);
  const std::string cache = "silent-nccl";
  ASSERT_OK(client().CreateCache(cache, config, /*device=*/0).status());
  const std::string command =
      absl::StrCat("exec timeout -k 5 120 ", ClientProgram(), " idle-nccl ", address(), " ", cache,
                   " --client_device=1");
  FILE* child = popen(command.c_str(), "r");
  ASSERT_NE(child, nullptr);
  char line[512] = {};
  const bool printed = std::fgets(line, sizeof(line), child) != nullptr;
  unsigned long long channel_id = 0, step_id = 0;
  if (!printed || std::sscanf(line, "idle %llu %llu", &channel_id, &step_id) != 2) {
    pclose(child);
    FAIL() << "the client did not plan its step: " << line;
  }
  absl::SleepFor(absl::Milliseconds(500));  // attnd's enqueuer reaches layer 0's receive
  const absl::Time aborted = absl::Now();
  ASSERT_OK_AND_ASSIGN(auto ended, client().EndStep(step_id, /*abort=*/true));
  EXPECT_EQ(ended.outcome(), attnd::v1::STEP_OUTCOME_ABORTED) << ended.ShortDebugString();
  ASSERT_OK_AND_ASSIGN(const attnd::v1::CacheInfo after,
                       WaitForNoChannelsOrSteps(client(), cache, absl::Seconds(20)));
  EXPECT_EQ(after.channels_size(), 0);
  EXPECT_EQ(after.open_steps(), 0);
  EXPECT_EQ(after.used_pages(), 0);
  EXPECT_LT(absl::Now() - aborted, absl::Seconds(10));
  std::system("pkill -KILL -f '[i]dle-nccl .* silent-nccl( |$)' >/dev/null 2>&1");
  pclose(child);
  ASSERT_OK(client().DeleteCache(cache));
  ASSERT_OK(CompareChannelWithGrpc(client(), "after-silent", attnd::v1::CHANNEL_KIND_HOST_SHM,
                                   config, /*decode_steps=*/1, /*seed=*/24));
}

// Issue 17 through a channel, from another process (a CUDA_IPC ring cannot be mapped by the
// process that made it, so sequence_channel_test's in-process cases are HOST_SHM): a sequence
// exported and imported through CUDA_IPC (cuda backend) and HOST_SHM rings, bitwise the gRPC
// path.
TEST_F(ChannelTest, SequenceTransfersInAnotherProcessMatchTheGrpcPathBitwise) {
  std::vector<std::string> modes = {"transfer-host-shm"};
  if (TestBackendName() == "cuda") modes.push_back("transfer-cuda-ipc");
  for (const std::string& mode : modes) {
    int status = -1;
    const std::string output = RunClient(mode, address(), &status);
    EXPECT_EQ(status, 0) << mode << ": " << output;
    EXPECT_THAT(output, HasSubstr("PASS")) << mode;
  }
}

TEST_F(ChannelTest, ClientInAnotherProcessMatchesForwardBitwise) {
  int status = -1;
  const std::string output = RunClient("compare", address(), &status);
  EXPECT_EQ(status, 0) << output;
  EXPECT_THAT(output, HasSubstr("PASS"));
}

TEST_F(ChannelTest, ForwardWithUseChannelRunsTheLayerFromTheSlot) {
  const attnd::v1::CacheConfig config = SmallConfig(64);
  ASSERT_OK(client().CreateCache("grpc", config).status());
  ASSERT_OK(client().CreateCache("chan", config).status());
  ASSERT_OK_AND_ASSIGN(auto channel, client::Channel::Open(client(), "chan", HostShm(8)));
  ASSERT_OK_AND_ASSIGN(auto grpc_plan, client().Plan(MakePlan("grpc", {{1, 3}})));
  attnd::v1::PlanRequest request = MakePlan("chan", {{1, 3}});
  request.set_channel_id(channel->id());
  ASSERT_OK_AND_ASSIGN(auto channel_plan, client().Plan(request));
  std::mt19937_64 rng(7);
  for (int32_t layer = 0; layer < config.num_layers(); ++layer) {
    attnd::v1::ForwardRequest inputs = RandomLayer(rng, config, 3, layer);
    inputs.set_step_id(grpc_plan.step_id());
    ASSERT_OK_AND_ASSIGN(auto expected, client().Forward(inputs));
    // The inputs go into the slot; the Forward carries no tensor and sets ready itself.
    const client::ChannelSlot slot = channel->Slot(layer);
    ASSERT_OK(channel->CopyIn(slot.q, inputs.q().data().data(), inputs.q().data().size()));
    ASSERT_OK(channel->CopyIn(slot.k, inputs.k().data().data(), inputs.k().data().size()));
    ASSERT_OK(channel->CopyIn(slot.v, inputs.v().data().data(), inputs.v().data().size()));
    attnd::v1::ForwardRequest through;
    through.set_step_id(channel_plan.step_id());
    through.set_layer(layer);
    through.set_use_channel(true);
    ASSERT_OK_AND_ASSIGN(auto answered, client().Forward(through));
    EXPECT_FALSE(answered.has_o()) << "o stays in the slot";
    EXPECT_EQ(answered.step_committed(), layer + 1 == config.num_layers());
    ASSERT_OK(channel->WaitDone(layer, channel_plan.channel_sequence(), absl::Seconds(1)));
    std::string o(expected.o().data().size(), '\0');
    ASSERT_OK(channel->CopyOut(o.data(), slot.o, o.size()));
    EXPECT_EQ(o, expected.o().data()) << "layer " << layer;
    std::string lse(expected.lse().data().size(), '\0');
    ASSERT_OK(channel->CopyOut(lse.data(), slot.lse, lse.size()));
    EXPECT_EQ(lse, expected.lse().data());
    // A second Forward of the same layer finds it done (or, after the last, the step).
    EXPECT_ERROR(client().Forward(through), Code::kFailedPrecondition,
                 layer + 1 == config.num_layers() ? "step_id" : "layer");
  }
}

TEST_F(ChannelTest, GetCacheListsTheChannelAndServerInfoTheKind) {
  ASSERT_OK(client().CreateCache("c", SmallConfig(64)).status());
  ASSERT_OK_AND_ASSIGN(auto info, client().GetServerInfo());
  EXPECT_THAT(info.extensions(), ::testing::Contains("channel_host_shm"));
  EXPECT_GT(info.limits().max_channel_bytes(), 0);
  ASSERT_OK_AND_ASSIGN(auto channel, client::Channel::Open(client(), "c", HostShm(16)));
  const attnd::v1::ChannelInfo& opened = channel->info();
  EXPECT_GT(opened.channel_id(), 0u);
  EXPECT_EQ(opened.cache(), "c");
  EXPECT_EQ(opened.slots(), 2);  // the default
  EXPECT_THAT(opened.shm_name(), HasSubstr("attnd-"));
  const attnd::v1::ChannelLayout& layout = opened.layout();
  ASSERT_EQ(layout.ready_offsets_size(), 2);
  ASSERT_EQ(layout.done_offsets_size(), 2);
  ASSERT_EQ(layout.slots_size(), 2);
  // bf16, 4 query / 2 KV heads of 64: rows of 512 and 256 bytes; lse 16.
  EXPECT_EQ(layout.q_row_bytes(), 512);
  EXPECT_EQ(layout.k_row_bytes(), 256);
  EXPECT_EQ(layout.o_row_bytes(), 512);
  EXPECT_EQ(layout.lse_row_bytes(), 16);
  EXPECT_EQ(layout.slots(1).q_offset() % 256, 0);
  EXPECT_LE(layout.slots(1).lse_offset() + 16 * 16, layout.ring_bytes());
  ASSERT_OK_AND_ASSIGN(auto cache, client().GetCache("c"));
  ASSERT_EQ(cache.channels_size(), 1);
  EXPECT_EQ(cache.channels(0).channel_id(), opened.channel_id());
  EXPECT_EQ(cache.channels(0).kind(), attnd::v1::CHANNEL_KIND_HOST_SHM);
  // Closing the client's Channel object closes the channel on the server.
  channel.reset();
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (absl::Now() < deadline) {
    ASSERT_OK_AND_ASSIGN(cache, client().GetCache("c"));
    if (cache.channels_size() == 0) break;
    absl::SleepFor(absl::Milliseconds(5));
  }
  EXPECT_EQ(cache.channels_size(), 0);
}

TEST_F(ChannelTest, BadOpensAreRefusedByField) {
  ASSERT_OK(client().CreateCache("c", SmallConfig(64)).status());
  EXPECT_ERROR(client::Channel::Open(client(), "c", HostShm(0)), Code::kInvalidArgument,
               "max_tokens");
  EXPECT_ERROR(client::Channel::Open(client(), "c", HostShm(1 << 30)), Code::kInvalidArgument,
               "max_tokens");
  client::ChannelOptions slots = HostShm(8);
  slots.slots = 3;  // the cache has 2 layers
  EXPECT_ERROR(client::Channel::Open(client(), "c", slots), Code::kInvalidArgument, "slots");
  slots.slots = -1;
  EXPECT_ERROR(client::Channel::Open(client(), "c", slots), Code::kInvalidArgument, "slots");
  client::ChannelOptions kind = HostShm(8);
  kind.kind = attnd::v1::CHANNEL_KIND_UNSPECIFIED;
  EXPECT_ERROR(client::Channel::Open(client(), "c", kind), Code::kInvalidArgument, "kind");
  kind.kind = static_cast<attnd::v1::ChannelKind>(77);
  EXPECT_ERROR(client::Channel::Open(client(), "c", kind), Code::kInvalidArgument, "kind");
  EXPECT_ERROR(client::Channel::Open(client(), "missing", HostShm(8)), Code::kNotFound, "cache");
  if (TestBackendName() == "cpu") {
    client::ChannelOptions ipc = HostShm(8);
    ipc.kind = attnd::v1::CHANNEL_KIND_CUDA_IPC;
    EXPECT_ERROR(client::Channel::Open(client(), "c", ipc), Code::kUnimplemented, "kind");
  }
  ASSERT_OK_AND_ASSIGN(auto cache, client().GetCache("c"));
  EXPECT_EQ(cache.channels_size(), 0) << "a refused open left a channel behind";
}

// OpenChannel through the stub, for fields the client library fills itself: the first
// message's channel, or the call's status when the open was refused.
absl::StatusOr<attnd::v1::ChannelInfo> OpenRaw(client::Client& client,
                                               const attnd::v1::OpenChannelRequest& request) {
  std::unique_ptr<grpc::ClientContext> context = client.NewContext(/*with_deadline=*/false);
  auto reader = client.stub().OpenChannel(context.get(), request);
  attnd::v1::OpenChannelResponse first;
  if (reader->Read(&first)) {
    context->TryCancel();  // closes the channel
    while (reader->Read(&first)) {
    }
    reader->Finish().error_code();
    return first.channel();
  }
  const grpc::Status status = reader->Finish();
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
}

TEST_F(ChannelTest, NcclChannelsAreRefusedWhereTheyCannotRun) {
  ASSERT_OK(client().CreateCache("c", SmallConfig(64)).status());
  ASSERT_OK_AND_ASSIGN(auto info, client().GetServerInfo());
  const bool listed = std::find(info.extensions().begin(), info.extensions().end(),
                                "channel_nccl") != info.extensions().end();
  attnd::v1::OpenChannelRequest request;
  request.set_cache("c");
  request.set_kind(attnd::v1::CHANNEL_KIND_NCCL);
  request.set_max_tokens(8);
  if (TestBackendName() == "cpu") {
    EXPECT_FALSE(listed) << "the cpu backend has no NCCL channels";
    EXPECT_ERROR(OpenRaw(client(), request), Code::kUnimplemented, "kind: NCCL");
  } else if (!listed) {
    EXPECT_ERROR(OpenRaw(client(), request), Code::kFailedPrecondition,
                 "NCCL is not available: libnccl.so.2 did not load");
  } else {
    GTEST_SKIP() << "libnccl.so.2 loads here: docs/issue19-device-plan.md runs NCCL channels";
  }
  ASSERT_OK_AND_ASSIGN(auto cache, client().GetCache("c"));
  EXPECT_EQ(cache.channels_size(), 0) << "a refused open left a channel behind";
}

// The client library refuses an NCCL channel it cannot drive before asking attnd for one: a
// build without CUDA, or no loadable libnccl.so.2. Where it can, the open reaches attnd, and
// the cpu backend's refusal comes back as is.
TEST_F(ChannelTest, TheClientRefusesNcclChannelsItCannotDrive) {
  if (TestBackendName() != "cpu") {
    GTEST_SKIP() << "on the cuda backend an in-process client would join from attnd's own GPU; "
                    "NcclClientOnAnotherGpuMatchesForwardBitwise runs NCCL channels";
  }
  ASSERT_OK(client().CreateCache("c", SmallConfig(64)).status());
  client::ChannelOptions options;
  options.kind = attnd::v1::CHANNEL_KIND_NCCL;
  options.max_tokens = 8;
  const absl::Status status = client::Channel::Open(client(), "c", options).status();
  const std::string message(status.message());
  if (message.find("client built with CUDA") != std::string::npos) {
    EXPECT_EQ(status.code(), Code::kUnimplemented) << status;
  } else if (message.find("NCCL is not available") != std::string::npos) {
    EXPECT_EQ(status.code(), Code::kFailedPrecondition) << status;
    EXPECT_THAT(message, HasSubstr("libnccl.so.2 did not load"));
  } else {
    // libnccl.so.2 loads in this client: attnd (the cpu backend) answered.
    EXPECT_EQ(status.code(), Code::kUnimplemented) << status;
    EXPECT_THAT(message, HasSubstr("kind: NCCL"));
  }
}

TEST_F(ChannelTest, TheClientsBusIdIsCheckedAndOnlyCudaIpcUsesIt) {
  ASSERT_OK(client().CreateCache("c", SmallConfig(64)).status());
  attnd::v1::OpenChannelRequest request;
  request.set_cache("c");
  request.set_kind(attnd::v1::CHANNEL_KIND_HOST_SHM);
  request.set_max_tokens(8);
  request.set_client_pci_bus_id("not a bus id");
  EXPECT_ERROR(OpenRaw(client(), request), Code::kInvalidArgument, "client_pci_bus_id");
  // HOST_SHM ignores a well-formed one (nothing is checked: peer_access stays false).
  request.set_client_pci_bus_id("0000:3b:00.0");
  ASSERT_OK_AND_ASSIGN(auto opened, OpenRaw(client(), request));
  EXPECT_FALSE(opened.peer_access());
  if (TestBackendName() == "cpu") {
    // The cpu backend has no CUDA_IPC at all: the kind is refused before any bus id matters.
    request.set_kind(attnd::v1::CHANNEL_KIND_CUDA_IPC);
    EXPECT_ERROR(OpenRaw(client(), request), Code::kUnimplemented, "kind");
  } else {
    // A GPU no host has: attnd cannot see it, so it cannot reach the ring.
    request.set_kind(attnd::v1::CHANNEL_KIND_CUDA_IPC);
    request.set_client_pci_bus_id("ffff:ff:1f.7");
    EXPECT_ERROR(OpenRaw(client(), request), Code::kFailedPrecondition, "client_pci_bus_id");
  }
}

TEST_F(ChannelTest, PlanChecksTheChannel) {
  ASSERT_OK(client().CreateCache("c", SmallConfig(64)).status());
  ASSERT_OK(client().CreateCache("other", SmallConfig(64)).status());
  ASSERT_OK_AND_ASSIGN(auto channel, client::Channel::Open(client(), "c", HostShm(4, false)));
  attnd::v1::PlanRequest plan = MakePlan("c", {{1, 2}}, /*return_lse=*/false);
  plan.set_channel_id(channel->id() + 1000);
  EXPECT_ERROR(client().Plan(plan), Code::kNotFound, "channel_id");
  plan.set_channel_id(channel->id());
  plan.set_cache("other");
  EXPECT_ERROR(client().Plan(plan), Code::kInvalidArgument, "channel_id");
  plan = MakePlan("c", {{1, 3}, {2, 2}}, false);
  plan.set_channel_id(channel->id());
  EXPECT_ERROR(client().Plan(plan), Code::kInvalidArgument, "max_tokens");
  plan = MakePlan("c", {{1, 2}}, /*return_lse=*/true);
  plan.set_channel_id(channel->id());
  EXPECT_ERROR(client().Plan(plan), Code::kInvalidArgument, "return_lse");
  ASSERT_OK_AND_ASSIGN(auto cache, client().GetCache("c"));
  EXPECT_EQ(cache.open_steps(), 0);
  EXPECT_EQ(cache.used_pages(), 0) << "a refused plan allocated pages";

  // A step on the channel takes no tensors through Forward, and a plain step no use_channel.
  plan = MakePlan("c", {{1, 2}}, false);
  plan.set_channel_id(channel->id());
  ASSERT_OK_AND_ASSIGN(auto planned, client().Plan(plan));
  std::mt19937_64 rng(1);
  attnd::v1::ForwardRequest layer = RandomLayer(rng, SmallConfig(64), 2, 0);
  layer.set_step_id(planned.step_id());
  EXPECT_ERROR(client().Forward(layer), Code::kInvalidArgument, "channel");
  layer.set_use_channel(true);
  EXPECT_ERROR(client().Forward(layer), Code::kInvalidArgument, "use_channel");
  ASSERT_OK(client().EndStep(planned.step_id(), /*abort=*/true).status());
  ASSERT_OK_AND_ASSIGN(auto plain, client().Plan(MakePlan("c", {{1, 2}}, false)));
  attnd::v1::ForwardRequest through;
  through.set_step_id(plain.step_id());
  through.set_use_channel(true);
  EXPECT_ERROR(client().Forward(through), Code::kInvalidArgument, "use_channel");
  ASSERT_OK(client().EndStep(plain.step_id(), /*abort=*/true).status());
}

TEST_F(ChannelTest, CommitBeforeTheLayersAreSignalledIsRefusedAndChangesNothing) {
  const attnd::v1::CacheConfig config = SmallConfig(64);
  ASSERT_OK(client().CreateCache("c", config).status());
  ASSERT_OK_AND_ASSIGN(auto channel, client::Channel::Open(client(), "c", HostShm(8)));
  attnd::v1::PlanRequest plan = MakePlan("c", {{1, 3}});
  plan.set_channel_id(channel->id());
  ASSERT_OK_AND_ASSIGN(auto planned, client().Plan(plan));
  // No ready word set: a commit now would never see its layers; it is refused at once.
  EXPECT_ERROR(client().EndStep(planned.step_id(), /*abort=*/false), Code::kFailedPrecondition,
               "step_id");
  // Once every layer was signalled, a commit waits for them and reports COMMITTED.
  std::mt19937_64 rng(3);
  for (int32_t layer = 0; layer < config.num_layers(); ++layer) {
    ASSERT_OK(ForwardThroughChannel(*channel, planned.channel_sequence(),
                                    RandomLayer(rng, config, 3, layer), config, 3, true)
                  .status());
  }
  ASSERT_OK_AND_ASSIGN(auto ended, client().EndStep(planned.step_id(), /*abort=*/false));
  EXPECT_EQ(ended.outcome(), attnd::v1::STEP_OUTCOME_COMMITTED);
  EXPECT_EQ(ended.layers_run(), config.num_layers());
  EXPECT_EQ(ProbeLength(client(), "c", 1), 3);
}

class NcclJoinTimeoutTest : public IntegrationTest {
 protected:
  ServerOptions Options() const override {
    ServerOptions options = TestServerOptions();
    options.nccl_init_timeout = absl::Seconds(2);
    return options;
  }
};

// An NCCL channel whose client never joins the communicator: attnd gives up after
// --nccl_init_timeout, closes the channel with the reason in the OpenChannel call's last
// message, and serves on. attnd's rank alone needs no second GPU, so this runs wherever NCCL
// loads on the cuda backend.
TEST_F(NcclJoinTimeoutTest, APeerThatNeverJoinsClosesTheChannelAtTheTimeout) {
  ASSERT_OK_AND_ASSIGN(auto info, client().GetServerInfo());
  if (std::find(info.extensions().begin(), info.extensions().end(), "channel_nccl") ==
      info.extensions().end()) {
    GTEST_SKIP() << "no NCCL channels here (cpu backend, or libnccl.so.2 did not load)";
  }
  ASSERT_OK(client().CreateCache("c", SmallConfig(64)).status());
  attnd::v1::OpenChannelRequest request;
  request.set_cache("c");
  request.set_kind(attnd::v1::CHANNEL_KIND_NCCL);
  request.set_max_tokens(8);
  std::unique_ptr<grpc::ClientContext> context = client().NewContext(/*with_deadline=*/false);
  context->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  auto reader = client().stub().OpenChannel(context.get(), request);
  attnd::v1::OpenChannelResponse message;
  ASSERT_TRUE(reader->Read(&message));
  EXPECT_EQ(message.channel().nccl_unique_id().size(), 128u);
  const absl::Time opened = absl::Now();
  std::string closed;
  while (reader->Read(&message)) {
    if (!message.closed().empty()) closed = message.closed();
  }
  const absl::Duration waited = absl::Now() - opened;
  reader->Finish();
  EXPECT_THAT(closed, HasSubstr("did not join"));
  EXPECT_GE(waited, absl::Milliseconds(1500));
  EXPECT_LT(waited, absl::Seconds(20));
  ASSERT_OK_AND_ASSIGN(auto cache, client().GetCache("c"));
  EXPECT_EQ(cache.channels_size(), 0);
  // Still serving: a HOST_SHM channel step bitwise the gRPC path.
  ASSERT_OK(CompareChannelWithGrpc(client(), "after-timeout", attnd::v1::CHANNEL_KIND_HOST_SHM,
                                   SmallConfig(256), /*decode_steps=*/1, /*seed=*/23));
}

class ChannelBudgetTest : public IntegrationTest {
 protected:
  ServerOptions Options() const override {
    ServerOptions options = TestServerOptions();
    options.limits.max_channel_bytes = 1 << 20;
    return options;
  }
};

TEST_F(ChannelBudgetTest, RingsBeyondTheBudgetAreRefused) {
  ASSERT_OK(client().CreateCache("c", SmallConfig(64)).status());
  // 2 slots x 600 tokens x (512 + 256 + 256 + 512 + 16) bytes: about 1.8 MiB > 1 MiB.
  EXPECT_ERROR(client::Channel::Open(client(), "c", HostShm(600)), Code::kResourceExhausted,
               "max_channel_bytes");
  ASSERT_OK_AND_ASSIGN(auto first, client::Channel::Open(client(), "c", HostShm(200)));
  EXPECT_ERROR(client::Channel::Open(client(), "c", HostShm(200)), Code::kResourceExhausted,
               "max_channel_bytes");
  // Closing one gives its bytes back.
  first.reset();
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  absl::StatusOr<std::unique_ptr<client::Channel>> second;
  do {
    second = client::Channel::Open(client(), "c", HostShm(200));
    if (second.ok()) break;
    absl::SleepFor(absl::Milliseconds(20));
  } while (absl::Now() < deadline);
  EXPECT_OK(second.status());
}

}  // namespace
}  // namespace attnd::integration
