// Sequence lifecycle beyond appending: ForkSequence (prefix pages shared by reference, the
// partial last page copied on write), ExportSequence (pinned pages read out) and ImportSequence
// (pages reserved, written, then published whole).
#include <algorithm>
#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"
#include "attnd/status_macros.h"
#include "engine/engine.h"
#include "engine/engine_state.h"

namespace attnd {
namespace {

int64_t PagesFor(int64_t tokens, int32_t page_size) {
  return (tokens + page_size - 1) / page_size;
}

// A usable cache (UsableCacheLocked's answer) that is MANAGED.
absl::StatusOr<std::shared_ptr<CacheEntry>> Managed(
    absl::StatusOr<std::shared_ptr<CacheEntry>> cache, const std::string& name) {
  if (cache.ok() && (*cache)->spec.external_pages) {
    return absl::FailedPreconditionError(absl::StrCat(
        "cache: '", name, "' uses EXTERNAL page tables; sequences live in the client's block "
        "manager"));
  }
  return cache;
}

// Why two caches' pools do not hold the same bytes for the same tokens: "" when they do.
std::string ShapeMismatch(const CacheGeometry& target, const CacheGeometry& source) {
  auto differs = [](const char* field, auto want, auto got) {
    return absl::StrCat(field, ": the target cache has ", want, ", the sequence ", got);
  };
  if (target.mla != source.mla) return differs("kind", target.mla ? "MLA" : "MHA", source.mla ? "MLA" : "MHA");
  if (target.num_layers != source.num_layers) {
    return differs("num_layers", target.num_layers, source.num_layers);
  }
  if (target.num_kv_heads != source.num_kv_heads) {
    return differs("num_kv_heads", target.num_kv_heads, source.num_kv_heads);
  }
  if (target.k_head_dim != source.k_head_dim) {
    return differs(target.mla ? "kv_lora_rank" : "head_dim", target.k_head_dim,
                   source.k_head_dim);
  }
  if (target.v_head_dim != source.v_head_dim) {
    return differs(target.mla ? "rope_dim" : "head_dim", target.v_head_dim, source.v_head_dim);
  }
  if (target.page_size != source.page_size) {
    return differs("page_size", target.page_size, source.page_size);
  }
  if (target.kv_dtype != source.kv_dtype) {
    return differs("kv_dtype", DTypeName(target.kv_dtype), DTypeName(source.kv_dtype));
  }
  if (target.layout != source.layout) {
    return differs("layout", target.layout == KvLayout::kNHD ? "NHD" : "HND",
                   source.layout == KvLayout::kNHD ? "NHD" : "HND");
  }
  if (target.k_scale != source.k_scale) return differs("k_scale", target.k_scale, source.k_scale);
  if (target.v_scale != source.v_scale) return differs("v_scale", target.v_scale, source.v_scale);
  // The stored keys are rotated: a cache that rotates differently would extend them wrongly.
  const RopeConfig& a = target.rope;
  const RopeConfig& b = source.rope;
  if (a.style != b.style || a.rotary_dim != b.rotary_dim || a.theta != b.theta ||
      a.scaling != b.scaling || a.factor != b.factor || a.low_freq_factor != b.low_freq_factor ||
      a.high_freq_factor != b.high_freq_factor ||
      a.original_max_position != b.original_max_position) {
    return "rope: the target cache rotates keys differently from the sequence's cache";
  }
  return "";
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Copy-on-write (called from Plan, and at commit from TryFinalizeLocked and FinalizeLocked)
// ---------------------------------------------------------------------------------------------

int64_t Engine::State::CopyOnWritePagesNeededLocked(const CacheEntry& cache,
                                                    const Sequence& sequence,
                                                    int32_t new_tokens) const {
  const int32_t page_size = cache.spec.geometry.page_size;
  if (new_tokens <= 0 || sequence.pending_length % page_size == 0 || sequence.pages.empty()) {
    return 0;
  }
  // The first new token lands in the last page, which holds earlier tokens of this sequence.
  // Only the first step of a chain can find it shared: a sequence in an open step is neither
  // forked nor exported, and its open steps' pages are their own.
  return cache.allocator->holders(sequence.pages.back()) > 1 ? 1 : 0;
}

void Engine::State::CopyOnWriteLocked(CacheEntry& cache, Sequence& sequence,
                                      SequenceChange& change, StepEntry& step, StepBatch& batch) {
  std::vector<int32_t> fresh;
  cache.allocator->Allocate(1, fresh);  // cannot fail: counted in the step's pages
  const int32_t shared = sequence.pages.back();
  sequence.pages.back() = fresh[0];
  change.replaced_page = shared;
  step.fresh_pages.push_back(fresh[0]);
  batch.page_copies.push_back({shared, fresh[0]});
}

void Engine::State::RestoreSequenceLocked(Sequence& sequence, const SequenceChange& change) {
  // Steps chained on top of this one rolled back first; a parent rolling back later shrinks
  // more: rollback only shrinks.
  sequence.pages.resize(std::min(sequence.pages.size(), change.old_num_pages));
  sequence.pending_length = std::min(sequence.pending_length, change.old_length);
  if (change.replaced_page >= 0 && sequence.pages.size() == change.old_num_pages) {
    sequence.pages.back() = change.replaced_page;
  }
}

void Engine::State::EndSequenceChangeLocked(CacheEntry& cache, const StepEntry& step,
                                            const SequenceChange& change, bool committed) {
  auto it = cache.sequences.find(change.sequence_id);
  if (it == cache.sequences.end()) return;
  Sequence& sequence = it->second;
  --sequence.open_steps;
  if (sequence.last_step.lock().get() == &step) sequence.last_step = change.previous_step;
  if (committed) {
    sequence.length = change.new_length;
    return;
  }
  RestoreSequenceLocked(sequence, change);
  if (sequence.open_steps == 0 && sequence.length == 0 && sequence.pages.empty()) {
    cache.sequences.erase(it);
  }
}

std::vector<int32_t> Engine::State::LayersToCopyAtCommitLocked(const CacheEntry& cache,
                                                               const StepEntry& step) const {
  std::vector<int32_t> layers;
  if (cache.allocator == nullptr || cache.failed || step.batch == nullptr ||
      step.batch->page_copies.empty()) {
    return layers;
  }
  for (size_t layer = 0; layer < step.layers.size(); ++layer) {
    if (step.layers[layer] != LayerState::kDone) layers.push_back(static_cast<int32_t>(layer));
  }
  return layers;
}

void Engine::State::ReleaseReplacedPagesLocked(CacheEntry& cache, const StepEntry& step) {
  for (const SequenceChange& change : step.changes) {
    if (change.replaced_page >= 0) {
      cache.allocator->Free(std::span<const int32_t>(&change.replaced_page, 1));
    }
  }
}

// ---------------------------------------------------------------------------------------------
// ForkSequence
// ---------------------------------------------------------------------------------------------

absl::StatusOr<ForkResult> Engine::ForkSequence(const ForkSpec& spec) {
  absl::MutexLock lock(&state_->mu);
  ASSIGN_OR_RETURN(const std::shared_ptr<CacheEntry> cache,
                   Managed(state_->UsableCacheLocked(spec.cache), spec.cache));
  auto source = cache->sequences.find(spec.source_id);
  if (source == cache->sequences.end()) {
    return absl::NotFoundError(absl::StrCat("source_id: cache '", spec.cache,
                                            "' has no sequence ", spec.source_id));
  }
  if (source->second.open_steps != 0) {
    const std::shared_ptr<StepEntry> step = source->second.last_step.lock();
    return absl::FailedPreconditionError(absl::StrCat(
        "source_id: sequence ", spec.source_id, " is in open step ", step ? step->id : 0,
        "; fork it once its steps have ended"));
  }
  if (cache->sequences.contains(spec.new_id) || cache->importing.contains(spec.new_id)) {
    return absl::AlreadyExistsError(absl::StrCat("new_id: cache '", spec.cache,
                                                 "' already has a sequence ", spec.new_id));
  }
  const int64_t length = source->second.length;
  if (spec.num_tokens < 0 || spec.num_tokens > length) {
    return absl::InvalidArgumentError(absl::StrCat(
        "num_tokens: expected 0 (all) to the source's length ", length, ", got ",
        spec.num_tokens));
  }
  const int64_t tokens = spec.num_tokens == 0 ? length : spec.num_tokens;
  const int64_t pages = PagesFor(tokens, cache->spec.geometry.page_size);
  const std::span<const int32_t> shared(source->second.pages.data(), pages);
  cache->allocator->Share(shared);
  // `source` may move when the map grows: the pages were copied out first.
  Sequence fork;
  fork.pages.assign(shared.begin(), shared.end());
  fork.length = tokens;
  fork.pending_length = tokens;
  cache->sequences.emplace(spec.new_id, std::move(fork));
  state_->PublishPagesLocked(*cache);
  return ForkResult{tokens, pages};
}

// ---------------------------------------------------------------------------------------------
// ExportSequence
// ---------------------------------------------------------------------------------------------

absl::StatusOr<std::unique_ptr<SequenceExport>> Engine::ExportSequence(const std::string& name,
                                                                       uint64_t sequence_id) {
  absl::MutexLock lock(&state_->mu);
  ASSIGN_OR_RETURN(const std::shared_ptr<CacheEntry> cache, Managed(state_->UsableCacheLocked(name), name));
  auto sequence = cache->sequences.find(sequence_id);
  if (sequence == cache->sequences.end()) {
    return absl::NotFoundError(absl::StrCat("sequence_id: cache '", name, "' has no sequence ",
                                            sequence_id));
  }
  if (sequence->second.open_steps != 0) {
    const std::shared_ptr<StepEntry> step = sequence->second.last_step.lock();
    return absl::FailedPreconditionError(absl::StrCat(
        "sequence_id: sequence ", sequence_id, " is in open step ", step ? step->id : 0,
        "; export it once its steps have ended"));
  }
  std::unique_ptr<SequenceExport> exported(new SequenceExport());
  exported->state_ = state_.get();
  exported->cache_ = cache;
  exported->spec_ = cache->spec;
  exported->sequence_id_ = sequence_id;
  exported->num_tokens_ = sequence->second.length;
  exported->pages_ = sequence->second.pages;
  // Pinned: a step planned on the sequence meanwhile copies its partial page instead of
  // writing it, and freeing the sequence leaves the pages until the export ends.
  cache->allocator->Share(exported->pages_);
  state_->PublishPagesLocked(*cache);
  return exported;
}

SequenceExport::~SequenceExport() {
  if (state_ == nullptr) return;
  absl::MutexLock lock(&state_->mu);
  cache_->allocator->Free(pages_);
  state_->PublishPagesLocked(*cache_);
}

absl::Status SequenceExport::Read(int32_t layer, bool v_pool, int64_t first_page, int64_t count,
                                  std::span<uint8_t> bytes) const {
  if (first_page < 0 || count < 0 || first_page + count > num_pages()) {
    return absl::OutOfRangeError("export read: pages outside the sequence");
  }
  return cache_->backend->ReadPageList(
      layer, v_pool, std::span<const int32_t>(pages_.data() + first_page, count), bytes);
}

// ---------------------------------------------------------------------------------------------
// ImportSequence
// ---------------------------------------------------------------------------------------------

absl::StatusOr<std::unique_ptr<SequenceImport>> Engine::ImportSequence(
    const std::string& name, uint64_t sequence_id, int64_t num_tokens,
    const CacheGeometry& source) {
  absl::MutexLock lock(&state_->mu);
  if (state_->draining) {
    return absl::UnavailableError("server is draining: no new sequences are accepted");
  }
  ASSIGN_OR_RETURN(const std::shared_ptr<CacheEntry> cache, Managed(state_->UsableCacheLocked(name), name));
  if (const std::string mismatch = ShapeMismatch(cache->spec.geometry, source);
      !mismatch.empty()) {
    return absl::FailedPreconditionError(absl::StrCat("header.config.", mismatch));
  }
  if (num_tokens < 1 || num_tokens > std::numeric_limits<int32_t>::max()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "header.num_tokens: expected 1 to ", std::numeric_limits<int32_t>::max(), ", got ",
        num_tokens));
  }
  if (cache->sequences.contains(sequence_id) || cache->importing.contains(sequence_id)) {
    return absl::AlreadyExistsError(absl::StrCat("sequence_id: cache '", name,
                                                 "' already has a sequence ", sequence_id));
  }
  const int64_t pages = PagesFor(num_tokens, cache->spec.geometry.page_size);
  std::unique_ptr<SequenceImport> imported(new SequenceImport());
  if (!cache->allocator->Allocate(pages, imported->pages_)) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "header.num_pages: the sequence needs ", pages, " pages but cache '", name, "' has ",
        cache->allocator->free_pages(), " free of ", cache->spec.geometry.num_pages));
  }
  imported->state_ = state_.get();
  imported->cache_ = cache;
  imported->sequence_id_ = sequence_id;
  imported->num_tokens_ = num_tokens;
  cache->importing.insert(sequence_id);
  state_->PublishPagesLocked(*cache);
  return imported;
}

SequenceImport::~SequenceImport() {
  if (state_ == nullptr || committed_) return;
  absl::MutexLock lock(&state_->mu);
  cache_->importing.erase(sequence_id_);
  cache_->allocator->Free(pages_);
  state_->PublishPagesLocked(*cache_);
}

const CacheGeometry& SequenceImport::geometry() const { return cache_->spec.geometry; }

absl::Status SequenceImport::Write(int32_t layer, bool v_pool, int64_t first_page, int64_t count,
                                   std::span<const uint8_t> bytes) {
  if (committed_) return absl::FailedPreconditionError("import already committed");
  if (first_page < 0 || count < 0 || first_page + count > num_pages()) {
    return absl::OutOfRangeError("import write: pages outside the sequence");
  }
  return cache_->backend->WritePageList(
      layer, v_pool, std::span<const int32_t>(pages_.data() + first_page, count), bytes);
}

absl::Status SequenceImport::Commit() {
  absl::MutexLock lock(&state_->mu);
  if (committed_) return absl::FailedPreconditionError("import already committed");
  auto registered = state_->caches.find(cache_->spec.name);
  if (registered == state_->caches.end() || registered->second != cache_) {
    return absl::NotFoundError(absl::StrCat("cache: '", cache_->spec.name,
                                            "' was deleted during the import"));
  }
  if (cache_->failed) {
    return absl::InternalError(absl::StrCat("cache '", cache_->spec.name,
                                            "' failed: ", cache_->failure, "; delete it"));
  }
  cache_->importing.erase(sequence_id_);
  Sequence& sequence = cache_->sequences[sequence_id_];
  sequence.pages = pages_;
  sequence.length = num_tokens_;
  sequence.pending_length = num_tokens_;
  committed_ = true;
  return absl::OkStatus();
}

}  // namespace attnd
