// Running a step's layers through a channel from the test side: the layer's tensors copied
// into its slot, ready set, done awaited (NCCL: sent and o received on the default stream), o
// and lse read back into a ForwardResponse of the same shape the gRPC path answers with, so the
// two paths can be compared byte for byte.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "attnd/client/channel.h"
#include "attnd/v1/attnd.pb.h"

namespace attnd::integration {

// Runs `layer` of the channel step with `sequence` from `request`'s tensors (MHA q/k/v).
absl::StatusOr<attnd::v1::ForwardResponse> ForwardThroughChannel(
    client::Channel& channel, uint32_t sequence, const attnd::v1::ForwardRequest& request,
    const attnd::v1::CacheConfig& config, int64_t rows, bool with_lse);

// Compares two answers byte for byte; "" when equal, else what differs.
std::string DiffOutputs(const attnd::v1::ForwardResponse& expected,
                        const attnd::v1::ForwardResponse& actual);

// Creates caches "<prefix>-grpc" and "<prefix>-channel" of `config` (with num_pages pages)
// and runs the same steps in both: a prefill of three sequences of different lengths, then
// `decode_steps` decode steps of all three plus a padding entry, random inputs from `seed`;
// the first cache through Forward, the second through a channel of `kind`. OK when every
// layer's o and lse are bitwise equal; the error names the first difference. `chained`: each
// channel step is planned before the previous one's layers run (on top of it, DESIGN 3b).
// `client_device` >= 0: the channel is opened from that GPU (ChannelOptions::cuda_device).
// `cache_device`: both caches are placed on that device of attnd's; unset, where attnd puts
// them (the least used device).
absl::Status CompareChannelWithGrpc(client::Client& client, const std::string& prefix,
                                    attnd::v1::ChannelKind kind,
                                    const attnd::v1::CacheConfig& config, int decode_steps,
                                    uint64_t seed, bool chained = false,
                                    int32_t client_device = -1,
                                    std::optional<int32_t> cache_device = std::nullopt);

// The same with the caller's steps ((sequence id, new tokens) per entry, as MakePlan takes
// them) and a channel of `max_tokens` rows.
absl::Status CompareChannelStepsWithGrpc(
    client::Client& client, const std::string& prefix, attnd::v1::ChannelKind kind,
    const attnd::v1::CacheConfig& config,
    const std::vector<std::vector<std::pair<uint64_t, int32_t>>>& steps, uint64_t seed,
    int32_t max_tokens, bool chained = false, int32_t client_device = -1,
    std::optional<int32_t> cache_device = std::nullopt);

// Sequence transfers through a channel of `kind` against gRPC bytes: creates caches
// "<prefix>-a" and "<prefix>-b" (SmallConfig(64)), prefills sequence 1 of a with 13 tokens,
// exports it as gRPC messages and through a channel on a (1 KiB chunks), imports the channel's
// messages into b as sequence 9 through a channel on b, then runs the same 2-token step on both.
// OK when every chunk's bytes and every layer's o of that step are bitwise equal. The caches are
// deleted at the end. A CUDA_IPC client must be another process than attnd (CUDA maps no IPC
// handle into the process that made it).
absl::Status CompareTransferWithGrpc(client::Client& client, const std::string& prefix,
                                     attnd::v1::ChannelKind kind);

// The attnd child process's gRPC port from its "serving ... on port N" log line; 0 if absent.
int PortFromServingLine(const std::string& line);

}  // namespace attnd::integration
