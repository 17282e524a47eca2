// The export and import of a sequence as message sequences, apart from the gRPC reactors that
// carry them (sequence_calls.cc), so that tests and the fuzz harness drive the same code.
//
// SequenceExporter: ExportSequenceRequest -> the header, then one chunk per Next().
// SequenceImporter: ImportSequenceRequest messages (header first) -> Finish() publishes the
// sequence, or the importer's destruction drops everything it reserved.
//
// Both copy pages synchronously (one chunk at a time) and are not thread-safe; the engine must
// outlive them.
//
// Through a channel (ExportSequenceRequest / ImportSequenceRequest channel_id): the chunks'
// bytes go through the channel's transfer regions and the messages carry descriptors
// (SequenceChunk.ring_offset). The exporter never waits itself: Ready() says whether the next
// region is free (the client acknowledged its previous chunk), and the caller polls it.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "attnd/v1/attnd.pb.h"
#include "engine/engine.h"
#include "service/attention_service.h"

namespace attnd {

class SequenceExporter {
 public:
  // NOT_FOUND / FAILED_PRECONDITION / INVALID_ARGUMENT as ExportSequence answers them, in the
  // tenant's names.
  static absl::StatusOr<std::unique_ptr<SequenceExporter>> Start(
      const ServiceContext& context, const Tenant& tenant,
      const v1::ExportSequenceRequest& request);

  const v1::ExportSequenceResponse& header() const { return header_; }
  // Whether Next may run now. Without a channel, always. With one: once the client
  // acknowledged the previous chunk of the next chunk's region (after the last chunk: every
  // chunk). false: poll again later. DEADLINE_EXCEEDED once a region stayed unacknowledged
  // for `ack_timeout`, UNAVAILABLE once the channel closed.
  absl::StatusOr<bool> Ready();
  // Fills `message` with the next chunk; false when none is left (call it only when Ready).
  absl::StatusOr<bool> Next(v1::ExportSequenceResponse& message);
  int64_t bytes() const { return bytes_; }
  bool through_channel() const { return channel_ != nullptr; }

 private:
  // Whether the client acknowledged chunk `index` (its region's flag reached index + 1).
  absl::StatusOr<bool> Acknowledged(size_t index) const;

  struct Chunk {
    int32_t layer;
    bool v_pool;
    int64_t first_page;
    int64_t num_pages;
  };
  std::unique_ptr<SequenceExport> exported_;
  v1::ExportSequenceResponse header_;
  std::vector<Chunk> chunks_;
  size_t next_chunk_ = 0;
  int64_t bytes_ = 0;
  // Channel transfers: the loan, the chunks known acknowledged after the last was sent, and
  // since when Ready has been answering false.
  std::unique_ptr<ChannelTransfer> channel_;
  std::vector<uint8_t> scratch_;  // CUDA_IPC: the chunk on the host (for its CRC)
  size_t drained_ = 0;
  absl::Duration ack_timeout_;
  std::optional<absl::Time> waiting_since_;
};

class SequenceImporter {
 public:
  SequenceImporter(const ServiceContext& context, Tenant tenant);

  // One message of the client's stream. An error ends the import (the caller drops it).
  absl::Status Receive(const v1::ImportSequenceRequest& request);
  // The stream ended: publishes the sequence when every page came (DATA_LOSS otherwise).
  absl::StatusOr<v1::ImportSequenceResponse> Finish();

 private:
  absl::Status Begin(const v1::ImportSequenceRequest& request);
  absl::Status Chunk(const v1::SequenceChunk& chunk);
  // The channel region a chunk's descriptor names (INVALID_ARGUMENT naming the field for one
  // attnd did not publish or a size that disagrees with the chunk's pages).
  absl::StatusOr<int32_t> ChannelRegion(const v1::SequenceChunk& chunk, const std::string& where,
                                        int64_t expected) const;

  const ServiceContext& context_;
  const Tenant tenant_;
  std::unique_ptr<ChannelTransfer> channel_;  // declared first: outlives import_'s pages
  std::vector<uint8_t> scratch_;              // CUDA_IPC: a chunk copied out of the ring
  std::unique_ptr<SequenceImport> import_;
  std::vector<bool> written_;  // [layer][pool][page]
  int64_t messages_ = 0;
  int64_t bytes_ = 0;
};

// ForkSequence on behalf of `tenant` (the handler's body; the fuzz harness calls it too).
absl::Status HandleForkSequence(const ServiceContext& context, const Tenant& tenant,
                                const v1::ForkSequenceRequest& request,
                                v1::ForkSequenceResponse* response);

// CRC-32 (IEEE 802.3, zlib's) of a chunk's data.
uint32_t ChunkCrc32(const void* data, size_t size);

}  // namespace attnd
