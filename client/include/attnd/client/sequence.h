// Sequence lifecycle from the client: fork a managed sequence, stream one out of a cache
// (ExportSequence) and into another (ImportSequence), on one daemon or two, or through a file.
//
// The file format (attnctl seq export --out / seq import --in) is the 8 bytes "ATTNDSEQ"
// followed by the export's ExportSequenceResponse messages (header first, then chunks), each
// preceded by its size as a protobuf varint. Each chunk carries its CRC-32, which the importing
// daemon checks; a truncated file lacks chunks, which it refuses too.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "attnd/client/channel.h"
#include "attnd/client/client.h"
#include "attnd/v1/attnd.pb.h"

namespace attnd::client {

absl::StatusOr<attnd::v1::ForkSequenceResponse> ForkSequence(Client& client,
                                                             std::string_view cache,
                                                             uint64_t source_id, uint64_t new_id,
                                                             int64_t num_tokens = 0);

// Receives an export's messages in order; an error stops the export (the call is cancelled).
using SequenceSink = std::function<absl::Status(const attnd::v1::ExportSequenceResponse&)>;
// Yields an export's messages in order: true with `message` filled, false at the end.
using SequenceSource = std::function<absl::StatusOr<bool>(attnd::v1::ExportSequenceResponse&)>;

// Streams `sequence_id` of `cache` into `sink`. No deadline: a long sequence takes a while.
absl::Status ExportSequence(Client& client, std::string_view cache, uint64_t sequence_id,
                            const SequenceSink& sink, int64_t max_chunk_bytes = 0);

// Streams the messages of `source` into `cache` as sequence `sequence_id` (0: the exported
// id). The daemon publishes the sequence only when every chunk arrived intact.
absl::StatusOr<attnd::v1::ImportSequenceResponse> ImportSequence(Client& client,
                                                                 std::string_view cache,
                                                                 uint64_t sequence_id,
                                                                 const SequenceSource& source);

// Export from one daemon straight into another (or the same), chunk by chunk: one chunk in
// memory at a time.
absl::StatusOr<attnd::v1::ImportSequenceResponse> CopySequence(
    Client& from, std::string_view from_cache, uint64_t sequence_id, Client& to,
    std::string_view to_cache, uint64_t new_id = 0);

// Through a channel (DESIGN 3b): the KV bytes go through the ring of `channel` (HOST_SHM or
// CUDA_IPC, opened by this process on any cache of the same daemon, carrying no step
// meanwhile) and gRPC carries only the chunks' descriptors (SequenceChunk.ring_offset). The
// sink and the source see the same messages as above (chunks with their data), so files and
// copies work unchanged: the export copies each chunk out of its region into the message and
// acknowledges the region before the sink sees it; the import copies each chunk's data into
// the next region (once attnd acknowledged that region's previous chunk, at most
// `region_timeout` later) and sends its descriptor. A chunk larger than the channel's regions
// is INVALID_ARGUMENT (export it with max_chunk_bytes <= transfer_region_bytes()).
absl::Status ExportSequenceThroughChannel(Client& client, std::string_view cache,
                                          uint64_t sequence_id, Channel& channel,
                                          const SequenceSink& sink, int64_t max_chunk_bytes = 0);
absl::StatusOr<attnd::v1::ImportSequenceResponse> ImportSequenceThroughChannel(
    Client& client, std::string_view cache, uint64_t sequence_id, Channel& channel,
    const SequenceSource& source, absl::Duration region_timeout = absl::Seconds(60));
// CopySequence with the export through `from_channel` (a channel of `from`'s daemon) and the
// import through `to_channel` (of `to`'s); either may be null: gRPC bytes for that side.
absl::StatusOr<attnd::v1::ImportSequenceResponse> CopySequenceThroughChannels(
    Client& from, std::string_view from_cache, uint64_t sequence_id, Channel* from_channel,
    Client& to, std::string_view to_cache, uint64_t new_id, Channel* to_channel);

// The file format above; with a channel, the daemon's side goes through it (as the
// ...ThroughChannel functions), the file's content is the same.
absl::Status ExportSequenceToFile(Client& client, std::string_view cache, uint64_t sequence_id,
                                  const std::string& path, Channel* channel = nullptr);
absl::StatusOr<attnd::v1::ImportSequenceResponse> ImportSequenceFromFile(
    Client& client, std::string_view cache, uint64_t sequence_id, const std::string& path,
    Channel* channel = nullptr);

// A channel sized for transfers: `kind` on `cache`, `slots` regions of at least
// `region_bytes` each (its max_tokens chosen from the cache's row sizes).
absl::StatusOr<std::unique_ptr<Channel>> OpenTransferChannel(Client& client,
                                                             std::string_view cache,
                                                             attnd::v1::ChannelKind kind,
                                                             int32_t slots = 4,
                                                             int64_t region_bytes = 4 << 20);

}  // namespace attnd::client
