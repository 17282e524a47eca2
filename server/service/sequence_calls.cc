// ForkSequence, ExportSequence (server stream: header, then checksummed chunks) and
// ImportSequence (client stream: header, then chunks in any order; published whole at the end).
// The streams' contents are SequenceExporter's and SequenceImporter's (sequence_transfer.h).
//
// Export and import move pages with synchronous backend copies of one chunk (at most
// max_chunk_bytes, 4 MiB by default) on the gRPC thread that delivers the call's event: the same
// order of cost as the chunk's own (de)serialisation, and never under the engine's lock.
#include <zlib.h>

#include <grpcpp/alarm.h>

#include <algorithm>
#include <atomic>
#include <limits>
#include <chrono>
#include <memory>
#include <mutex>
#include <vector>

#include "absl/strings/str_cat.h"
#include "attnd/status_macros.h"
#include "channel/channel_layout.h"
#include "channel/flag_word.h"
#include "service/attention_service.h"
#include "service/convert.h"
#include "service/sequence_transfer.h"

namespace attnd {
namespace {

constexpr int64_t kDefaultChunkBytes = 4 << 20;
// Room for a chunk's other fields within a message.
constexpr int64_t kChunkOverheadBytes = 4096;

using Clock = std::chrono::steady_clock;

double SecondsSince(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

int64_t PageBytes(const CacheGeometry& geometry, bool v_pool) {
  return v_pool ? geometry.VPageBytes() : geometry.KPageBytes();
}

const char* PoolName(bool v_pool) { return v_pool ? "V" : "K"; }

class ExportReactor final : public grpc::ServerWriteReactor<v1::ExportSequenceResponse> {
 public:
  ExportReactor(const ServiceContext& context, const Tenant& tenant,
                const v1::ExportSequenceRequest& request)
      : context_(context), start_(Clock::now()) {
    absl::StatusOr<std::unique_ptr<SequenceExporter>> exporter =
        SequenceExporter::Start(context, tenant, request);
    if (!exporter.ok()) {
      Done(exporter.status());
      return;
    }
    exporter_ = *std::move(exporter);
    StartWrite(&exporter_->header());
  }

  void OnWriteDone(bool ok) override {
    if (!ok) {
      Done(absl::CancelledError("the ExportSequence stream broke"));
      return;
    }
    poll_delay_ = kFirstPoll;
    Advance();
  }

  // A call cancelled while the export waits for an acknowledgement ends at the next poll.
  void OnCancel() override { cancelled_.store(true); }

  void OnDone() override { delete this; }

 private:
  // Through a channel, a region the client has not acknowledged yet is polled again after a
  // delay that grows from kFirstPoll to kLastPoll: an alarm, so no gRPC thread sleeps on a
  // client (DESIGN 3b: a wait on a flag blocks nothing else).
  static constexpr absl::Duration kFirstPoll = absl::Microseconds(20);
  static constexpr absl::Duration kLastPoll = absl::Milliseconds(2);

  void Advance() {
    absl::StatusOr<bool> ready = exporter_->Ready();
    if (!ready.ok()) {
      Done(ready.status());
      return;
    }
    if (!*ready) {
      if (cancelled_.load()) {
        Done(absl::CancelledError("the ExportSequence call was cancelled"));
        return;
      }
      alarm_.Set(absl::ToChronoTime(absl::Now() + poll_delay_), [this](bool) { Advance(); });
      poll_delay_ = std::min(poll_delay_ * 2, kLastPoll);
      return;
    }
    poll_delay_ = kFirstPoll;
    absl::StatusOr<bool> more = exporter_->Next(message_);
    if (!more.ok() || !*more) {
      Done(more.status());
      return;
    }
    StartWrite(&message_);
  }

  void Done(const absl::Status& status) {
    exporter_.reset();  // unpins the pages now, not when gRPC gets round to OnDone
    if (context_.metrics) {
      context_.metrics->ObserveRpc("ExportSequence", status.code(), SecondsSince(start_));
    }
    Finish(ToGrpcStatus(status));
  }

  const ServiceContext& context_;
  const Clock::time_point start_;
  std::unique_ptr<SequenceExporter> exporter_;
  v1::ExportSequenceResponse message_;
  // Set only while no write is pending, and the call finishes only from its callback or a
  // write's: it never outlives the reactor.
  grpc::Alarm alarm_;
  absl::Duration poll_delay_ = kFirstPoll;
  std::atomic<bool> cancelled_{false};
};

class ImportReactor final : public grpc::ServerReadReactor<v1::ImportSequenceRequest> {
 public:
  ImportReactor(const ServiceContext& context, Tenant tenant,
                v1::ImportSequenceResponse* response)
      : context_(context),
        importer_(std::make_unique<SequenceImporter>(context, std::move(tenant))),
        response_(response),
        start_(Clock::now()) {
    StartRead(&request_);
  }

  void OnReadDone(bool ok) override {
    if (ok) {
      absl::Status status = importer_->Receive(request_);
      if (status.ok()) {
        StartRead(&request_);
      } else {
        Done(status);
      }
      return;
    }
    // The client half-closed (or the call broke: then nobody reads the answer).
    absl::StatusOr<v1::ImportSequenceResponse> imported = importer_->Finish();
    if (imported.ok()) *response_ = *std::move(imported);
    Done(imported.status());
  }

  void OnDone() override { delete this; }

 private:
  void Done(const absl::Status& status) {
    importer_.reset();  // an import not published frees its pages and id here
    if (context_.metrics) {
      context_.metrics->ObserveRpc("ImportSequence", status.code(), SecondsSince(start_));
    }
    Finish(ToGrpcStatus(status));
  }

  const ServiceContext& context_;
  std::unique_ptr<SequenceImporter> importer_;
  v1::ImportSequenceResponse* const response_;
  const Clock::time_point start_;
  v1::ImportSequenceRequest request_;
};

class RejectedImportReactor final : public grpc::ServerReadReactor<v1::ImportSequenceRequest> {
 public:
  explicit RejectedImportReactor(const grpc::Status& status) { Finish(status); }
  void OnDone() override { delete this; }
};

class RejectedExportReactor final : public grpc::ServerWriteReactor<v1::ExportSequenceResponse> {
 public:
  explicit RejectedExportReactor(const grpc::Status& status) { Finish(status); }
  void OnDone() override { delete this; }
};

}  // namespace

uint32_t ChunkCrc32(const void* data, size_t size) {
  uLong crc = crc32(0L, Z_NULL, 0);
  const auto* bytes = static_cast<const Bytef*>(data);
  while (size > 0) {  // zlib takes uInt lengths
    const uInt piece = static_cast<uInt>(std::min<size_t>(size, size_t{1} << 30));
    crc = crc32(crc, bytes, piece);
    bytes += piece;
    size -= piece;
  }
  return static_cast<uint32_t>(crc);
}

absl::StatusOr<std::unique_ptr<SequenceExporter>> SequenceExporter::Start(
    const ServiceContext& context, const Tenant& tenant,
    const v1::ExportSequenceRequest& request) {
  if (request.max_chunk_bytes() < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_chunk_bytes: expected 0 (4 MiB) or > 0, got ", request.max_chunk_bytes()));
  }
  auto exporter = std::unique_ptr<SequenceExporter>(new SequenceExporter());
  absl::StatusOr<std::unique_ptr<SequenceExport>> exported =
      context.engine->ExportSequence(tenant.CacheKey(request.cache()), request.sequence_id());
  if (!exported.ok()) return tenant.Scrub(exported.status());
  exporter->exported_ = *std::move(exported);
  const SequenceExport& sequence = *exporter->exported_;
  const CacheGeometry& g = sequence.spec().geometry;
  int64_t limit = std::max<int64_t>(
      1, std::min<int64_t>(request.max_chunk_bytes() > 0 ? request.max_chunk_bytes()
                                                         : kDefaultChunkBytes,
                           context.limits.max_message_bytes - kChunkOverheadBytes));
  if (request.channel_id() != 0) {
    ASSIGN_OR_RETURN(exporter->channel_,
                     context.engine->LendChannel(request.channel_id(), tenant.name));
    const ChannelLayout& layout = exporter->channel_->layout();
    const int64_t page_bytes = std::max(g.KPageBytes(), g.VPageBytes());
    if (layout.slot_bytes < page_bytes) {
      return absl::FailedPreconditionError(absl::StrCat(
          "channel_id: channel ", request.channel_id(), "'s transfer regions hold ",
          layout.slot_bytes, " bytes, less than one page (", page_bytes,
          " bytes); open a channel with a larger max_tokens"));
    }
    // The descriptor messages are small: only the region bounds a chunk.
    limit = std::min<int64_t>(request.max_chunk_bytes() > 0 ? request.max_chunk_bytes()
                                                            : kDefaultChunkBytes,
                              layout.slot_bytes);
    // Flags start at 0 for every transfer: the client acknowledges chunk i with i + 1, and a
    // stale flag of an earlier transfer must not read as an acknowledgement.
    for (const int64_t flag : layout.transfer) {
      RETURN_IF_ERROR(exporter->channel_->ring().StoreTransferFlag(flag, 0));
    }
    exporter->ack_timeout_ = context.step_ttl;
  }
  for (int32_t layer = 0; layer < g.num_layers; ++layer) {
    for (const bool v_pool : {false, true}) {
      const int64_t per_chunk = std::max<int64_t>(1, limit / PageBytes(g, v_pool));
      for (int64_t first = 0; first < sequence.num_pages(); first += per_chunk) {
        exporter->chunks_.push_back(
            {layer, v_pool, first, std::min(per_chunk, sequence.num_pages() - first)});
      }
    }
  }
  CacheStatus status;
  status.spec = sequence.spec();
  v1::CacheInfo info;
  CacheStatusToProto(status, &info);
  v1::SequenceHeader* header = exporter->header_.mutable_header();
  *header->mutable_config() = info.config();
  header->set_sequence_id(sequence.sequence_id());
  header->set_num_tokens(sequence.num_tokens());
  header->set_num_pages(sequence.num_pages());
  header->set_num_chunks(static_cast<int64_t>(exporter->chunks_.size()));
  return exporter;
}

absl::StatusOr<bool> SequenceExporter::Acknowledged(size_t index) const {
  const ChannelLayout& layout = channel_->layout();
  ASSIGN_OR_RETURN(const uint32_t flag, channel_->ring().LoadTransferFlag(
                                            layout.transfer[index % layout.num_slots]));
  return SequenceReached(flag, static_cast<uint32_t>(index + 1));
}

absl::StatusOr<bool> SequenceExporter::Ready() {
  if (channel_ == nullptr) return true;
  RETURN_IF_ERROR(channel_->CheckOpen());
  const size_t regions = static_cast<size_t>(channel_->layout().num_slots);
  size_t waiting_for = 0;  // the chunk whose acknowledgement is needed now
  if (next_chunk_ < chunks_.size()) {
    if (next_chunk_ < regions) return true;  // the region's first use in this transfer
    waiting_for = next_chunk_ - regions;
  } else {
    // Every chunk sent: the export ends OK only once the client read them all.
    drained_ = std::max(drained_, chunks_.size() - std::min(chunks_.size(), regions));
    for (; drained_ < chunks_.size(); ++drained_) {
      ASSIGN_OR_RETURN(const bool acknowledged, Acknowledged(drained_));
      if (!acknowledged) break;
    }
    if (drained_ == chunks_.size()) return true;
    waiting_for = drained_;
  }
  ASSIGN_OR_RETURN(const bool acknowledged, Acknowledged(waiting_for));
  const absl::Time now = absl::Now();
  if (acknowledged) {
    waiting_since_.reset();
    return true;
  }
  if (!waiting_since_.has_value()) waiting_since_ = now;
  if (now - *waiting_since_ > ack_timeout_) {
    return absl::DeadlineExceededError(absl::StrCat(
        "channel_id: the client did not acknowledge chunk ", waiting_for + 1, " of ",
        chunks_.size(), " (transfer flag of region ", waiting_for % regions, ") within ",
        absl::FormatDuration(ack_timeout_), " (the step TTL); the export was abandoned"));
  }
  return false;
}

absl::StatusOr<bool> SequenceExporter::Next(v1::ExportSequenceResponse& message) {
  if (next_chunk_ == chunks_.size()) return false;
  const size_t index = next_chunk_++;
  const Chunk& chunk = chunks_[index];
  const int64_t bytes = chunk.num_pages * PageBytes(exported_->spec().geometry, chunk.v_pool);
  v1::SequenceChunk* out = message.mutable_chunk();
  out->set_layer(chunk.layer);
  out->set_pool(chunk.v_pool ? v1::KV_POOL_V : v1::KV_POOL_K);
  out->set_first_page(chunk.first_page);
  out->set_num_pages(static_cast<int32_t>(chunk.num_pages));
  if (channel_ != nullptr) {
    const ChannelLayout& layout = channel_->layout();
    const int64_t offset = layout.TransferRegion(static_cast<int32_t>(index % layout.num_slots));
    BackendChannel& ring = channel_->ring();
    std::span<uint8_t> staged;
    if (uint8_t* host = ring.host_ring(); host != nullptr) {
      staged = std::span<uint8_t>(host + offset, bytes);  // pages straight into the ring
    } else {
      scratch_.resize(bytes);
      staged = std::span<uint8_t>(scratch_.data(), bytes);
    }
    RETURN_IF_ERROR(exported_->Read(chunk.layer, chunk.v_pool, chunk.first_page,
                                    chunk.num_pages, staged));
    out->set_crc32(ChunkCrc32(staged.data(), staged.size()));
    if (ring.host_ring() == nullptr) RETURN_IF_ERROR(ring.WriteRing(offset, staged));
    out->clear_data();
    out->set_ring_offset(offset);
    out->set_ring_bytes(bytes);
    out->set_channel_sequence(static_cast<uint32_t>(index + 1));
    bytes_ += bytes;
    return true;
  }
  std::string* data = out->mutable_data();
  data->resize(bytes);
  RETURN_IF_ERROR(exported_->Read(
      chunk.layer, chunk.v_pool, chunk.first_page, chunk.num_pages,
      std::span<uint8_t>(reinterpret_cast<uint8_t*>(data->data()), data->size())));
  out->set_crc32(ChunkCrc32(data->data(), data->size()));
  bytes_ += bytes;
  return true;
}

SequenceImporter::SequenceImporter(const ServiceContext& context, Tenant tenant)
    : context_(context), tenant_(std::move(tenant)) {}

absl::Status SequenceImporter::Receive(const v1::ImportSequenceRequest& request) {
  ++messages_;
  absl::Status status;
  if (request.item_case() == v1::ImportSequenceRequest::kAbort) {
    status = absl::AbortedError(
        absl::StrCat("abort: the client gave up the import at message ", messages_));
  } else if (import_ == nullptr) {
    status = Begin(request);
  } else if (request.item_case() != v1::ImportSequenceRequest::kChunk) {
    status = absl::InvalidArgumentError(absl::StrCat(
        "chunk: message ", messages_, " of the stream carries no chunk (only the first "
        "message carries the header)"));
  } else {
    status = Chunk(request.chunk());
  }
  if (!status.ok()) import_.reset();  // nothing of a refused import stays
  return tenant_.Scrub(status);
}

absl::Status SequenceImporter::Begin(const v1::ImportSequenceRequest& request) {
  if (messages_ != 1) {
    return absl::FailedPreconditionError("header: this import already ended");
  }
  if (request.item_case() != v1::ImportSequenceRequest::kHeader) {
    return absl::InvalidArgumentError(
        "header: the first message of an import carries the header (ExportSequence's first "
        "message)");
  }
  const v1::SequenceHeader& header = request.header();
  v1::CreateCacheRequest shape;
  shape.set_name("import");
  *shape.mutable_config() = header.config();
  absl::StatusOr<CacheSpec> source = CacheSpecFromProto(shape);
  if (!source.ok()) {
    return absl::Status(source.status().code(),
                        absl::StrCat("header.", source.status().message()));
  }
  if (source->external_pages) {
    return absl::InvalidArgumentError(
        "header.config.page_table_mode: an exported sequence comes from a MANAGED cache");
  }
  const int32_t page_size = source->geometry.page_size;
  if (header.num_tokens() < 1 || header.num_tokens() > std::numeric_limits<int32_t>::max()) {
    return absl::InvalidArgumentError(absl::StrCat("header.num_tokens: expected 1 to ",
                                                   std::numeric_limits<int32_t>::max(),
                                                   ", got ", header.num_tokens()));
  }
  const int64_t pages = (header.num_tokens() + page_size - 1) / page_size;
  if (header.num_pages() != pages) {
    return absl::InvalidArgumentError(absl::StrCat(
        "header.num_pages: expected ceil(num_tokens / page_size) = ", pages, ", got ",
        header.num_pages()));
  }
  const uint64_t id = request.sequence_id() != 0 ? request.sequence_id() : header.sequence_id();
  if (request.channel_id() != 0) {
    ASSIGN_OR_RETURN(channel_, context_.engine->LendChannel(request.channel_id(), tenant_.name));
  }
  ASSIGN_OR_RETURN(import_, context_.engine->ImportSequence(tenant_.CacheKey(request.cache()),
                                                            id, header.num_tokens(),
                                                            source->geometry));
  written_.assign(static_cast<size_t>(import_->geometry().num_layers) * 2 * pages, false);
  return absl::OkStatus();
}

absl::Status SequenceImporter::Chunk(const v1::SequenceChunk& chunk) {
  const CacheGeometry& g = import_->geometry();
  const std::string where = absl::StrCat("chunk (message ", messages_, ")");
  if (chunk.layer() < 0 || chunk.layer() >= g.num_layers) {
    return absl::InvalidArgumentError(absl::StrCat(where, ".layer: expected [0, ",
                                                   g.num_layers, "), got ", chunk.layer()));
  }
  if (chunk.pool() != v1::KV_POOL_K && chunk.pool() != v1::KV_POOL_V) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ".pool: expected KV_POOL_K or KV_POOL_V, got ", chunk.pool()));
  }
  const bool v_pool = chunk.pool() == v1::KV_POOL_V;
  const int64_t pages = import_->num_pages();
  if (chunk.first_page() < 0 || chunk.num_pages() < 1 || chunk.first_page() >= pages ||
      chunk.num_pages() > pages - chunk.first_page()) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, ".first_page/num_pages: ", chunk.num_pages(), " pages from ", chunk.first_page(),
        " are not within the sequence's ", pages));
  }
  const int64_t expected = chunk.num_pages() * PageBytes(g, v_pool);
  std::span<const uint8_t> bytes;
  int32_t region = -1;  // the transfer region the chunk came through, if any
  if (chunk.ring_offset() != 0 || chunk.ring_bytes() != 0) {
    ASSIGN_OR_RETURN(region, ChannelRegion(chunk, where, expected));
    const int64_t offset = chunk.ring_offset();
    BackendChannel& ring = channel_->ring();
    if (const uint8_t* host = ring.host_ring(); host != nullptr) {
      bytes = std::span<const uint8_t>(host + offset, expected);
    } else {
      scratch_.resize(expected);
      RETURN_IF_ERROR(ring.ReadRing(offset, std::span<uint8_t>(scratch_.data(), expected)));
      bytes = std::span<const uint8_t>(scratch_.data(), expected);
    }
  } else {
    if (static_cast<int64_t>(chunk.data().size()) != expected) {
      return absl::InvalidArgumentError(absl::StrCat(where, ".data: expected ", expected,
                                                     " bytes (", chunk.num_pages(),
                                                     " pages), got ", chunk.data().size()));
    }
    bytes = std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(chunk.data().data()),
                                     chunk.data().size());
  }
  // A HOST_SHM region is checksummed and copied in place: a client that rewrites it before
  // attnd sets the region's flag races only its own import.
  const uint32_t crc = ChunkCrc32(bytes.data(), bytes.size());
  if (crc != chunk.crc32()) {
    return absl::DataLossError(absl::StrCat(
        where, ".crc32: the data's CRC-32 is ", crc, ", the chunk says ", chunk.crc32(),
        " (layer ", chunk.layer(), ", pool ", PoolName(v_pool), ", pages ", chunk.first_page(),
        "..", chunk.first_page() + chunk.num_pages() - 1, "); nothing was imported"));
  }
  const size_t base = (static_cast<size_t>(chunk.layer()) * 2 + (v_pool ? 1 : 0)) * pages;
  for (int64_t page = chunk.first_page(); page < chunk.first_page() + chunk.num_pages();
       ++page) {
    if (written_[base + page]) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": layer ", chunk.layer(), " pool ",
                                                     PoolName(v_pool), " page ", page,
                                                     " came in an earlier chunk too"));
    }
  }
  RETURN_IF_ERROR(
      import_->Write(chunk.layer(), v_pool, chunk.first_page(), chunk.num_pages(), bytes));
  std::fill(written_.begin() + base + chunk.first_page(),
            written_.begin() + base + chunk.first_page() + chunk.num_pages(), true);
  bytes_ += expected;
  if (region >= 0) {
    // The bytes are in the pages: the client may reuse the region.
    RETURN_IF_ERROR(channel_->ring().StoreTransferFlag(channel_->layout().transfer[region],
                                                       chunk.channel_sequence()));
  }
  return absl::OkStatus();
}

absl::StatusOr<int32_t> SequenceImporter::ChannelRegion(const v1::SequenceChunk& chunk,
                                                        const std::string& where,
                                                        int64_t expected) const {
  if (channel_ == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, ".ring_offset: a chunk through a channel, but the import's first message named "
        "no channel_id"));
  }
  if (!chunk.data().empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, ".data: a chunk with a ring descriptor carries no data (got ",
        chunk.data().size(), " bytes)"));
  }
  // Only offsets attnd published: the start of one of the channel's transfer regions.
  const ChannelLayout& layout = channel_->layout();
  int32_t region = -1;
  for (int32_t slot = 0; slot < layout.num_slots; ++slot) {
    if (layout.TransferRegion(slot) == chunk.ring_offset()) region = slot;
  }
  if (region < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, ".ring_offset: ", chunk.ring_offset(), " is not one of channel ",
        channel_->channel_id(), "'s transfer regions (ChannelLayout.transfer_region_offsets: ",
        layout.num_slots, " regions of ", layout.slot_bytes, " bytes from ",
        layout.TransferRegion(0), ")"));
  }
  if (chunk.ring_bytes() != expected) {
    return absl::InvalidArgumentError(absl::StrCat(where, ".ring_bytes: expected ", expected,
                                                   " bytes (", chunk.num_pages(),
                                                   " pages), got ", chunk.ring_bytes()));
  }
  if (expected > layout.slot_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, ".ring_bytes: ", expected, " bytes exceed a transfer region (",
        layout.slot_bytes, " bytes); send fewer pages per chunk"));
  }
  RETURN_IF_ERROR(channel_->CheckOpen());
  return region;
}

absl::StatusOr<v1::ImportSequenceResponse> SequenceImporter::Finish() {
  std::unique_ptr<SequenceImport> import = std::move(import_);
  if (import == nullptr) {
    return absl::InvalidArgumentError("header: the stream ended before its header");
  }
  const auto missing = std::find(written_.begin(), written_.end(), false);
  if (missing != written_.end()) {
    const int64_t pages = import->num_pages();
    const int64_t index = missing - written_.begin();
    const int64_t count = std::count(written_.begin(), written_.end(), false);
    return absl::DataLossError(absl::StrCat(
        "chunk: the stream ended with ", count, " of ", written_.size(),
        " pages missing (first: layer ", index / (2 * pages), ", pool ",
        PoolName((index / pages) % 2 == 1), ", page ", index % pages,
        "); nothing was imported"));
  }
  const absl::Status committed = import->Commit();
  if (!committed.ok()) return tenant_.Scrub(committed);
  v1::ImportSequenceResponse response;
  response.set_sequence_id(import->sequence_id());
  response.set_num_tokens(import->num_tokens());
  response.set_num_pages(import->num_pages());
  response.set_bytes(bytes_);
  return response;
}

absl::Status HandleForkSequence(const ServiceContext& context, const Tenant& tenant,
                                const v1::ForkSequenceRequest& request,
                                v1::ForkSequenceResponse* response) {
  ForkSpec spec;
  spec.cache = tenant.CacheKey(request.cache());
  spec.source_id = request.source_id();
  spec.new_id = request.new_id();
  spec.num_tokens = request.num_tokens();
  absl::StatusOr<ForkResult> forked = context.engine->ForkSequence(spec);
  if (!forked.ok()) return tenant.Scrub(forked.status());
  response->set_num_tokens(forked->num_tokens);
  response->set_shared_pages(forked->shared_pages);
  return absl::OkStatus();
}

grpc::ServerUnaryReactor* AttentionService::ForkSequence(grpc::CallbackServerContext* ctx,
                                                         const v1::ForkSequenceRequest* request,
                                                         v1::ForkSequenceResponse* response) {
  const auto start = Clock::now();
  absl::Status status;
  if (absl::StatusOr<Tenant> tenant = context_.auth->Authenticate(*ctx); !tenant.ok()) {
    status = tenant.status();
  } else {
    status = HandleForkSequence(context_, *tenant, *request, response);
  }
  if (context_.metrics) {
    context_.metrics->ObserveRpc("ForkSequence", status.code(), SecondsSince(start));
  }
  auto* reactor = ctx->DefaultReactor();
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

grpc::ServerWriteReactor<v1::ExportSequenceResponse>* AttentionService::ExportSequence(
    grpc::CallbackServerContext* ctx, const v1::ExportSequenceRequest* request) {
  absl::StatusOr<Tenant> tenant = context_.auth->Authenticate(*ctx);
  if (!tenant.ok()) {
    if (context_.metrics) context_.metrics->ObserveRpc("ExportSequence", tenant.status().code(), 0.0);
    return new RejectedExportReactor(ToGrpcStatus(tenant.status()));
  }
  return new ExportReactor(context_, *tenant, *request);
}

grpc::ServerReadReactor<v1::ImportSequenceRequest>* AttentionService::ImportSequence(
    grpc::CallbackServerContext* ctx, v1::ImportSequenceResponse* response) {
  absl::StatusOr<Tenant> tenant = context_.auth->Authenticate(*ctx);
  if (!tenant.ok()) {
    if (context_.metrics) context_.metrics->ObserveRpc("ImportSequence", tenant.status().code(), 0.0);
    return new RejectedImportReactor(ToGrpcStatus(tenant.status()));
  }
  return new ImportReactor(context_, *std::move(tenant), response);
}

}  // namespace attnd
