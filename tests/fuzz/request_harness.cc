#include "request_harness.h"

#include <prometheus/metric_family.h>
#include <prometheus/registry.h>

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "backend/cpu_backend.h"
#include "backend/peer_access.h"
#include "channel/channel_layout.h"
#include "case_builder.h"
#include "engine/engine.h"
#include "metrics/metrics.h"
#include "service/attention_service.h"
#include "service/convert.h"
#include "service/sequence_transfer.h"

namespace attnd::fuzz {
namespace {

[[noreturn]] void Fail(const std::string& what) {
  std::fprintf(stderr, "attnd fuzz harness: invariant broken: %s\n", what.c_str());
  std::fflush(stderr);
  std::abort();
}

#define HARNESS_CHECK(condition, ...) \
  do {                                \
    if (!(condition)) Fail(absl::StrCat(#condition, ": ", __VA_ARGS__)); \
  } while (false)

// The fallback cache when the case's own is refused.
constexpr char kFallbackCache[] = "fuzz";
// Step ids 1..kCaseStepIds in a case name its plans in order (see fuzz_case.proto).
constexpr uint64_t kCaseStepIds = 16;
// Channel ids 1..kCaseChannelIds name the case's channels in order.
constexpr uint64_t kCaseChannelIds = 8;
// Layers whose attention would take longer than this many multiply-adds are not sent: an
// EXTERNAL entry's kv_len may reach the whole pool, and several entries may share its pages,
// and the point here is the request path, not the kernels' speed (the harness must stay fast
// enough to fuzz).
constexpr int64_t kMaxLayerWork = int64_t{1} << 25;
constexpr absl::Duration kStepTtl = absl::Hours(1);

int64_t PagesFor(int64_t tokens, int32_t page_size) { return (tokens + page_size - 1) / page_size; }

// Bytes of every pool of one cache, index layer * 2 + (V pool ? 1 : 0).
struct PoolSnapshot {
  CacheGeometry geometry;
  std::vector<std::string> pools;
};

struct StepRecord {
  uint64_t id = 0;  // 0 when the plan was refused
  std::string cache;
  attnd::v1::PlanRequest request;
  attnd::v1::PlanResponse response;
};

// What a successful Forward may have written.
struct ForwardEffect {
  std::string cache;
  int32_t layer = 0;
  bool external = false;
  int64_t num_tokens = 0;
  std::set<std::pair<int64_t, int32_t>> k_slots, v_slots;  // EXTERNAL: (page, offset) written
  std::set<int32_t> offsets;                                // MANAGED: in-page offsets written
};

// One action's result as far as the invariants care.
struct ActionResult {
  bool ok = true;                      // the request succeeded (or was skipped)
  bool started_async = false;          // a layer may still be running
  std::optional<ForwardEffect> write;  // a successful synchronous Forward
  std::string what;                    // for messages
  // An import into this cache: it writes the pages it reserved (and frees them again when it
  // fails), so that cache's bytes may change; its counters are checked as any other's.
  std::string imported_cache = {};
  // An EndStep that commits a step early makes the copy-on-write copies of the layers the step
  // did not run: whole pages that become copies of others.
  bool may_copy_pages = false;
};

// Bytes of one token slot of one page, in either layout.
std::string SlotBytes(const std::string& pool, const CacheGeometry& g, bool v_pool,
                      int64_t page, int32_t slot) {
  const int64_t head_dim = v_pool ? g.v_head_dim : g.k_head_dim;
  const int64_t elem = DTypeBytes(g.kv_dtype);
  const int64_t page_bytes = v_pool ? g.VPageBytes() : g.KPageBytes();
  const size_t base = static_cast<size_t>(page * page_bytes);
  if (g.layout == KvLayout::kNHD) {
    const int64_t row = g.num_kv_heads * head_dim * elem;
    return pool.substr(base + slot * row, row);
  }
  std::string bytes;
  for (int32_t head = 0; head < g.num_kv_heads; ++head) {
    bytes += pool.substr(base + (int64_t{head} * g.page_size + slot) * head_dim * elem,
                         head_dim * elem);
  }
  return bytes;
}

}  // namespace

struct RequestHarness::State {
  std::unique_ptr<Metrics> metrics;
  std::unique_ptr<Backend> backend;
  std::unique_ptr<Engine> engine;
  ServiceContext context;
  // Every request runs as the anonymous tenant, as on a server without a token file.
  Tenant tenant;
  // ATTND_FUZZ_VERBOSE=1: one line per request (for reading what a crashing input does).
  const bool verbose = std::getenv("ATTND_FUZZ_VERBOSE") != nullptr;
  uint64_t next_owner_base = 1;

  // Per case.
  uint64_t owner_base = 0;
  std::set<uint64_t> owners;
  std::vector<StepRecord> steps;
  std::vector<uint64_t> channels;  // engine ids of the channels this case opened (0: refused)
  // The HOST_SHM rings of this case's channels, mapped as a client maps them: the harness
  // plays the client of exports and imports through a channel.
  struct MappedRing {
    uint8_t* data = nullptr;
    int64_t bytes = 0;
    std::shared_ptr<const ChannelLayout> layout;
  };
  std::map<uint64_t, MappedRing> rings;
  std::map<std::string, std::set<uint64_t>> sequences;  // MANAGED ids planned, per cache
  // A fork succeeded in this case: sequences may share pages (used pages count them once), and
  // a Forward may copy a shared page before writing it.
  bool forked = false;

  absl::Mutex mu;
  int async_in_flight ABSL_GUARDED_BY(mu) = 0;

  int AsyncInFlight() {
    absl::MutexLock lock(&mu);
    return async_in_flight;
  }
  void WaitAsync() {
    absl::MutexLock lock(&mu);
    auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { return async_in_flight == 0; };
    mu.Await(absl::Condition(&idle));
  }

  uint64_t MapStepId(uint64_t id) const {
    if (id >= 1 && id <= kCaseStepIds && id <= steps.size()) return steps[id - 1].id;
    return id;
  }
  uint64_t MapChannelId(uint64_t id) const {
    if (id >= 1 && id <= kCaseChannelIds && id <= channels.size()) return channels[id - 1];
    return id;
  }
  const StepRecord* FindStep(uint64_t engine_id) const {
    if (engine_id == 0) return nullptr;
    for (const StepRecord& step : steps) {
      if (step.id == engine_id) return &step;
    }
    return nullptr;
  }

  // --- requests, as the handlers run them -------------------------------------------------

  absl::Status CreateCache(const attnd::v1::CreateCacheRequest& request) {
    auto spec = CacheSpecFromProto(request);
    if (!spec.ok()) return spec.status();
    auto status = engine->CreateCache(*spec);
    if (!status.ok()) return status.status();
    attnd::v1::CreateCacheResponse response;
    CacheStatusToProto(*status, response.mutable_cache());
    HARNESS_CHECK(response.cache().used_pages() == 0 && response.cache().open_steps() == 0,
                  "a new cache reports used pages or open steps");
    return absl::OkStatus();
  }

  ActionResult Plan(const attnd::v1::PlanRequest& original, uint64_t owner) {
    attnd::v1::PlanRequest request = original;
    request.set_channel_id(MapChannelId(original.channel_id()));
    StepRecord record;
    record.cache = request.cache();
    record.request = request;
    // Lengths before the plan, to check the start positions it returns; only while no layer
    // is in flight, since one landing can commit a step between this read and the plan.
    std::vector<int64_t> lengths;
    auto cache = engine->GetCache(request.cache());
    const bool managed = cache.ok() && !cache->spec.external_pages;
    const bool check_starts = managed && AsyncInFlight() == 0;
    if (check_starts) {
      for (const attnd::v1::PlanEntry& entry : request.entries()) {
        // Where a step planned now starts: after the open steps' tokens (a chained plan, on
        // the same channel) or, when it has none, after the committed ones.
        auto length = engine->SequenceLength(request.cache(), entry.sequence_id(),
                                             /*pending=*/true);
        lengths.push_back(length.ok() ? *length : -1);
      }
    }
    const absl::Status status = HandlePlan(context, tenant, request, owner, &record.response);
    ActionResult result{status.ok(), false, std::nullopt, "Plan"};
    if (status.ok()) {
      record.id = record.response.step_id();
      HARNESS_CHECK(record.id != 0, "Plan returned step id 0");
      HARNESS_CHECK(record.response.entries_size() == request.entries_size(),
                    "Plan answered ", record.response.entries_size(), " entries for ",
                    request.entries_size());
      int64_t rows = 0;
      for (int i = 0; i < request.entries_size(); ++i) {
        const int32_t tokens = request.entries(i).num_new_tokens();
        HARNESS_CHECK(record.response.entries(i).row_offset() == rows, "entries[", i,
                      "].row_offset ", record.response.entries(i).row_offset(), ", expected ",
                      rows);
        if (managed && tokens > 0) {
          if (check_starts) {
            HARNESS_CHECK(record.response.entries(i).start_position() == lengths[i], "entries[",
                          i, "].start_position ", record.response.entries(i).start_position(),
                          " but the sequence had ", lengths[i], " tokens");
          }
          sequences[request.cache()].insert(request.entries(i).sequence_id());
        }
        rows += tokens;
      }
      HARNESS_CHECK(record.response.num_tokens() == rows, "num_tokens ",
                    record.response.num_tokens(), ", expected ", rows);
    }
    steps.push_back(std::move(record));
    return result;
  }

  ActionResult Forward(const attnd::v1::ForwardRequest& request, bool async) {
    auto mapped = std::make_shared<attnd::v1::ForwardRequest>(request);
    mapped->set_step_id(MapStepId(request.step_id()));
    ActionResult result{true, false, std::nullopt, "Forward"};
    const StepRecord* step = FindStep(mapped->step_id());
    std::optional<ForwardEffect> effect;
    if (step != nullptr) {
      auto cache = engine->GetCache(step->cache);
      if (cache.ok()) {
        const CacheGeometry& g = cache->spec.geometry;
        int64_t work = 0;
        for (int i = 0; i < step->request.entries_size(); ++i) {
          const attnd::v1::PlanEntry& entry = step->request.entries(i);
          if (entry.num_new_tokens() <= 0) continue;
          const int64_t kv_len = cache->spec.external_pages
                                     ? entry.pages().kv_len()
                                     : step->response.entries(i).start_position() +
                                           entry.num_new_tokens();
          work += entry.num_new_tokens() * kv_len * g.num_qo_heads *
                  (int64_t{g.k_head_dim} + g.v_head_dim);
        }
        if (work > kMaxLayerWork) return result;  // skipped, see kMaxLayerWork
        effect = ExpectedEffect(*step, *cache, mapped->layer());
      }
    }
    if (async) {
      {
        absl::MutexLock lock(&mu);
        ++async_in_flight;
      }
      auto response = std::make_shared<attnd::v1::ForwardResponse>();
      HandleForward(context, tenant, *mapped, response.get(), [this, mapped, response](absl::Status) {
        absl::MutexLock lock(&mu);
        --async_in_flight;
      });
      result.started_async = true;
      return result;
    }
    attnd::v1::ForwardResponse response;
    absl::Status status;
    absl::Notification done;
    HandleForward(context, tenant, *mapped, &response, [&](absl::Status s) {
      status = s;
      done.Notify();
    });
    done.WaitForNotification();
    result.ok = status.ok();
    if (!status.ok()) return result;
    HARNESS_CHECK(step != nullptr && effect.has_value(),
                  "Forward succeeded for step ", mapped->step_id(), " the case never planned");
    CheckForwardResponse(*step, *mapped, response);
    result.write = std::move(effect);
    return result;
  }

  ForwardEffect ExpectedEffect(const StepRecord& step, const CacheStatus& cache, int32_t layer) {
    ForwardEffect effect;
    effect.cache = step.cache;
    effect.layer = layer;
    effect.external = cache.spec.external_pages;
    effect.num_tokens = step.response.num_tokens();
    const int32_t page_size = cache.spec.geometry.page_size;
    for (int i = 0; i < step.request.entries_size(); ++i) {
      const attnd::v1::PlanEntry& entry = step.request.entries(i);
      const int32_t tokens = entry.num_new_tokens();
      if (tokens <= 0) continue;
      if (!effect.external) {
        const int64_t start = step.response.entries(i).start_position();
        for (int64_t t = 0; t < tokens; ++t) effect.offsets.insert((start + t) % page_size);
        continue;
      }
      const attnd::v1::ExternalPages& pages = entry.pages();
      for (int64_t position = pages.kv_len() - tokens; position < pages.kv_len(); ++position) {
        const int64_t index = position / page_size;
        const int32_t offset = static_cast<int32_t>(position % page_size);
        // A cache of this name recreated since the plan (other page size): the step was
        // aborted with the old cache and writes nothing, so it expects no slot.
        if (index < 0 || index >= pages.page_ids_size() ||
            (cache.spec.separate_kv && index >= pages.v_page_ids_size())) {
          continue;
        }
        effect.k_slots.insert({pages.page_ids(index), offset});
        effect.v_slots.insert(
            {cache.spec.separate_kv ? pages.v_page_ids(index) : pages.page_ids(index), offset});
      }
    }
    return effect;
  }

  void CheckForwardResponse(const StepRecord& step, const attnd::v1::ForwardRequest& request,
                            const attnd::v1::ForwardResponse& response) {
    if (request.use_channel()) {
      HARNESS_CHECK(step.request.channel_id() != 0,
                    "Forward{use_channel} succeeded for a step planned on no channel");
      HARNESS_CHECK(!response.has_o() && !response.has_lse(),
                    "Forward{use_channel} answered tensors; they belong in the slot");
      return;
    }
    HARNESS_CHECK(step.request.channel_id() == 0,
                  "a Forward with tensors succeeded for a step planned on a channel");
    auto cache = engine->GetCache(step.cache);
    if (!cache.ok()) return;  // force-deleted meanwhile
    const CacheGeometry& g = cache->spec.geometry;
    const int64_t rows = step.response.num_tokens();
    const attnd::v1::Tensor& o = response.o();
    HARNESS_CHECK(o.shape_size() == 3 && o.shape(0) == rows && o.shape(1) == g.num_qo_heads &&
                      o.shape(2) == g.k_head_dim,
                  "layer ", request.layer(), ": o has shape ", o.ShortDebugString());
    HARNESS_CHECK(static_cast<int64_t>(o.data().size()) ==
                      rows * g.num_qo_heads * g.k_head_dim * DTypeBytes(g.q_dtype),
                  "o carries ", o.data().size(), " bytes");
    if (step.request.options().return_lse()) {
      HARNESS_CHECK(response.lse().dtype() == attnd::v1::DTYPE_FLOAT32 &&
                        static_cast<int64_t>(response.lse().data().size()) ==
                            rows * g.num_qo_heads * 4,
                    "lse carries ", response.lse().data().size(), " bytes");
    }
  }

  ActionResult EndStep(const attnd::v1::EndStepRequest& request) {
    attnd::v1::EndStepRequest mapped = request;
    mapped.set_step_id(MapStepId(request.step_id()));
    attnd::v1::EndStepResponse response;
    absl::Status status;
    absl::Notification done;
    HandleEndStep(context, tenant, mapped, &response, [&](absl::Status s) {
      status = s;
      done.Notify();
    });
    done.WaitForNotification();
    // An abort that comes after the step committed reports COMMITTED (and changes nothing);
    // any other successful abort reports ABORTED.
    if (status.ok() && request.abort()) {
      HARNESS_CHECK(response.outcome() == attnd::v1::STEP_OUTCOME_ABORTED ||
                        response.outcome() == attnd::v1::STEP_OUTCOME_COMMITTED,
                    "EndStep{abort} succeeded with outcome ", response.outcome());
    }
    ActionResult result{status.ok(), false, std::nullopt, "EndStep"};
    result.may_copy_pages = true;
    return result;
  }

  ActionResult FreeSequences(const attnd::v1::FreeSequencesRequest& request) {
    const std::vector<uint64_t> ids(request.sequence_ids().begin(), request.sequence_ids().end());
    int64_t pages_held = 0;
    auto cache = engine->GetCache(request.cache());
    // As in Plan: a layer landing meanwhile may commit a step and change the lengths.
    const bool check_pages = cache.ok() && AsyncInFlight() == 0;
    if (check_pages) {
      for (const uint64_t id : ids) {
        auto length = engine->SequenceLength(request.cache(), id);
        if (length.ok()) pages_held += PagesFor(*length, cache->spec.geometry.page_size);
      }
    }
    auto freed = engine->FreeSequences(request.cache(), ids);
    if (freed.ok() && check_pages) {
      HARNESS_CHECK(forked ? *freed <= pages_held : *freed == pages_held, "FreeSequences freed ",
                    *freed, " pages; the sequences' lengths need ", pages_held);
      auto after = engine->GetCache(request.cache());
      HARNESS_CHECK(after.ok() && after->used_pages == cache->used_pages - *freed,
                    "used pages did not drop by the pages freed");
    }
    return {freed.ok(), false, std::nullopt, "FreeSequences"};
  }

  ActionResult Run(const Action& action) {
    const uint64_t owner = action.stream() == 0 ? 0 : owner_base + action.stream();
    if (owner != 0) owners.insert(owner);
    switch (action.request_case()) {
      case Action::kPlan:
        return Plan(action.plan(), owner);
      case Action::kForward:
        return Forward(action.forward(), action.async());
      case Action::kEndStep:
        return EndStep(action.end_step());
      case Action::kStreamRequest: {
        // As the ForwardStream reactor dispatches its messages.
        const attnd::v1::StreamRequest& message = action.stream_request();
        switch (message.request_case()) {
          case attnd::v1::StreamRequest::kPlan:
            return Plan(message.plan(), owner);
          case attnd::v1::StreamRequest::kForward:
            return Forward(message.forward(), action.async());
          case attnd::v1::StreamRequest::kEndStep:
            return EndStep(message.end_step());
          default:
            return {false, false, std::nullopt, "StreamRequest without a message"};
        }
      }
      case Action::kFreeSequences:
        return FreeSequences(action.free_sequences());
      case Action::kDeleteCache: {
        const absl::Status status =
            engine->DeleteCache(action.delete_cache().name(), action.delete_cache().force());
        if (status.ok()) {
          HARNESS_CHECK(!engine->GetCache(action.delete_cache().name()).ok(),
                        "cache '", action.delete_cache().name(), "' survived its deletion");
        }
        return {status.ok(), false, std::nullopt, "DeleteCache"};
      }
      case Action::kGetCache: {
        auto status = engine->GetCache(action.get_cache().name());
        if (status.ok()) {
          attnd::v1::GetCacheResponse response;
          CacheStatusToProto(*status, response.mutable_cache());
        }
        return {status.ok(), false, std::nullopt, "GetCache"};
      }
      case Action::kCreateCache:
        return {CreateCache(action.create_cache()).ok(), false, std::nullopt, "CreateCache"};
      case Action::kCloseStream:
        engine->AbortOwnedSteps(owner);
        return {true, false, std::nullopt, "CloseStream"};
      case Action::kExpireSteps:
        engine->ExpireSteps(absl::Now() + kStepTtl + absl::Seconds(1));
        return {true, false, std::nullopt, "ExpireSteps"};
      case Action::kOpenChannel: {
        auto spec = ChannelOpenSpecFromProto(action.open_channel());
        absl::StatusOr<ChannelStatus> opened =
            spec.ok() ? engine->OpenChannel(*spec, [](std::string) {})
                      : absl::StatusOr<ChannelStatus>(spec.status());
        if (channels.size() < kCaseChannelIds) channels.push_back(opened.ok() ? opened->id : 0);
        if (opened.ok() && opened->kind == ChannelKind::kHostShm) MapRing(*opened);
        // Issue 19's fields: a malformed client_pci_bus_id is refused by field whatever the
        // kind; the cpu backend opens HOST_SHM only (NCCL and CUDA_IPC: UNIMPLEMENTED), so
        // nothing it opens reports peer access or an NCCL id.
        const v1::OpenChannelRequest& open = action.open_channel();
        if (!open.client_pci_bus_id().empty() &&
            !NormalizePciBusId(open.client_pci_bus_id(), "client_pci_bus_id").ok()) {
          HARNESS_CHECK(opened.status().code() == absl::StatusCode::kInvalidArgument,
                        "OpenChannel with a malformed client_pci_bus_id answered ",
                        opened.status().ToString());
        }
        if (opened.ok()) {
          HARNESS_CHECK(opened->kind == ChannelKind::kHostShm && !opened->peer_access &&
                            opened->nccl_unique_id.empty(),
                        "the cpu backend opened a ", ChannelKindName(opened->kind),
                        " channel reporting peer access or an NCCL id");
        } else if (open.kind() == v1::CHANNEL_KIND_NCCL &&
                   opened.status().code() != absl::StatusCode::kInvalidArgument &&
                   opened.status().code() != absl::StatusCode::kNotFound &&
                   opened.status().code() != absl::StatusCode::kResourceExhausted &&
                   opened.status().code() != absl::StatusCode::kUnavailable) {
          HARNESS_CHECK(opened.status().code() == absl::StatusCode::kUnimplemented,
                        "an NCCL open on the cpu backend answered ", opened.status().ToString());
        }
        if (opened.ok()) {
          HARNESS_CHECK(opened->layout != nullptr &&
                            opened->layout->ring_bytes > 0 &&
                            static_cast<int32_t>(opened->layout->slots.size()) ==
                                opened->num_slots,
                        "an open channel without a consistent layout");
        }
        return {opened.ok(), false, std::nullopt, "OpenChannel"};
      }
      case Action::kCloseChannel: {
        const absl::Status closed = engine->CloseChannel(
            MapChannelId(action.close_channel().channel_id()), tenant.name, "fuzz");
        return {closed.ok(), false, std::nullopt, "CloseChannel"};
      }
      case Action::kListCaches: {
        attnd::v1::ListCachesResponse response;
        for (const CacheStatus& status : engine->ListCaches()) {
          CacheStatusToProto(status, response.add_caches());
        }
        return {true, false, std::nullopt, "ListCaches"};
      }
      case Action::kForkSequence:
        return ForkSequence(action.fork_sequence());
      case Action::kExportImport:
        return ExportImport(action.export_import());
      case Action::kImportStream:
        return ImportStream(action.import_stream());
      case Action::REQUEST_NOT_SET:
        break;
    }
    return {false, false, std::nullopt, "empty action"};
  }

  ActionResult ForkSequence(const attnd::v1::ForkSequenceRequest& request) {
    attnd::v1::ForkSequenceResponse response;
    auto source_length = engine->SequenceLength(request.cache(), request.source_id());
    const absl::Status status = HandleForkSequence(context, tenant, request, &response);
    if (status.ok()) {
      forked = true;
      sequences[request.cache()].insert(request.new_id());
      auto cache = engine->GetCache(request.cache());
      HARNESS_CHECK(cache.ok() && source_length.ok(), "a fork of a cache that is not there");
      const int64_t tokens = request.num_tokens() == 0 ? *source_length : request.num_tokens();
      HARNESS_CHECK(response.num_tokens() == tokens, "ForkSequence answered ",
                    response.num_tokens(), " tokens, expected ", tokens);
      HARNESS_CHECK(response.shared_pages() == PagesFor(tokens, cache->spec.geometry.page_size),
                    "ForkSequence shares ", response.shared_pages(), " pages for ", tokens,
                    " tokens");
      auto length = engine->SequenceLength(request.cache(), request.new_id());
      HARNESS_CHECK(length.ok() && *length == tokens, "the fork has ",
                    length.ok() ? *length : -1, " tokens, expected ", tokens);
    }
    return {status.ok(), false, std::nullopt, "ForkSequence"};
  }

  void MapRing(const ChannelStatus& opened) {
    const int fd = shm_open(opened.shm_name.c_str(), O_RDWR, 0);
    HARNESS_CHECK(fd >= 0, "cannot open the ring of channel ", opened.id);
    void* mapped = mmap(nullptr, opened.layout->ring_bytes, PROT_READ | PROT_WRITE, MAP_SHARED,
                        fd, 0);
    close(fd);
    HARNESS_CHECK(mapped != MAP_FAILED, "cannot map the ring of channel ", opened.id);
    rings[opened.id] = {static_cast<uint8_t*>(mapped), opened.layout->ring_bytes, opened.layout};
  }

  void UnmapRings() {
    for (auto& [id, ring] : rings) munmap(ring.data, ring.bytes);
    rings.clear();
  }

  static std::atomic_ref<uint32_t> Flag(const MappedRing& ring, int64_t offset) {
    return std::atomic_ref<uint32_t>(*reinterpret_cast<uint32_t*>(ring.data + offset));
  }

  // An export's chunk through a channel, as the client takes it: the descriptor must name the
  // region of its turn and hold the bytes of its CRC; the bytes become the chunk's data, and
  // the region is acknowledged.
  void TakeFromRing(const MappedRing& ring, size_t index, attnd::v1::SequenceChunk& chunk) {
    const ChannelLayout& layout = *ring.layout;
    const int32_t region = static_cast<int32_t>(index % layout.num_slots);
    HARNESS_CHECK(chunk.data().empty() && chunk.ring_offset() == layout.TransferRegion(region) &&
                      chunk.ring_bytes() > 0 && chunk.ring_bytes() <= layout.slot_bytes &&
                      chunk.channel_sequence() == index + 1,
                  "export chunk ", index, " names ring bytes [", chunk.ring_offset(), ", +",
                  chunk.ring_bytes(), ") as sequence ", chunk.channel_sequence(),
                  ", not region ", region, "'s");
    chunk.set_data(std::string(reinterpret_cast<const char*>(ring.data + chunk.ring_offset()),
                               chunk.ring_bytes()));
    HARNESS_CHECK(chunk.crc32() == ChunkCrc32(chunk.data().data(), chunk.data().size()),
                  "an exported chunk's crc32 does not match its ring bytes");
    Flag(ring, layout.transfer[region]).store(chunk.channel_sequence(), std::memory_order_release);
    chunk.clear_ring_offset();
    chunk.clear_ring_bytes();
    chunk.clear_channel_sequence();
  }

  // Runs one import's messages through a SequenceImporter (as the ImportSequence reactor does).
  // With `ring` (the channel messages[0] names), chunks with data that fit a region go through
  // it: written into the next region, sent as descriptors, and attnd must have acknowledged
  // each by the time Receive returns.
  absl::StatusOr<attnd::v1::ImportSequenceResponse> RunImport(
      const std::vector<attnd::v1::ImportSequenceRequest>& messages, bool abandon,
      const MappedRing* ring = nullptr) {
    SequenceImporter importer(context, tenant);
    if (ring != nullptr) {
      for (const int64_t flag : ring->layout->transfer) Flag(*ring, flag).store(0);
    }
    uint32_t sequence = 0;
    for (const attnd::v1::ImportSequenceRequest& original : messages) {
      attnd::v1::ImportSequenceRequest message = original;
      int32_t region = -1;
      if (ring != nullptr && message.has_chunk() && !message.chunk().data().empty() &&
          static_cast<int64_t>(message.chunk().data().size()) <= ring->layout->slot_bytes) {
        attnd::v1::SequenceChunk& chunk = *message.mutable_chunk();
        region = static_cast<int32_t>(sequence % ring->layout->num_slots);
        const int64_t offset = ring->layout->TransferRegion(region);
        std::memcpy(ring->data + offset, chunk.data().data(), chunk.data().size());
        chunk.set_ring_offset(offset);
        chunk.set_ring_bytes(static_cast<int64_t>(chunk.data().size()));
        chunk.set_channel_sequence(++sequence);
        chunk.clear_data();
      }
      const absl::Status received = importer.Receive(message);
      if (!received.ok()) return received;
      if (region >= 0) {
        HARNESS_CHECK(Flag(*ring, ring->layout->transfer[region]).load() == sequence,
                      "an imported chunk's region was not acknowledged");
      }
    }
    if (abandon) return absl::CancelledError("abandoned");
    return importer.Finish();
  }

  // The chunks' bytes of each (layer, pool), in page order (chunks come in (layer, pool, page)
  // order, each page once: checked).
  static std::map<std::pair<int32_t, int32_t>, std::string> PoolBytes(
      const std::vector<attnd::v1::ImportSequenceRequest>& messages) {
    std::map<std::pair<int32_t, int32_t>, std::string> pools;
    std::map<std::pair<int32_t, int32_t>, int64_t> next_page;
    for (const attnd::v1::ImportSequenceRequest& message : messages) {
      if (!message.has_chunk()) continue;
      const attnd::v1::SequenceChunk& chunk = message.chunk();
      const std::pair<int32_t, int32_t> key{chunk.layer(), chunk.pool()};
      int64_t& next = next_page[key];
      HARNESS_CHECK(chunk.first_page() == next, "an export's chunk of layer ", chunk.layer(),
                    " pool ", chunk.pool(), " starts at page ", chunk.first_page(), ", not ",
                    next);
      next += chunk.num_pages();
      pools[key] += chunk.data();
    }
    return pools;
  }

  // The chunk messages (all but the first), serialized and sorted: equal for two imports that
  // send the same chunks in another order.
  static std::vector<std::string> SortedChunks(
      const std::vector<attnd::v1::ImportSequenceRequest>& messages) {
    std::vector<std::string> chunks;
    for (size_t i = 1; i < messages.size(); ++i) chunks.push_back(messages[i].SerializeAsString());
    std::sort(chunks.begin(), chunks.end());
    return chunks;
  }

  ActionResult ExportImport(const ExportImport& action) {
    ActionResult result{false, false, std::nullopt, "ExportImport"};
    result.imported_cache = action.target_cache();
    attnd::v1::ExportSequenceRequest export_request = action.export_();
    // Small chunks, so that a sequence spans several and the damage has somewhere to go.
    if (export_request.max_chunk_bytes() > (int64_t{1} << 20)) {
      export_request.set_max_chunk_bytes(int64_t{1} << 20);
    }
    export_request.set_channel_id(MapChannelId(export_request.channel_id()));
    const auto export_ring = rings.find(export_request.channel_id());
    std::vector<attnd::v1::ImportSequenceRequest> messages;
    {
      auto exporter = SequenceExporter::Start(context, tenant, export_request);
      if (!exporter.ok()) return result;
      const attnd::v1::SequenceHeader& header = (*exporter)->header().header();
      auto length = engine->SequenceLength(export_request.cache(), export_request.sequence_id());
      HARNESS_CHECK(length.ok() && header.num_tokens() == *length, "export header says ",
                    header.num_tokens(), " tokens");
      messages.emplace_back().set_allocated_header(new attnd::v1::SequenceHeader(header));
      attnd::v1::ExportSequenceResponse chunk;
      const bool through = (*exporter)->through_channel();
      HARNESS_CHECK(!through || export_ring != rings.end(),
                    "an export went through a channel this case did not open");
      for (size_t index = 0;; ++index) {
        // The harness acknowledges every region at once, so the next one is always free.
        absl::StatusOr<bool> ready = (*exporter)->Ready();
        HARNESS_CHECK(ready.ok() && *ready, "an export's next region is not free: ",
                      ready.status().message());
        absl::StatusOr<bool> more = (*exporter)->Next(chunk);
        HARNESS_CHECK(more.ok(), "an export failed mid-stream: ", more.status().message());
        if (!*more) break;
        if (through) TakeFromRing(export_ring->second, index, *chunk.mutable_chunk());
        HARNESS_CHECK(chunk.chunk().crc32() ==
                          ChunkCrc32(chunk.chunk().data().data(), chunk.chunk().data().size()),
                      "an exported chunk's crc32 does not match its data");
        *messages.emplace_back().mutable_chunk() = chunk.chunk();
      }
      HARNESS_CHECK(static_cast<int64_t>(messages.size()) == header.num_chunks() + 1,
                    "the export sent ", messages.size() - 1, " chunks, its header says ",
                    header.num_chunks());
    }  // the export's pins go here
    const std::vector<attnd::v1::ImportSequenceRequest> original = messages;
    const size_t count = messages.size();
    if (action.corrupt_message() >= 1 && action.corrupt_message() <= count) {
      attnd::v1::ImportSequenceRequest& message = messages[action.corrupt_message() - 1];
      if (message.has_chunk()) {
        std::string* data = message.mutable_chunk()->mutable_data();
        if (data->empty()) {
          message.mutable_chunk()->set_crc32(message.chunk().crc32() ^ 1);
        } else {
          (*data)[action.corrupt_byte() % data->size()] ^=
              static_cast<char>(1 << (action.corrupt_byte() % 8));
        }
      }
    }
    if (action.repeat_message() >= 2 && action.repeat_message() <= count) {
      messages.push_back(messages[action.repeat_message() - 1]);
    }
    if (action.drop_message() >= 1 && action.drop_message() <= count) {
      messages.erase(messages.begin() + (action.drop_message() - 1));
    }
    // Damaged: anything but the header first and then every exported chunk exactly once, as it
    // was exported, in any order (an import takes chunks in any order, so a repeated chunk
    // whose first copy was dropped is only a reordering).
    if (messages.empty()) return result;
    const bool damaged = messages[0].SerializeAsString() != original[0].SerializeAsString() ||
                         SortedChunks(messages) != SortedChunks(original);
    messages[0].set_cache(action.target_cache());
    messages[0].set_sequence_id(action.new_id());
    const uint64_t import_channel = MapChannelId(action.import_channel_id());
    messages[0].set_channel_id(import_channel);
    const auto import_ring = rings.find(import_channel);
    const bool abandon = action.abandon_after() > 0;
    if (abandon && action.abandon_after() < messages.size()) messages.resize(action.abandon_after());
    absl::StatusOr<attnd::v1::ImportSequenceResponse> imported = RunImport(
        messages, abandon, import_ring == rings.end() ? nullptr : &import_ring->second);
    result.ok = imported.ok();
    HARNESS_CHECK(!damaged || !imported.ok(), "a damaged import succeeded");
    if (!imported.ok()) return result;
    const uint64_t id = imported->sequence_id();
    sequences[action.target_cache()].insert(id);
    // The imported sequence exports the same bytes.
    attnd::v1::ExportSequenceRequest again = export_request;
    again.set_cache(action.target_cache());
    again.set_sequence_id(id);
    again.clear_channel_id();  // compared as data; the channel path was checked above
    auto exporter = SequenceExporter::Start(context, tenant, again);
    HARNESS_CHECK(exporter.ok(), "the imported sequence does not export: ",
                  exporter.status().message());
    HARNESS_CHECK((*exporter)->header().header().num_tokens() ==
                      original[0].header().num_tokens(),
                  "the imported sequence has another length");
    // Compared page by page, not chunk by chunk: an export through a channel cuts its chunks at
    // the channel's region size, this one at max_chunk_bytes alone.
    std::vector<attnd::v1::ImportSequenceRequest> again_messages;
    attnd::v1::ExportSequenceResponse chunk;
    for (;;) {
      HARNESS_CHECK((*exporter)->Ready().value_or(false), "a gRPC-bytes export is not ready");
      absl::StatusOr<bool> more = (*exporter)->Next(chunk);
      HARNESS_CHECK(more.ok(), more.status().message());
      if (!*more) break;
      *again_messages.emplace_back().mutable_chunk() = chunk.chunk();
    }
    const std::map<std::pair<int32_t, int32_t>, std::string> exported_pools = PoolBytes(original);
    const std::map<std::pair<int32_t, int32_t>, std::string> imported_pools =
        PoolBytes(again_messages);
    HARNESS_CHECK(exported_pools.size() == imported_pools.size(), "the imported sequence exports ",
                  imported_pools.size(), " (layer, pool) spans, the original ",
                  exported_pools.size());
    for (const auto& [key, bytes] : exported_pools) {
      auto it = imported_pools.find(key);
      HARNESS_CHECK(it != imported_pools.end() && it->second == bytes, "layer ", key.first,
                    " pool ", key.second, " of the imported sequence differs from the exported one");
    }
    return result;
  }

  ActionResult ImportStream(const ImportStream& action) {
    ActionResult result{false, false, std::nullopt, "ImportStream"};
    std::vector<attnd::v1::ImportSequenceRequest> messages(action.messages().begin(),
                                                           action.messages().end());
    // Raw descriptors (SequenceChunk.ring_offset) as the fuzzer made them, against a real
    // channel when the first message names one of the case's.
    if (!messages.empty()) messages[0].set_channel_id(MapChannelId(messages[0].channel_id()));
    if (!messages.empty()) result.imported_cache = messages[0].cache();
    absl::StatusOr<attnd::v1::ImportSequenceResponse> imported =
        RunImport(messages, action.abandon());
    result.ok = imported.ok();
    if (imported.ok()) sequences[messages[0].cache()].insert(imported->sequence_id());
    return result;
  }

  // --- invariants -------------------------------------------------------------------------

  std::map<std::string, PoolSnapshot> SnapshotPools() {
    std::map<std::string, PoolSnapshot> snapshots;
    for (const CacheStatus& cache : engine->ListCaches()) {
      PoolSnapshot& snapshot = snapshots[cache.spec.name];
      snapshot.geometry = cache.spec.geometry;
      const CacheGeometry& g = snapshot.geometry;
      for (int32_t layer = 0; layer < g.num_layers; ++layer) {
        for (const bool v_pool : {false, true}) {
          const int64_t page_bytes = v_pool ? g.VPageBytes() : g.KPageBytes();
          std::string& bytes = snapshot.pools.emplace_back(g.num_pages * page_bytes, '\0');
          const absl::Status read = engine->ReadPages(
              cache.spec.name, layer, v_pool, 0,
              std::span<uint8_t>(reinterpret_cast<uint8_t*>(bytes.data()), bytes.size()));
          HARNESS_CHECK(read.ok(), "ReadPages of cache '", cache.spec.name, "': ",
                        read.message());
        }
      }
    }
    return snapshots;
  }

  void CheckPools(const std::map<std::string, PoolSnapshot>& before,
                  const std::map<std::string, PoolSnapshot>& after, const ActionResult& result) {
    for (const auto& [name, now] : after) {
      if (name == result.imported_cache) continue;
      auto was = before.find(name);
      const CacheGeometry& g = now.geometry;
      if (was == before.end() || was->second.pools.size() != now.pools.size()) {
        for (const std::string& pool : now.pools) {
          HARNESS_CHECK(pool.find_first_not_of('\0') == std::string::npos,
                        "new cache '", name, "' has non-zero pool bytes");
        }
        continue;
      }
      for (size_t index = 0; index < now.pools.size(); ++index) {
        const std::string& old_bytes = was->second.pools[index];
        const std::string& new_bytes = now.pools[index];
        if (old_bytes == new_bytes) continue;
        const int32_t layer = static_cast<int32_t>(index / 2);
        const bool v_pool = index % 2 == 1;
        const std::string where = absl::StrCat("cache '", name, "' layer ", layer,
                                               v_pool ? " V" : " K", " pool");
        if (!result.write.has_value() && result.may_copy_pages && forked &&
            OnlyWholePageCopies(old_bytes, new_bytes, g, v_pool)) {
          continue;
        }
        HARNESS_CHECK(result.write.has_value() && result.write->cache == name &&
                          result.write->layer == layer,
                      where, " changed by ", result.what, result.ok ? "" : " (which failed)");
        const ForwardEffect& effect = *result.write;
        const int64_t head_dim = v_pool ? g.v_head_dim : g.k_head_dim;
        const int64_t elem = DTypeBytes(g.kv_dtype);
        const int64_t page_bytes = v_pool ? g.VPageBytes() : g.KPageBytes();
        std::set<std::pair<int64_t, int32_t>> changed;
        for (size_t offset = 0; offset < new_bytes.size(); ++offset) {
          if (old_bytes[offset] == new_bytes[offset]) continue;
          const int64_t page = static_cast<int64_t>(offset) / page_bytes;
          const int64_t within = static_cast<int64_t>(offset) % page_bytes;
          const int32_t slot =
              g.layout == KvLayout::kNHD
                  ? static_cast<int32_t>(within / (g.num_kv_heads * head_dim * elem))
                  : static_cast<int32_t>((within / (head_dim * elem)) % g.page_size);
          changed.insert({page, slot});
        }
        if (effect.external) {
          const auto& allowed = v_pool ? effect.v_slots : effect.k_slots;
          for (const auto& [page, slot] : changed) {
            HARNESS_CHECK(allowed.contains({page, slot}), where, ": page ", page, " slot ",
                          slot, " written, not a new token's slot of the step");
          }
        } else {
          // After a fork, a page may also be a copy-on-write copy: then it holds another
          // page's bytes as they were before the step, except at the new tokens' offsets. Each
          // changed page is compared with its own old bytes and, after a fork, with every other
          // page's: the closest match says which slots the step wrote.
          std::map<int64_t, std::set<int32_t>> by_page;
          for (const auto& [page, slot] : changed) by_page[page].insert(slot);
          int64_t written = 0;
          for (const auto& [page, slots] : by_page) {
            std::set<int32_t> best = slots;  // against the page's own old bytes
            bool best_allowed = std::all_of(slots.begin(), slots.end(), [&](int32_t slot) {
              return effect.offsets.contains(slot);
            });
            for (int64_t source = 0; forked && source < g.num_pages; ++source) {
              if (source == page) continue;
              std::set<int32_t> differing;
              bool copy = true;
              for (int32_t slot = 0; slot < g.page_size && copy; ++slot) {
                if (SlotBytes(new_bytes, g, v_pool, page, slot) ==
                    SlotBytes(old_bytes, g, v_pool, source, slot)) {
                  continue;
                }
                copy = effect.offsets.contains(slot);
                differing.insert(slot);
              }
              if (copy && (!best_allowed || differing.size() < best.size())) {
                best = std::move(differing);
                best_allowed = true;
              }
            }
            HARNESS_CHECK(best_allowed, where, ": page ", page, " slot ", *slots.begin(),
                          " written, no new token of the step sits at that offset (nor is the "
                          "page a copy of another)");
            written += static_cast<int64_t>(best.size());
          }
          HARNESS_CHECK(written <= effect.num_tokens, where, ": ", written,
                        " slots written by a step of ", effect.num_tokens, " new tokens");
        }
      }
    }
  }

  // Whether every page that differs between the two snapshots of one pool now holds, whole,
  // what another page held before.
  static bool OnlyWholePageCopies(const std::string& old_bytes, const std::string& new_bytes,
                                  const CacheGeometry& g, bool v_pool) {
    const int64_t page_bytes = v_pool ? g.VPageBytes() : g.KPageBytes();
    for (int64_t page = 0; page < g.num_pages; ++page) {
      const std::string now = new_bytes.substr(page * page_bytes, page_bytes);
      if (now == old_bytes.substr(page * page_bytes, page_bytes)) continue;
      bool copy = false;
      for (int64_t source = 0; source < g.num_pages && !copy; ++source) {
        copy = source != page && now == old_bytes.substr(source * page_bytes, page_bytes);
      }
      if (!copy) return false;
    }
    return true;
  }

  // Failed requests change nothing: compared on every cache's counters.
  struct Counters {
    int64_t used_pages = 0;
    int64_t num_sequences = 0;
    int32_t open_steps = 0;
    bool operator==(const Counters&) const = default;
  };
  std::map<std::string, Counters> CountersOfCaches() {
    std::map<std::string, Counters> counters;
    for (const CacheStatus& cache : engine->ListCaches()) {
      counters[cache.spec.name] = {cache.used_pages, cache.num_sequences, cache.open_steps};
      HARNESS_CHECK(cache.used_pages >= 0 && cache.used_pages <= cache.spec.geometry.num_pages,
                    "cache '", cache.spec.name, "' uses ", cache.used_pages, " of ",
                    cache.spec.geometry.num_pages, " pages");
      HARNESS_CHECK(cache.open_steps >= 0, "negative open steps");
    }
    return counters;
  }

  // The allocator's gauges as Prometheus would scrape them.
  std::pair<double, double> PageGauges(const std::string& cache) {
    double used = -1, free = -1;
    for (const prometheus::MetricFamily& family : metrics->registry()->Collect()) {
      if (family.name != "attnd_kv_pages") continue;
      for (const prometheus::ClientMetric& metric : family.metric) {
        std::string cache_label, state;
        for (const prometheus::ClientMetric::Label& label : metric.label) {
          if (label.name == "cache") cache_label = label.value;
          if (label.name == "state") state = label.value;
        }
        if (cache_label != cache) continue;
        if (state == "used") used = metric.gauge.value;
        if (state == "free") free = metric.gauge.value;
      }
    }
    return {used, free};
  }

  // Ends everything the case left open and checks that nothing leaked.
  void EndCase() {
    WaitAsync();
    for (const uint64_t owner : owners) engine->AbortOwnedSteps(owner);
    for (const StepRecord& step : steps) {
      if (step.id == 0) continue;
      absl::Notification done;
      engine->EndStep(step.id, /*abort=*/true, [&](absl::StatusOr<EndStepResult>) { done.Notify(); });
      done.WaitForNotification();
    }
    engine->ExpireSteps(absl::InfiniteFuture());
    HARNESS_CHECK(engine->OpenSteps() == 0, engine->OpenSteps(),
                  " steps still open after every step of the case was ended");

    for (const CacheStatus& cache : engine->ListCaches()) {
      const std::string& name = cache.spec.name;
      HARNESS_CHECK(cache.open_steps == 0, "cache '", name, "' counts ", cache.open_steps,
                    " open steps with none open in the engine");
      if (!cache.spec.external_pages) {
        const int32_t page_size = cache.spec.geometry.page_size;
        int64_t pages_needed = 0;
        int64_t live = 0;
        std::vector<uint64_t> ids;
        for (const uint64_t id : sequences[name]) {
          auto length = engine->SequenceLength(name, id);
          HARNESS_CHECK(length.ok(), length.status().message());
          if (*length == 0) continue;
          pages_needed += PagesFor(*length, page_size);
          ++live;
          ids.push_back(id);
        }
        // Forks share pages: counted once.
        HARNESS_CHECK(forked ? cache.used_pages <= pages_needed : cache.used_pages == pages_needed,
                      "cache '", name, "' uses ", cache.used_pages,
                      " pages; its sequences' lengths need ", pages_needed);
        HARNESS_CHECK(cache.num_sequences == live, "cache '", name, "' counts ",
                      cache.num_sequences, " sequences, ", live, " have tokens");
        const auto [used_gauge, free_gauge] = PageGauges(name);
        HARNESS_CHECK(used_gauge == static_cast<double>(cache.used_pages) &&
                          used_gauge + free_gauge ==
                              static_cast<double>(cache.spec.geometry.num_pages),
                      "attnd_kv_pages of '", name, "': used ", used_gauge, " free ", free_gauge,
                      ", expected ", cache.used_pages, " of ", cache.spec.geometry.num_pages);
        auto freed = engine->FreeSequences(name, ids);
        HARNESS_CHECK(freed.ok() && *freed == cache.used_pages, "freeing every sequence of '",
                      name, "': ", freed.status().message(), " (freed ",
                      freed.ok() ? *freed : -1, " of ", cache.used_pages, " used pages)");
        auto after = engine->GetCache(name);
        HARNESS_CHECK(after.ok() && after->used_pages == 0 && after->num_sequences == 0 &&
                          after->shared_pages == 0,
                      "cache '", name, "' holds pages after every sequence was freed");
      }
      const absl::Status deleted = engine->DeleteCache(name, /*force=*/false);
      HARNESS_CHECK(deleted.ok(), "deleting '", name, "' with no open step: ", deleted.message());
    }
    HARNESS_CHECK(engine->ListCaches().empty(), "caches left after deleting them all");
    // A pool goes when the last running layer drops its cache, on a backend thread.
    const absl::Time deadline = absl::Now() + absl::Seconds(10);
    while (backend->KvFreeBytes() != kHarnessKvBudgetBytes && absl::Now() < deadline) {
      absl::SleepFor(absl::Milliseconds(1));
    }
    HARNESS_CHECK(backend->KvFreeBytes() == kHarnessKvBudgetBytes, "KV budget leaked: ",
                  backend->KvFreeBytes(), " of ", kHarnessKvBudgetBytes, " bytes free");
    HARNESS_CHECK(engine->OpenChannels() == 0, engine->OpenChannels(),
                  " channels open after every cache was deleted");
    owners.clear();
    steps.clear();
    channels.clear();
    UnmapRings();
    sequences.clear();
    forked = false;
  }
};

RequestHarness::RequestHarness() : state_(std::make_unique<State>()) {
  State& s = *state_;
  s.metrics = std::make_unique<Metrics>(Metrics::BuildInfo{"fuzz", "cpu", "cpu"});
  CpuBackendOptions backend_options;
  backend_options.kv_budget_bytes = kHarnessKvBudgetBytes;
  backend_options.num_workers = 2;
  backend_options.observer = s.metrics.get();
  s.backend = MakeCpuBackend(backend_options);
  EngineOptions engine_options;
  engine_options.step_ttl = kStepTtl;
  // Small limits so that every limit can be hit.
  engine_options.limits.max_plan_entries = 32;
  engine_options.limits.max_step_tokens = 256;
  engine_options.limits.max_open_steps = 8;
  // Rings of a few channels at most: the fuzzer opens them in every other case.
  engine_options.limits.max_channel_bytes = int64_t{16} << 20;
  engine_options.limits.max_channels = 4;
  s.engine = std::make_unique<Engine>(engine_options, s.backend.get(), s.metrics.get());
  s.context.engine = s.engine.get();
  s.context.backend = s.backend.get();
  s.context.metrics = s.metrics.get();
  s.context.version = "fuzz";
  s.context.limits = engine_options.limits;
  s.context.step_ttl = kStepTtl;
}

RequestHarness::~RequestHarness() = default;

void RequestHarness::Run(const FuzzCase& fuzz_case) {
  State& s = *state_;
  s.owner_base = s.next_owner_base;
  s.next_owner_base += uint64_t{1} << 32;  // stream numbers are uint32: owners never collide
  if (!s.CreateCache(fuzz_case.cache()).ok()) {
    const absl::Status fallback = s.CreateCache(SmallCache(CacheVariant::kMhaManaged, kFallbackCache));
    HARNESS_CHECK(fallback.ok(), "the fallback cache: ", fallback.message());
  }
  for (const Action& action : fuzz_case.actions()) {
    const bool quiet = s.AsyncInFlight() == 0;
    std::map<std::string, PoolSnapshot> pools_before;
    std::map<std::string, State::Counters> counters_before;
    if (quiet) {
      pools_before = s.SnapshotPools();
      counters_before = s.CountersOfCaches();
    }
    const ActionResult result = s.Run(action);
    if (s.verbose) {
      std::fprintf(stderr, "  %s%s: %s\n", result.what.c_str(),
                   action.stream() != 0 ? " (stream)" : "", result.ok ? "ok" : "refused");
    }
    const std::map<std::string, State::Counters> counters_after = s.CountersOfCaches();
    if (!quiet || result.started_async) continue;
    s.CheckPools(pools_before, s.SnapshotPools(), result);
    if (!result.ok) {
      HARNESS_CHECK(counters_after == counters_before, "a failed ", result.what,
                    " changed a cache's used pages, sequences or open steps");
    }
  }
  s.EndCase();
}

void RequestHarness::RunRawBytes(const uint8_t* data, size_t size) {
  FuzzCase fuzz_case;
  attnd::v1::CreateCacheRequest create;
  if (create.ParseFromArray(data, static_cast<int>(size))) *fuzz_case.mutable_cache() = create;
  const std::string cache_name =
      CacheSpecFromProto(create).ok() ? create.name() : std::string(kFallbackCache);
  // Requests that name no cache are aimed at the case's cache, so the bytes reach the engine.
  attnd::v1::PlanRequest plan;
  if (plan.ParseFromArray(data, static_cast<int>(size))) {
    if (plan.cache().empty()) plan.set_cache(cache_name);
    *fuzz_case.add_actions()->mutable_plan() = plan;
  }
  attnd::v1::ForwardRequest forward;
  if (forward.ParseFromArray(data, static_cast<int>(size))) {
    *fuzz_case.add_actions()->mutable_forward() = forward;
  }
  attnd::v1::StreamRequest stream;
  if (stream.ParseFromArray(data, static_cast<int>(size))) {
    Action* action = fuzz_case.add_actions();
    action->set_stream(1);
    *action->mutable_stream_request() = stream;
  }
  attnd::v1::EndStepRequest end;
  if (end.ParseFromArray(data, static_cast<int>(size))) {
    *fuzz_case.add_actions()->mutable_end_step() = end;
  }
  attnd::v1::FreeSequencesRequest free_request;
  if (free_request.ParseFromArray(data, static_cast<int>(size))) {
    if (free_request.cache().empty()) free_request.set_cache(cache_name);
    *fuzz_case.add_actions()->mutable_free_sequences() = free_request;
  }
  attnd::v1::GetCacheRequest get;
  if (get.ParseFromArray(data, static_cast<int>(size))) {
    *fuzz_case.add_actions()->mutable_get_cache() = get;
  }
  attnd::v1::DeleteCacheRequest delete_request;
  if (delete_request.ParseFromArray(data, static_cast<int>(size))) {
    *fuzz_case.add_actions()->mutable_delete_cache() = delete_request;
  }
  attnd::v1::ForkSequenceRequest fork;
  if (fork.ParseFromArray(data, static_cast<int>(size))) {
    if (fork.cache().empty()) fork.set_cache(cache_name);
    *fuzz_case.add_actions()->mutable_fork_sequence() = fork;
  }
  attnd::v1::ImportSequenceRequest import;
  if (import.ParseFromArray(data, static_cast<int>(size))) {
    if (import.cache().empty()) import.set_cache(cache_name);
    *fuzz_case.add_actions()->mutable_import_stream()->add_messages() = import;
  }
  Run(fuzz_case);
}

void RunInput(RequestHarness& harness, const uint8_t* data, size_t size) {
  // Protobuf parses most well-formed wire data as any message (fields it does not know become
  // unknown fields), so a request's bytes often "parse" as an empty case: those go the raw way.
  FuzzCase fuzz_case;
  if (fuzz_case.ParseFromArray(data, static_cast<int>(size)) && fuzz_case.actions_size() > 0 &&
      fuzz_case.GetReflection()->GetUnknownFields(fuzz_case).empty()) {
    harness.Run(fuzz_case);
  } else {
    harness.RunRawBytes(data, size);
  }
}

}  // namespace attnd::fuzz
