#include "attnd/client/sequence.h"

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
  auto context = client.NewContext(/*with_deadline=*/false);
  attnd::v1::ExportSequenceRequest request;
  request.set_cache(std::string(cache));
  request.set_sequence_id(sequence_id);
  request.set_max_chunk_bytes(max_chunk_bytes);
  std::unique_ptr<grpc::ClientReader<attnd::v1::ExportSequenceResponse>> reader =
      client.stub().ExportSequence(context.get(), request);
  attnd::v1::ExportSequenceResponse message;
  absl::Status sunk;
  while (reader->Read(&message)) {
    sunk = sink(message);
    if (!sunk.ok()) {
      context->TryCancel();
      break;
    }
  }
  const grpc::Status finished = reader->Finish();
  RETURN_IF_ERROR(sunk);
  return FromGrpcStatus(finished);
}

absl::StatusOr<attnd::v1::ImportSequenceResponse> ImportSequence(Client& client,
                                                                 std::string_view cache,
                                                                 uint64_t sequence_id,
                                                                 const SequenceSource& source) {
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
    if (!more.ok()) {
      sourced = more.status();
      // The daemon must not publish a partial sequence: cancel rather than half-close.
      context->TryCancel();
      break;
    }
    if (!*more) break;
    request.Clear();
    if (first) {
      request.set_cache(std::string(cache));
      request.set_sequence_id(sequence_id);
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

absl::StatusOr<attnd::v1::ImportSequenceResponse> CopySequence(
    Client& from, std::string_view from_cache, uint64_t sequence_id, Client& to,
    std::string_view to_cache, uint64_t new_id) {
  // The export runs on its own thread and hands messages over one at a time.
  std::mutex mu;
  std::condition_variable changed;
  std::optional<attnd::v1::ExportSequenceResponse> slot;
  bool export_done = false;
  bool import_done = false;
  absl::Status export_status;
  std::thread exporter([&] {
    absl::Status status = ExportSequence(
        from, from_cache, sequence_id, [&](const attnd::v1::ExportSequenceResponse& message) {
          std::unique_lock lock(mu);
          changed.wait(lock, [&] { return !slot.has_value() || import_done; });
          if (import_done) return absl::CancelledError("the import ended");
          slot = message;
          changed.notify_all();
          return absl::OkStatus();
        });
    std::lock_guard lock(mu);
    export_status = status;
    export_done = true;
    changed.notify_all();
  });
  absl::StatusOr<attnd::v1::ImportSequenceResponse> imported = ImportSequence(
      to, to_cache, new_id,
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
      });
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
                                  const std::string& path) {
  std::ofstream file(path, std::ios::binary | std::ios::trunc);
  if (!file) return absl::NotFoundError(absl::StrCat("cannot write '", path, "'"));
  file.write(kFileMagic, kFileMagicBytes);
  RETURN_IF_ERROR(ExportSequence(
      client, cache, sequence_id, [&](const attnd::v1::ExportSequenceResponse& message) {
        if (!google::protobuf::util::SerializeDelimitedToOstream(message, &file)) {
          return absl::DataLossError(absl::StrCat("writing '", path, "' failed"));
        }
        return absl::OkStatus();
      }));
  file.close();
  if (!file) return absl::DataLossError(absl::StrCat("writing '", path, "' failed"));
  return absl::OkStatus();
}

absl::StatusOr<attnd::v1::ImportSequenceResponse> ImportSequenceFromFile(
    Client& client, std::string_view cache, uint64_t sequence_id, const std::string& path) {
  std::ifstream file(path, std::ios::binary);
  if (!file) return absl::NotFoundError(absl::StrCat("cannot read '", path, "'"));
  char magic[kFileMagicBytes] = {};
  file.read(magic, kFileMagicBytes);
  if (!file || std::string_view(magic, kFileMagicBytes) != kFileMagic) {
    return absl::InvalidArgumentError(
        absl::StrCat("'", path, "' is not an exported sequence (no ATTNDSEQ header)"));
  }
  google::protobuf::io::IstreamInputStream input(&file);
  return ImportSequence(
      client, cache, sequence_id,
      [&](attnd::v1::ExportSequenceResponse& message) -> absl::StatusOr<bool> {
        bool clean_eof = false;
        if (google::protobuf::util::ParseDelimitedFromZeroCopyStream(&message, &input,
                                                                     &clean_eof)) {
          return true;
        }
        if (clean_eof) return false;
        return absl::DataLossError(
            absl::StrCat("'", path, "' ends inside a message or holds one that does not parse"));
      });
}

}  // namespace attnd::client
