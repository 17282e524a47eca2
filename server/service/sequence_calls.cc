// ForkSequence, ExportSequence (server stream: header, then checksummed chunks) and
// ImportSequence (client stream: header, then chunks in any order; published whole at the end).
//
// Export and import move pages with synchronous backend copies of one chunk (at most
// max_chunk_bytes, 4 MiB by default) on the gRPC thread that delivers the call's event: the same
// order of cost as the chunk's own (de)serialisation, and never under the engine's lock.
#include <zlib.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <mutex>
#include <vector>

#include "absl/strings/str_cat.h"
#include "attnd/status_macros.h"
#include "service/attention_service.h"
#include "service/convert.h"

namespace attnd {
namespace {

constexpr int64_t kDefaultChunkBytes = 4 << 20;
// Room for a chunk's other fields within a message.
constexpr int64_t kChunkOverheadBytes = 4096;

using Clock = std::chrono::steady_clock;

double SecondsSince(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

uint32_t Crc32(const void* data, size_t size) {
  uLong crc = crc32(0L, Z_NULL, 0);
  const auto* bytes = static_cast<const Bytef*>(data);
  // zlib takes uInt lengths.
  while (size > 0) {
    const uInt piece = static_cast<uInt>(std::min<size_t>(size, 1u << 30));
    crc = crc32(crc, bytes, piece);
    bytes += piece;
    size -= piece;
  }
  return static_cast<uint32_t>(crc);
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
    absl::Status status = Start(tenant, request);
    if (!status.ok()) Fail(tenant.Scrub(status));
  }

  void OnWriteDone(bool ok) override {
    if (!ok) {
      Fail(absl::CancelledError("the ExportSequence stream broke"));
      return;
    }
    if (next_chunk_ == chunks_.size()) {
      Done(absl::OkStatus());
      return;
    }
    absl::Status status = WriteChunk(chunks_[next_chunk_++]);
    if (!status.ok()) Fail(status);
  }

  void OnDone() override { delete this; }

 private:
  struct Chunk {
    int32_t layer;
    bool v_pool;
    int64_t first_page;
    int64_t num_pages;
  };

  absl::Status Start(const Tenant& tenant, const v1::ExportSequenceRequest& request) {
    if (request.max_chunk_bytes() < 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "max_chunk_bytes: expected 0 (4 MiB) or > 0, got ", request.max_chunk_bytes()));
    }
    ASSIGN_OR_RETURN(exported_, context_.engine->ExportSequence(
                                    tenant.CacheKey(request.cache()), request.sequence_id()));
    const CacheGeometry& g = exported_->spec().geometry;
    const int64_t limit = std::max<int64_t>(
        1, std::min<int64_t>(request.max_chunk_bytes() > 0 ? request.max_chunk_bytes()
                                                           : kDefaultChunkBytes,
                             context_.limits.max_message_bytes - kChunkOverheadBytes));
    for (int32_t layer = 0; layer < g.num_layers; ++layer) {
      for (const bool v_pool : {false, true}) {
        const int64_t per_chunk = std::max<int64_t>(1, limit / PageBytes(g, v_pool));
        for (int64_t first = 0; first < exported_->num_pages(); first += per_chunk) {
          chunks_.push_back(
              {layer, v_pool, first, std::min(per_chunk, exported_->num_pages() - first)});
        }
      }
    }
    CacheStatus status;
    status.spec = exported_->spec();
    v1::CacheInfo info;
    CacheStatusToProto(status, &info);
    v1::SequenceHeader* header = message_.mutable_header();
    *header->mutable_config() = info.config();
    header->set_sequence_id(exported_->sequence_id());
    header->set_num_tokens(exported_->num_tokens());
    header->set_num_pages(exported_->num_pages());
    header->set_num_chunks(static_cast<int64_t>(chunks_.size()));
    StartWrite(&message_);
    return absl::OkStatus();
  }

  absl::Status WriteChunk(const Chunk& chunk) {
    const int64_t bytes = chunk.num_pages * PageBytes(exported_->spec().geometry, chunk.v_pool);
    v1::SequenceChunk* out = message_.mutable_chunk();
    out->set_layer(chunk.layer);
    out->set_pool(chunk.v_pool ? v1::KV_POOL_V : v1::KV_POOL_K);
    out->set_first_page(chunk.first_page);
    out->set_num_pages(static_cast<int32_t>(chunk.num_pages));
    std::string* data = out->mutable_data();
    data->resize(bytes);
    RETURN_IF_ERROR(exported_->Read(chunk.layer, chunk.v_pool, chunk.first_page, chunk.num_pages,
                                    std::span<uint8_t>(reinterpret_cast<uint8_t*>(data->data()),
                                                       data->size())));
    out->set_crc32(Crc32(data->data(), data->size()));
    bytes_ += bytes;
    StartWrite(&message_);
    return absl::OkStatus();
  }

  void Fail(const absl::Status& status) { Done(status); }

  void Done(const absl::Status& status) {
    exported_.reset();  // unpins the pages now, not when gRPC gets round to OnDone
    if (context_.metrics) {
      context_.metrics->ObserveRpc("ExportSequence", status.code(), SecondsSince(start_));
    }
    Finish(ToGrpcStatus(status));
  }

  const ServiceContext& context_;
  const Clock::time_point start_;
  std::unique_ptr<SequenceExport> exported_;
  std::vector<Chunk> chunks_;
  size_t next_chunk_ = 0;
  int64_t bytes_ = 0;
  v1::ExportSequenceResponse message_;
};

class ImportReactor final : public grpc::ServerReadReactor<v1::ImportSequenceRequest> {
 public:
  ImportReactor(const ServiceContext& context, Tenant tenant,
                v1::ImportSequenceResponse* response)
      : context_(context), tenant_(std::move(tenant)), response_(response), start_(Clock::now()) {
    StartRead(&request_);
  }

  void OnReadDone(bool ok) override {
    absl::Status status = ok ? Receive() : Complete();
    if (!status.ok() || !ok) {
      Done(tenant_.Scrub(status));
      return;
    }
    StartRead(&request_);
  }

  void OnDone() override { delete this; }

 private:
  absl::Status Receive() {
    if (import_ == nullptr) return Begin();
    if (request_.item_case() != v1::ImportSequenceRequest::kChunk) {
      return absl::InvalidArgumentError(absl::StrCat(
          "chunk: message ", messages_ + 1, " of the stream carries no chunk (only the first "
          "message carries the header)"));
    }
    ++messages_;
    return Chunk(request_.chunk());
  }

  absl::Status Begin() {
    ++messages_;
    if (request_.item_case() != v1::ImportSequenceRequest::kHeader) {
      return absl::InvalidArgumentError(
          "header: the first message of an import carries the header (ExportSequence's first "
          "message)");
    }
    const v1::SequenceHeader& header = request_.header();
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
    if (header.num_tokens() < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("header.num_tokens: expected >= 1, got ", header.num_tokens()));
    }
    const int64_t pages = (header.num_tokens() + page_size - 1) / page_size;
    if (header.num_pages() != pages) {
      return absl::InvalidArgumentError(absl::StrCat(
          "header.num_pages: expected ceil(num_tokens / page_size) = ", pages, ", got ",
          header.num_pages()));
    }
    const uint64_t id = request_.sequence_id() != 0 ? request_.sequence_id()
                                                     : header.sequence_id();
    ASSIGN_OR_RETURN(import_, context_.engine->ImportSequence(tenant_.CacheKey(request_.cache()),
                                                              id, header.num_tokens(),
                                                              source->geometry));
    const int32_t layers = import_->geometry().num_layers;
    written_.assign(static_cast<size_t>(layers) * 2 * pages, false);
    return absl::OkStatus();
  }

  absl::Status Chunk(const v1::SequenceChunk& chunk) {
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
    if (chunk.first_page() < 0 || chunk.num_pages() < 1 ||
        chunk.first_page() + chunk.num_pages() > pages) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, ".first_page/num_pages: pages [", chunk.first_page(), ", ",
          chunk.first_page() + chunk.num_pages(), ") are not within the sequence's ", pages));
    }
    const int64_t expected = chunk.num_pages() * PageBytes(g, v_pool);
    if (static_cast<int64_t>(chunk.data().size()) != expected) {
      return absl::InvalidArgumentError(absl::StrCat(where, ".data: expected ", expected,
                                                     " bytes (", chunk.num_pages(),
                                                     " pages), got ", chunk.data().size()));
    }
    const uint32_t crc = Crc32(chunk.data().data(), chunk.data().size());
    if (crc != chunk.crc32()) {
      return absl::DataLossError(absl::StrCat(
          where, ".crc32: the data's CRC-32 is ", crc, ", the chunk says ", chunk.crc32(),
          " (layer ", chunk.layer(), ", pool ", PoolName(v_pool), ", pages ",
          chunk.first_page(), "..", chunk.first_page() + chunk.num_pages() - 1,
          "); nothing was imported"));
    }
    const size_t base = (static_cast<size_t>(chunk.layer()) * 2 + (v_pool ? 1 : 0)) * pages;
    for (int64_t page = chunk.first_page(); page < chunk.first_page() + chunk.num_pages();
         ++page) {
      if (written_[base + page]) {
        return absl::InvalidArgumentError(absl::StrCat(where, ": layer ", chunk.layer(),
                                                       " pool ", PoolName(v_pool), " page ",
                                                       page, " came in an earlier chunk too"));
      }
    }
    RETURN_IF_ERROR(import_->Write(
        chunk.layer(), v_pool, chunk.first_page(), chunk.num_pages(),
        std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(chunk.data().data()),
                                 chunk.data().size())));
    std::fill(written_.begin() + base + chunk.first_page(),
              written_.begin() + base + chunk.first_page() + chunk.num_pages(), true);
    bytes_ += expected;
    return absl::OkStatus();
  }

  // The client half-closed: every page must have come.
  absl::Status Complete() {
    if (import_ == nullptr) {
      return absl::InvalidArgumentError("header: the stream ended before its header");
    }
    const auto missing = std::find(written_.begin(), written_.end(), false);
    if (missing != written_.end()) {
      const int64_t pages = import_->num_pages();
      const int64_t index = missing - written_.begin();
      const int64_t count = std::count(written_.begin(), written_.end(), false);
      return absl::DataLossError(absl::StrCat(
          "chunk: the stream ended with ", count, " of ", written_.size(),
          " pages missing (first: layer ", index / (2 * pages), ", pool ",
          PoolName((index / pages) % 2 == 1), ", page ", index % pages,
          "); nothing was imported"));
    }
    RETURN_IF_ERROR(import_->Commit());
    response_->set_sequence_id(import_->sequence_id());
    response_->set_num_tokens(import_->num_tokens());
    response_->set_num_pages(import_->num_pages());
    response_->set_bytes(bytes_);
    return absl::OkStatus();
  }

  void Done(const absl::Status& status) {
    import_.reset();  // an import not committed frees its pages and id here
    if (context_.metrics) {
      context_.metrics->ObserveRpc("ImportSequence", status.code(), SecondsSince(start_));
    }
    Finish(ToGrpcStatus(status));
  }

  const ServiceContext& context_;
  const Tenant tenant_;
  v1::ImportSequenceResponse* const response_;
  const Clock::time_point start_;
  v1::ImportSequenceRequest request_;
  std::unique_ptr<SequenceImport> import_;
  std::vector<bool> written_;  // [layer][pool][page]
  int64_t messages_ = 0;
  int64_t bytes_ = 0;
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

grpc::ServerUnaryReactor* AttentionService::ForkSequence(grpc::CallbackServerContext* ctx,
                                                         const v1::ForkSequenceRequest* request,
                                                         v1::ForkSequenceResponse* response) {
  const auto start = Clock::now();
  absl::Status status;
  if (absl::StatusOr<Tenant> tenant = context_.auth->Authenticate(*ctx); !tenant.ok()) {
    status = tenant.status();
  } else {
    ForkSpec spec;
    spec.cache = tenant->CacheKey(request->cache());
    spec.source_id = request->source_id();
    spec.new_id = request->new_id();
    spec.num_tokens = request->num_tokens();
    absl::StatusOr<ForkResult> forked = context_.engine->ForkSequence(spec);
    if (forked.ok()) {
      response->set_num_tokens(forked->num_tokens);
      response->set_shared_pages(forked->shared_pages);
    }
    status = tenant->Scrub(forked.status());
  }
  if (context_.metrics) context_.metrics->ObserveRpc("ForkSequence", status.code(), SecondsSince(start));
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
