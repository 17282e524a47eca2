// A client process for the channel tests (channel_test.cc), so attnd and the client that maps
// the ring are different processes, as in deployment:
//   channel_test_client compare HOST:PORT PREFIX   runs CompareChannelWithGrpc (HOST_SHM); PASS
//   channel_test_client compare-cuda-ipc HOST:PORT PREFIX   the same over CUDA_IPC, then again
//                                                  with chained steps (PREFIX-chained)
//   channel_test_client compare-nccl HOST:PORT PREFIX   the same over NCCL (needs a GPU other
//                                                  than attnd's: --client_device)
//   channel_test_client hang HOST:PORT CACHE       opens a HOST_SHM channel, plans a 3-token step
//                                                  of sequence 7, runs layer 0, prints
//                                                  "hanging <channel id> <step id>" and waits to
//                                                  be killed
//   channel_test_client hang-cuda-ipc|hang-nccl HOST:PORT CACHE   the same through a CUDA_IPC
//                                                  or NCCL channel (with --client_device: from
//                                                  that GPU)
//   channel_test_client transfer-host-shm|transfer-cuda-ipc HOST:PORT PREFIX
//                                                  a sequence exported and imported through a
//                                                  channel, bitwise the gRPC path
//                                                  (CompareTransferWithGrpc); PASS
// --client_device=N (after the mode's arguments): CUDA_IPC and NCCL channels are opened from
// this process's GPU N (ChannelOptions::cuda_device): the peer-GPU case when N is not attnd's.
#include <unistd.h>

#include <cstdio>
#include <optional>
#include <random>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "attnd/client/channel.h"
#include "attnd/client/client.h"
#include "channel_steps.h"
#include "test_steps.h"

namespace {

int Fail(const std::string& what) {
  std::printf("FAIL %s\n", what.c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace attnd;
  int32_t client_device = -1;
  constexpr absl::string_view kDeviceFlag = "--client_device=";
  const bool usage_ok =
      argc == 4 || (argc == 5 && absl::StartsWith(argv[4], kDeviceFlag) &&
                    absl::SimpleAtoi(absl::string_view(argv[4]).substr(kDeviceFlag.size()),
                                     &client_device));
  if (!usage_ok) {
    std::fprintf(stderr,
                 "usage: %s compare|compare-cuda-ipc|compare-nccl|hang|hang-cuda-ipc|hang-nccl|"
                 "transfer-host-shm|transfer-cuda-ipc "
                 "HOST:PORT NAME "
                 "[--client_device=N]\n",
                 argv[0]);
    return 2;
  }
  const std::string mode = argv[1];
  client::ClientOptions options;
  options.address = argv[2];
  auto connected = client::Client::Connect(options);
  if (!connected.ok()) return Fail(connected.status().ToString());
  client::Client& client = **connected;
  const attnd::v1::CacheConfig config = integration::SmallConfig(256);
  if (mode == "compare" || mode == "compare-cuda-ipc" || mode == "compare-nccl") {
    attnd::v1::ChannelKind kind = attnd::v1::CHANNEL_KIND_HOST_SHM;
    if (mode == "compare-cuda-ipc") kind = attnd::v1::CHANNEL_KIND_CUDA_IPC;
    if (mode == "compare-nccl") kind = attnd::v1::CHANNEL_KIND_NCCL;
    // A client on a GPU of its own (--client_device) works on caches on attnd's device 0 (the
    // tests' daemon serves every GPU; the peer case needs the cache on another GPU than the
    // client's).
    const std::optional<int32_t> cache_device =
        client_device > 0 ? std::optional<int32_t>(0) : std::nullopt;
    const absl::Status status = integration::CompareChannelWithGrpc(
        client, argv[3], kind, config, /*decode_steps=*/6, 11, /*chained=*/false, client_device,
        cache_device);
    if (!status.ok()) return Fail(status.ToString());
    if (mode != "compare") {
      const absl::Status chained = integration::CompareChannelWithGrpc(
          client, std::string(argv[3]) + "-chained", kind, config, /*decode_steps=*/6, 12,
          /*chained=*/true, client_device, cache_device);
      if (!chained.ok()) return Fail("chained: " + chained.ToString());
    }
    std::printf("PASS\n");
    return 0;
  }
  if (mode == "transfer-host-shm" || mode == "transfer-cuda-ipc") {
    const absl::Status status = integration::CompareTransferWithGrpc(
        client, argv[3],
        mode == "transfer-cuda-ipc" ? attnd::v1::CHANNEL_KIND_CUDA_IPC
                                    : attnd::v1::CHANNEL_KIND_HOST_SHM);
    if (!status.ok()) return Fail(status.ToString());
    std::printf("PASS\n");
    return 0;
  }
  // hang*: runs layer 0 of a planned step, then stays alive in the middle of it. idle-nccl:
  // joins an NCCL channel and plans a step, then sends nothing and stays alive (attnd's
  // receive of layer 0 waits for a peer that is there but silent).
  const bool idle = mode == "idle-nccl";
  if (mode == "hang" || mode == "hang-cuda-ipc" || mode == "hang-nccl" || idle) {
    client::ChannelOptions channel_options;
    channel_options.max_tokens = 8;
    channel_options.with_lse = true;
    if (mode == "hang-cuda-ipc") channel_options.kind = attnd::v1::CHANNEL_KIND_CUDA_IPC;
    if (mode == "hang-nccl" || idle) channel_options.kind = attnd::v1::CHANNEL_KIND_NCCL;
    channel_options.cuda_device = client_device;
    auto channel = client::Channel::Open(client, argv[3], channel_options);
    if (!channel.ok()) return Fail(channel.status().ToString());
    attnd::v1::PlanRequest request = integration::MakePlan(argv[3], {{7, 3}}, true);
    request.set_channel_id((*channel)->id());
    auto plan = client.Plan(request);
    if (!plan.ok()) return Fail(plan.status().ToString());
    if (!idle) {
      std::mt19937_64 rng(5);
      auto layer = integration::ForwardThroughChannel(
          **channel, plan->channel_sequence(), integration::RandomLayer(rng, config, 3, 0),
          config, 3, true);
      if (!layer.ok()) return Fail(layer.status().ToString());
    }
    std::printf("%s %llu %llu\n", idle ? "idle" : "hanging",
                static_cast<unsigned long long>((*channel)->id()),
                static_cast<unsigned long long>(plan->step_id()));
    std::fflush(stdout);
    for (;;) pause();
  }
  return Fail("unknown mode " + mode);
}
