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
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
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

// The file format above.
absl::Status ExportSequenceToFile(Client& client, std::string_view cache, uint64_t sequence_id,
                                  const std::string& path);
absl::StatusOr<attnd::v1::ImportSequenceResponse> ImportSequenceFromFile(
    Client& client, std::string_view cache, uint64_t sequence_id, const std::string& path);

}  // namespace attnd::client
