#include "attnd/client/sequence.h"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <fstream>
#include <mutex>
#include <optional>
#include <thread>

#include "absl/strings/str_cat.h"
#include "attnd/client/status.h"
#include "attnd/status_macros.h"
#include "google/protobuf/io/zero_copy_stream_impl.h"
#include "google/protobuf/util/delimited_message_util.h"

namespace attnd::client {
namespace {

constexpr char kFileMagic[] = "ATTNDSEQ";
constexpr size_t kFileMagicBytes = 8;

// A region index for a descriptor attnd sent: the channel's own layout decides, so a daemon
// cannot make this process read outside its mapping.
absl::StatusOr<int32_t> RegionOf(const Channel& channel, const attnd::v1::SequenceChunk& chunk) {
  for (int32_t region = 0; region < channel.transfer_regions(); ++region) {
    if (channel.TransferRegionOffset(region) == chunk.ring_offset()) {
      if (chunk.ring_bytes() < 0 || chunk.ring_bytes() > channel.transfer_region_bytes()) break;
      return region;
    }
  }
  return absl::DataLossError(absl::StrCat("ExportSequence sent a ring descriptor (offset ",
                                          chunk.ring_offset(), ", ", chunk.ring_bytes(),
                                          " bytes) outside channel ", channel.id(),
                                          "'s transfer regions"));
}

absl::Status ExportMessages(Client& client, std::string_view cache, uint64_t sequence_id,
                            Channel* channel, const SequenceSink& sink, int64_t max_chunk_bytes) {
  auto context = client.NewContext(/*with_deadline=*/false);
  attnd::v1::ExportSequenceRequest request;
  request.set_cache(std::string(cache));
  request.set_sequence_id(sequence_id);
  request.set_max_chunk_bytes(max_chunk_bytes);
  if (channel != nullptr) request.set_channel_id(channel->id());
  std::unique_ptr<grpc::ClientReader<attnd::v1::ExportSequenceResponse>> reader =
      client.stub().ExportSequence(context.get(), request);
  attnd::v1::ExportSequenceResponse message;
  absl::Status sunk;
  while (reader->Read(&message)) {
    if (channel != nullptr && message.has_chunk() && message.chunk().ring_bytes() > 0) {
      // Out of the region, then the region back to attnd, then the sink: a slow sink (a file,
      // another daemon) does not hold the region.
      attnd::v1::SequenceChunk& chunk = *message.mutable_chunk();
      absl::StatusOr<int32_t> region = RegionOf(*channel, chunk);
      if (region.ok()) {
        std::string& data = *chunk.mutable_data();
        data.resize(chunk.ring_bytes());
        sunk = channel->CopyOut(data.data(), channel->TransferRegion(*region), chunk.ring_bytes());
        if (sunk.ok()) channel->SetTransferFlag(*region, chunk.channel_sequence());
        chunk.clear_ring_offset();
        chunk.clear_ring_bytes();
        chunk.clear_channel_sequence();
      } else {
        sunk = region.status();
      }
    }
    if (sunk.ok()) sunk = sink(message);
    if (!sunk.ok()) {
      context->TryCancel();
      break;
    }
  }
  const grpc::Status finished = reader->Finish();
  RETURN_IF_ERROR(sunk);
  return FromGrpcStatus(finished);
}

// Puts a chunk's data into the next region of `channel` and turns it into a descriptor. false:
// attnd ended the transfer while this waited for the region (the call's status says why).
class RegionWriter {
 public:
  RegionWriter(Channel& channel, absl::Duration timeout)
      : channel_(channel), timeout_(timeout), ended_(channel.TransfersEnded()) {
    // A transfer's flags start at 0 (attnd writes only while it reads this import's chunks).
    for (int32_t region = 0; region < channel.transfer_regions(); ++region) {
      channel.SetTransferFlag(region, 0);
    }
  }

  absl::StatusOr<bool> Put(attnd::v1::SequenceChunk& chunk) {
    const int64_t bytes = static_cast<int64_t>(chunk.data().size());
    if (bytes > channel_.transfer_region_bytes()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "chunk of ", bytes, " bytes exceeds channel ", channel_.id(), "'s transfer regions (",
          channel_.transfer_region_bytes(), " bytes); export with a smaller max_chunk_bytes"));
    }
    const int32_t regions = channel_.transfer_regions();
    const int32_t region = static_cast<int32_t>(next_ % regions);
    const uint32_t sequence = static_cast<uint32_t>(next_ + 1);
    if (next_ >= static_cast<uint64_t>(regions)) {
      // The region's previous chunk must be in attnd's pages before its bytes are replaced.
      const uint32_t previous = static_cast<uint32_t>(next_ + 1 - regions);
      const auto start = std::chrono::steady_clock::now();
      int spins = 0;
      while (static_cast<int32_t>(channel_.TransferFlag(region) - previous) < 0) {
        if (channel_.TransfersEnded() != ended_) return false;
        if (std::chrono::steady_clock::now() - start > absl::ToChronoNanoseconds(timeout_)) {
          return absl::DeadlineExceededError(absl::StrCat(
              "attnd did not release transfer region ", region, " of channel ", channel_.id(),
              " within ", absl::FormatDuration(timeout_)));
        }
        if (++spins > 1000) std::this_thread::sleep_for(std::chrono::microseconds(20));
      }
    }
    RETURN_IF_ERROR(channel_.CopyIn(channel_.TransferRegion(region), chunk.data().data(), bytes));
    chunk.clear_data();
    chunk.set_ring_offset(channel_.TransferRegionOffset(region));
    chunk.set_ring_bytes(bytes);
    chunk.set_channel_sequence(sequence);
    ++next_;
    return true;
  }

 private:
  Channel& channel_;
  const absl::Duration timeout_;
  const uint32_t ended_;
  uint64_t next_ = 0;  // chunks put so far
};

absl::StatusOr<attnd::v1::ImportSequenceResponse> ImportMessages(
    Client& client, std::string_view cache, uint64_t sequence_id, Channel* channel,
    const SequenceSource& source, absl::Duration region_timeout) {
  std::optional<RegionWriter> regions;
  if (channel != nullptr) regions.emplace(*channel, region_timeout);
  auto context = client.NewContext(/*with_deadline=*/false);
  attnd::v1::ImportSequenceResponse response;
  std::unique_ptr<grpc::ClientWriter<attnd::v1::ImportSequenceRequest>> writer =
      client.stub().ImportSequence(context.get(), &response);
  attnd::v1::ExportSequenceResponse message;
  attnd::v1::ImportSequenceRequest request;
  absl::Status sourced;
  bool first = true;
  for (;;) {
    absl::StatusOr<bool> more = source(message);
    if (more.ok() && *more && regions.has_value() && message.has_chunk()) {
      absl::StatusOr<bool> put = regions->Put(*message.mutable_chunk());
      if (put.ok() && !*put) break;  // attnd ended the import: Finish says why
      if (!put.ok()) more = put.status();
    }
    if (!more.ok()) {
      sourced = more.status();
      // The daemon must not publish a partial sequence, and the id must be free again when
      // this returns: an abort message (a cancel would be cleaned up after Finish returned).
      request.Clear();
      if (first) {
        request.set_cache(std::string(cache));
        request.set_sequence_id(sequence_id);
      }
      request.set_abort(true);
      writer->Write(request);  // false when the daemon already finished: Finish says why
      break;
    }
    if (!*more) break;
    request.Clear();
    if (first) {
      request.set_cache(std::string(cache));
      request.set_sequence_id(sequence_id);
      if (channel != nullptr) request.set_channel_id(channel->id());
      first = false;
    }
    if (message.has_header()) *request.mutable_header() = std::move(*message.mutable_header());
    if (message.has_chunk()) request.mutable_chunk()->Swap(message.mutable_chunk());
    if (!writer->Write(request)) break;  // the daemon finished early: Finish says why
  }
  writer->WritesDone();
  const grpc::Status finished = writer->Finish();
  RETURN_IF_ERROR(sourced);
  RETURN_IF_ERROR(FromGrpcStatus(finished));
  return response;
}

}  // namespace

absl::StatusOr<attnd::v1::ForkSequenceResponse> ForkSequence(Client& client,
                                                             std::string_view cache,
                                                             uint64_t source_id, uint64_t new_id,
                                                             int64_t num_tokens) {
  auto context = client.NewContext();
  attnd::v1::ForkSequenceRequest request;
  request.set_cache(std::string(cache));
  request.set_source_id(source_id);
  request.set_new_id(new_id);
  request.set_num_tokens(num_tokens);
  attnd::v1::ForkSequenceResponse response;
  RETURN_IF_ERROR(
      FromGrpcStatus(client.stub().ForkSequence(context.get(), request, &response)));
  return response;
}

absl::Status ExportSequence(Client& client, std::string_view cache, uint64_t sequence_id,
                            const SequenceSink& sink, int64_t max_chunk_bytes) {
  return ExportMessages(client, cache, sequence_id, nullptr, sink, max_chunk_bytes);
}

absl::Status ExportSequenceThroughChannel(Client& client, std::string_view cache,
                                          uint64_t sequence_id, Channel& channel,
                                          const SequenceSink& sink, int64_t max_chunk_bytes) {
  return ExportMessages(client, cache, sequence_id, &channel, sink, max_chunk_bytes);
}

absl::StatusOr<attnd::v1::ImportSequenceResponse> ImportSequence(Client& client,
                                                                 std::string_view cache,
                                                                 uint64_t sequence_id,
                                                                 const SequenceSource& source) {
  return ImportMessages(client, cache, sequence_id, nullptr, source, absl::ZeroDuration());
}

absl::StatusOr<attnd::v1::ImportSequenceResponse> ImportSequenceThroughChannel(
    Client& client, std::string_view cache, uint64_t sequence_id, Channel& channel,
    const SequenceSource& source, absl::Duration region_timeout) {
  return ImportMessages(client, cache, sequence_id, &channel, source, region_timeout);
}

absl::StatusOr<attnd::v1::ImportSequenceResponse> CopySequence(
    Client& from, std::string_view from_cache, uint64_t sequence_id, Client& to,
    std::string_view to_cache, uint64_t new_id) {
  return CopySequenceThroughChannels(from, from_cache, sequence_id, nullptr, to, to_cache, new_id,
                                     nullptr);
}

absl::StatusOr<attnd::v1::ImportSequenceResponse> CopySequenceThroughChannels(
    Client& from, std::string_view from_cache, uint64_t sequence_id, Channel* from_channel,
    Client& to, std::string_view to_cache, uint64_t new_id, Channel* to_channel) {
  // The export runs on its own thread and hands messages over one at a time.
  std::mutex mu;
  std::condition_variable changed;
  std::optional<attnd::v1::ExportSequenceResponse> slot;
  bool export_done = false;
  bool import_done = false;
  absl::Status export_status;
  std::thread exporter([&] {
    absl::Status status = ExportMessages(
        from, from_cache, sequence_id, from_channel,
        [&](const attnd::v1::ExportSequenceResponse& message) {
          std::unique_lock lock(mu);
          changed.wait(lock, [&] { return !slot.has_value() || import_done; });
          if (import_done) return absl::CancelledError("the import ended");
          slot = message;
          changed.notify_all();
          return absl::OkStatus();
        },
        0);
    std::lock_guard lock(mu);
    export_status = status;
    export_done = true;
    changed.notify_all();
  });
  absl::StatusOr<attnd::v1::ImportSequenceResponse> imported = ImportMessages(
      to, to_cache, new_id, to_channel,
      [&](attnd::v1::ExportSequenceResponse& message) -> absl::StatusOr<bool> {
        std::unique_lock lock(mu);
        changed.wait(lock, [&] { return slot.has_value() || export_done; });
        if (slot.has_value()) {
          message = std::move(*slot);
          slot.reset();
          changed.notify_all();
          return true;
        }
        if (!export_status.ok()) return export_status;
        return false;
      },
      absl::Seconds(60));
  {
    std::lock_guard lock(mu);
    import_done = true;
    changed.notify_all();
  }
  exporter.join();
  if (!export_status.ok() && imported.ok()) return export_status;
  if (!export_status.ok() && !imported.ok() && absl::IsCancelled(imported.status())) {
    return export_status;
  }
  return imported;
}

absl::Status ExportSequenceToFile(Client& client, std::string_view cache, uint64_t sequence_id,
                                  const std::string& path, Channel* channel) {
  std::ofstream file(path, std::ios::binary | std::ios::trunc);
  if (!file) return absl::NotFoundError(absl::StrCat("cannot write '", path, "'"));
  file.write(kFileMagic, kFileMagicBytes);
  RETURN_IF_ERROR(ExportMessages(
      client, cache, sequence_id, channel,
      [&](const attnd::v1::ExportSequenceResponse& message) {
        if (!google::protobuf::util::SerializeDelimitedToOstream(message, &file)) {
          return absl::DataLossError(absl::StrCat("writing '", path, "' failed"));
        }
        return absl::OkStatus();
      },
      0));
  file.close();
  if (!file) return absl::DataLossError(absl::StrCat("writing '", path, "' failed"));
  return absl::OkStatus();
}

absl::StatusOr<attnd::v1::ImportSequenceResponse> ImportSequenceFromFile(
    Client& client, std::string_view cache, uint64_t sequence_id, const std::string& path,
    Channel* channel) {
  std::ifstream file(path, std::ios::binary);
  if (!file) return absl::NotFoundError(absl::StrCat("cannot read '", path, "'"));
  char magic[kFileMagicBytes] = {};
  file.read(magic, kFileMagicBytes);
  if (!file || std::string_view(magic, kFileMagicBytes) != kFileMagic) {
    return absl::InvalidArgumentError(
        absl::StrCat("'", path, "' is not an exported sequence (no ATTNDSEQ header)"));
  }
  google::protobuf::io::IstreamInputStream input(&file);
  return ImportMessages(
      client, cache, sequence_id, channel,
      [&](attnd::v1::ExportSequenceResponse& message) -> absl::StatusOr<bool> {
        bool clean_eof = false;
        if (google::protobuf::util::ParseDelimitedFromZeroCopyStream(&message, &input,
                                                                     &clean_eof)) {
          return true;
        }
        if (clean_eof) return false;
        return absl::DataLossError(
            absl::StrCat("'", path, "' ends inside a message or holds one that does not parse"));
      },
      absl::Seconds(60));
}

absl::StatusOr<std::unique_ptr<Channel>> OpenTransferChannel(Client& client,
                                                             std::string_view cache,
                                                             attnd::v1::ChannelKind kind,
                                                             int32_t slots,
                                                             int64_t region_bytes) {
  // A region is a slot's span, which grows with max_tokens: probe with a few rows, then open
  // the channel with as many as the wanted region needs.
  ChannelOptions options;
  options.kind = kind;
  options.slots = slots;
  options.max_tokens = 16;
  ASSIGN_OR_RETURN(std::unique_ptr<Channel> probe, Channel::Open(client, cache, options));
  const int64_t per_token = std::max<int64_t>(1, probe->transfer_region_bytes() / 16);
  if (probe->transfer_region_bytes() >= region_bytes) return probe;
  probe.reset();
  options.max_tokens = static_cast<int32_t>((region_bytes + per_token - 1) / per_token + 1);
  return Channel::Open(client, cache, options);
}

}  // namespace attnd::client
