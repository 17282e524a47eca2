// Engine::Plan: validate a batch against the cache, allocate its slots all-or-nothing, build
// the StepBatch once and let the backend plan it.
#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "attnd/status_macros.h"
#include "engine/engine.h"
#include "engine/engine_state.h"

namespace attnd {
namespace {

constexpr int64_t kMaxSequenceTokens = std::numeric_limits<int32_t>::max();

int64_t PagesFor(int64_t tokens, int32_t page_size) {
  return (tokens + page_size - 1) / page_size;
}

absl::Status ResolveOptions(const AttentionOptionsSpec& spec, const CacheSpec& cache,
                            StepOptions& options) {
  AttentionParams& params = options.params;
  params.causal = spec.causal.value_or(true);
  // MLA: DeepSeek's q/k width before absorption is 128 nope + 64 rope dims.
  const double default_scale =
      cache.geometry.mla ? 1.0 / std::sqrt(192.0) : 1.0 / std::sqrt(cache.geometry.k_head_dim);
  params.sm_scale = spec.sm_scale.value_or(static_cast<float>(default_scale));
  if (!std::isfinite(params.sm_scale) || params.sm_scale <= 0.0f) {
    return absl::InvalidArgumentError(absl::StrCat(
        "options.sm_scale: expected a finite value > 0, got ", params.sm_scale));
  }
  params.logits_soft_cap = spec.logits_soft_cap;
  if (!std::isfinite(params.logits_soft_cap) || params.logits_soft_cap < 0.0f) {
    return absl::InvalidArgumentError(absl::StrCat(
        "options.logits_soft_cap: expected a finite value >= 0 (0 = off), got ",
        params.logits_soft_cap));
  }
  params.window_left = spec.window_left.value_or(-1);
  if (params.window_left < -1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "options.window_left: expected -1 (no window) or >= 0, got ", params.window_left));
  }
  if (spec.fixed_split_size < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "options.fixed_split_size: expected 0 (planner's choice) or > 0 tokens, got ",
        spec.fixed_split_size));
  }
  params.k_scale = cache.geometry.k_scale;
  params.v_scale = cache.geometry.v_scale;
  options.return_lse = spec.return_lse;
  options.deterministic = spec.deterministic;
  options.fixed_split_tokens = spec.fixed_split_size;
  options.disable_split_kv = spec.disable_split_kv;
  return absl::OkStatus();
}

// A page listed twice in one entry's table would hold two of its positions in one slot.
// Ids are range-checked before this. A per-thread bitmap over the pool (num_pages / 8 bytes),
// cleared again after each use, keeps this linear in the table's length.
absl::Status CheckNoRepeatedPage(const std::vector<int32_t>& page_ids, int64_t num_pages,
                                 const std::string& field) {
  thread_local std::vector<uint64_t> seen;
  if (static_cast<int64_t>(seen.size()) * 64 < num_pages) seen.resize((num_pages + 63) / 64);
  absl::Status status;
  size_t marked = 0;
  for (; marked < page_ids.size(); ++marked) {
    const int32_t page = page_ids[marked];
    uint64_t& word = seen[page / 64];
    const uint64_t bit = uint64_t{1} << (page % 64);
    if (word & bit) {
      const size_t first = std::find(page_ids.begin(), page_ids.end(), page) - page_ids.begin();
      status = absl::InvalidArgumentError(absl::StrCat(
          field, "[", marked, "]: page ", page, " repeats ", field.substr(field.rfind('.') + 1),
          "[", first, "] of the same entry (one page holds page_size positions, once)"));
      break;
    }
    word |= bit;
  }
  for (size_t i = 0; i < marked; ++i) seen[page_ids[i] / 64] = 0;
  return status;
}

// Checks an EXTERNAL entry's page table against the pools.
absl::Status ValidateExternalEntry(const PlanEntrySpec& entry, size_t index,
                                   const CacheSpec& cache) {
  const std::string field = absl::StrCat("entries[", index, "].pages");
  if (!entry.has_pages) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ": required for cache '", cache.name, "' (EXTERNAL page tables)"));
  }
  if (entry.kv_len < entry.num_new_tokens || entry.kv_len > kMaxSequenceTokens) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ".kv_len: expected num_new_tokens (", entry.num_new_tokens, ") to ",
        kMaxSequenceTokens, ", got ", entry.kv_len));
  }
  const int32_t page_size = cache.geometry.page_size;
  const int64_t pages = PagesFor(entry.kv_len, page_size);
  if (static_cast<int64_t>(entry.page_ids.size()) != pages) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ".page_ids: expected ", pages, " ids (kv_len ", entry.kv_len, ", page_size ",
        page_size, "), got ", entry.page_ids.size()));
  }
  const int64_t num_pages = cache.geometry.num_pages;
  for (size_t i = 0; i < entry.page_ids.size(); ++i) {
    if (entry.page_ids[i] < 0 || entry.page_ids[i] >= num_pages) {
      return absl::InvalidArgumentError(absl::StrCat(field, ".page_ids[", i,
                                                     "]: expected a page id in [0, ", num_pages,
                                                     "), got ", entry.page_ids[i]));
    }
  }
  RETURN_IF_ERROR(CheckNoRepeatedPage(entry.page_ids, num_pages, absl::StrCat(field, ".page_ids")));
  if (!cache.separate_kv) {
    if (!entry.v_page_ids.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, ".v_page_ids: only for SEPARATE_KV page tables; cache '", cache.name,
          "' is SHARED"));
    }
    return absl::OkStatus();
  }
  if (entry.v_page_ids.size() != entry.page_ids.size()) {
    return absl::InvalidArgumentError(absl::StrCat(field, ".v_page_ids: expected ",
                                                   entry.page_ids.size(),
                                                   " ids (one per K page), got ",
                                                   entry.v_page_ids.size()));
  }
  for (size_t i = 0; i < entry.v_page_ids.size(); ++i) {
    if (entry.v_page_ids[i] < 0 || entry.v_page_ids[i] >= num_pages) {
      return absl::InvalidArgumentError(absl::StrCat(field, ".v_page_ids[", i,
                                                     "]: expected a page id in [0, ", num_pages,
                                                     "), got ", entry.v_page_ids[i]));
    }
  }
  return CheckNoRepeatedPage(entry.v_page_ids, num_pages, absl::StrCat(field, ".v_page_ids"));
}

// The slots [first_offset, last_offset] of `page` that one entry's new tokens write.
struct PageWrite {
  int32_t page;
  int32_t first_offset;
  int32_t last_offset;
  size_t entry;
  bool operator<(const PageWrite& other) const {
    return std::tie(page, first_offset) < std::tie(other.page, other.first_offset);
  }
};

// Two EXTERNAL entries whose new tokens land on the same (page, slot) in one step would race
// (on the GPU) and leave the client's cache holding one of them. Pages that entries only read
// (a shared prefix) may be shared. Cost: one record per page an entry writes, not per token.
absl::Status CheckExternalWrites(const std::vector<PlanEntrySpec>& entries, int32_t page_size,
                                 bool separate_kv) {
  for (const bool v_pool : {false, true}) {
    if (v_pool && !separate_kv) break;  // SHARED: V goes where K goes
    std::vector<PageWrite> writes;
    for (size_t i = 0; i < entries.size(); ++i) {
      const PlanEntrySpec& entry = entries[i];
      if (entry.num_new_tokens <= 0) continue;
      const std::vector<int32_t>& ids = v_pool ? entry.v_page_ids : entry.page_ids;
      const int64_t first = entry.kv_len - entry.num_new_tokens;
      for (int64_t position = first; position < entry.kv_len;) {
        const int64_t index = position / page_size;
        const int64_t page_end = std::min<int64_t>((index + 1) * page_size, entry.kv_len);
        writes.push_back({ids[index], static_cast<int32_t>(position % page_size),
                          static_cast<int32_t>((page_end - 1) % page_size), i});
        position = page_end;
      }
    }
    std::sort(writes.begin(), writes.end());
    for (size_t w = 1; w < writes.size(); ++w) {
      const PageWrite& before = writes[w - 1];
      const PageWrite& after = writes[w];
      // Within a page one entry's writes form one range, so comparing neighbours suffices.
      if (after.page == before.page && after.first_offset <= before.last_offset) {
        const size_t low = std::min(before.entry, after.entry);
        const size_t high = std::max(before.entry, after.entry);
        return absl::InvalidArgumentError(absl::StrCat(
            "entries[", high, "].pages: its new tokens write ", v_pool ? "V page " : "page ",
            after.page, " slot ", after.first_offset, " that entries[", low,
            "] also writes in this step"));
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace

std::shared_ptr<StepBatch> StepBatchPool::Take() {
  std::unique_ptr<StepBatch> batch;
  {
    std::lock_guard lock(mu_);
    if (!free_.empty()) {
      batch = std::move(free_.back());
      free_.pop_back();
    }
  }
  if (batch == nullptr) {
    batch = std::make_unique<StepBatch>();
  } else {
    for (std::vector<int32_t>* array :
         {&batch->qo_indptr, &batch->page_indptr, &batch->k_page_indices,
          &batch->v_page_indices, &batch->last_page_len, &batch->token_batch_indices,
          &batch->token_positions}) {
      array->clear();
    }
    batch->page_copies.clear();
    batch->batch_size = 0;
    batch->num_tokens = 0;
    batch->options = StepOptions();
    batch->phase = StepPhase::kEmpty;
  }
  return std::shared_ptr<StepBatch>(batch.release(), [pool = shared_from_this()](StepBatch* b) {
    pool->Return(b);
  });
}

void StepBatchPool::Return(StepBatch* batch) {
  std::unique_ptr<StepBatch> owned(batch);
  std::lock_guard lock(mu_);
  if (free_.size() < kKept) free_.push_back(std::move(owned));
}

absl::StatusOr<PlanResult> Engine::Plan(const PlanSpec& spec, uint64_t owner) {
  const absl::Time started = absl::Now();
  // The cache's plan lock comes before State::mu: find the cache, take its plan lock, then
  // make sure the name still means that cache (it may have been deleted, or replaced, between).
  std::shared_ptr<CacheEntry> cache;
  State::PlanReservation reservation;
  for (;;) {
    {
      absl::MutexLock lock(&state_->mu);
      if (state_->draining) {
        return absl::UnavailableError("server is draining: no new steps are accepted");
      }
      ASSIGN_OR_RETURN(cache, state_->UsableCacheLocked(spec.cache));
    }
    absl::MutexLock plan_lock(&cache->plan_mu);
    {
      absl::MutexLock lock(&state_->mu);
      auto registered = state_->caches.find(spec.cache);
      if (registered != state_->caches.end() && registered->second != cache) continue;
      RETURN_IF_ERROR(state_->ReservePlanLocked(spec, owner, cache, reservation));
    }
    // The device work (plan upload, buffer growth, waits for a reused buffer's last upload)
    // runs without State::mu: other caches' Plans, every Forward's completion, EndStep, the
    // registry and the reaper go on meanwhile. The reservation's pages and sequences are the
    // step's, and the channel (if any) outlives it (the step is one of its open steps).
    StepEntry& step = *reservation.step;
    absl::StatusOr<std::unique_ptr<BackendStep>> prepared =
        reservation.channel != nullptr
            ? cache->backend->PrepareChannelStep(reservation.batch,
                                                 reservation.channel->backend.get())
            : cache->backend->PrepareStep(reservation.batch);
    std::unique_ptr<BackendStep> backend_step;
    if (prepared.ok()) backend_step = std::move(prepared).value();
    State::Deferred deferred;
    absl::Status published;
    {
      absl::MutexLock lock(&state_->mu);
      published = state_->PublishPlanLocked(spec, reservation, backend_step,
                                            prepared.status(), deferred);
      if (published.ok() && state_->metrics) {
        state_->metrics->ObservePlan(absl::ToDoubleSeconds(absl::Now() - started),
                                     step.decode_tokens, step.prefill_tokens);
      }
    }
    // A refused step's backend step goes here, outside the lock (before the cache it uses).
    backend_step.reset();
    deferred.Run();
    RETURN_IF_ERROR(published);
    return std::move(reservation.result);
  }
}

absl::Status Engine::State::ReservePlanLocked(const PlanSpec& spec, uint64_t owner,
                                              const std::shared_ptr<CacheEntry>& cache,
                                              PlanReservation& reservation) {
  if (draining) {
    return absl::UnavailableError("server is draining: no new steps are accepted");
  }
  // The cache may have been deleted or failed while this Plan waited for its plan lock.
  RETURN_IF_ERROR(UsableCacheLocked(spec.cache).status());
  const ServerLimitsOptions& limits = options.limits;
  if (static_cast<int64_t>(spec.entries.size()) > limits.max_plan_entries) {
    return absl::InvalidArgumentError(absl::StrCat("entries: at most ", limits.max_plan_entries,
                                                   " per plan (--max_plan_entries), got ",
                                                   spec.entries.size()));
  }
  if (static_cast<int32_t>(open_steps.size()) >= limits.max_open_steps) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "steps: ", open_steps.size(), " steps are open, the limit (--max_open_steps)"));
  }
  if (!spec.tenant.empty()) {
    auto count = open_steps_by_tenant.find(spec.tenant);
    const int32_t open = count == open_steps_by_tenant.end() ? 0 : count->second;
    if (open >= limits.max_open_steps_per_tenant) {
      return absl::ResourceExhaustedError(
          absl::StrCat("steps: this tenant has ", open,
                       " steps open, the limit (--max_open_steps_per_tenant)"));
    }
  }
  StepOptions options;
  RETURN_IF_ERROR(ResolveOptions(spec.options, cache->spec, options));
  std::shared_ptr<ChannelEntry> channel;
  if (spec.channel_id != 0) {
    auto channel_it = channels.find(spec.channel_id);
    if (channel_it == channels.end() || channel_it->second->tenant != spec.tenant) {
      return absl::NotFoundError(
          absl::StrCat("channel_id: no open channel ", spec.channel_id));
    }
    channel = channel_it->second;
    if (channel->transferring) {
      return absl::FailedPreconditionError(absl::StrCat(
          "channel_id: channel ", spec.channel_id,
          " is carrying a sequence transfer (ExportSequence/ImportSequence); plan on it once "
          "that ends"));
    }
    if (channel->cache != cache) {
      return absl::InvalidArgumentError(absl::StrCat(
          "channel_id: channel ", spec.channel_id, " belongs to another cache, not '",
          spec.cache, "'"));
    }
    if (options.return_lse && !channel->spec.with_lse) {
      return absl::InvalidArgumentError(absl::StrCat(
          "options.return_lse: channel ", spec.channel_id,
          " was opened without lse regions (OpenChannel with_lse)"));
    }
  }

  // Validate every entry before anything changes.
  const CacheGeometry& geometry = cache->spec.geometry;
  const int32_t page_size = geometry.page_size;
  const bool managed = !cache->spec.external_pages;
  int64_t num_tokens = 0;
  int64_t pages_needed = 0;
  int64_t table_pages = 0;  // page ids the step's table lists
  absl::flat_hash_map<uint64_t, size_t> first_entry_of;
  first_entry_of.reserve(spec.entries.size());
  std::vector<std::shared_ptr<StepEntry>> parents;  // open steps this one chains on
  for (size_t i = 0; i < spec.entries.size(); ++i) {
    const PlanEntrySpec& entry = spec.entries[i];
    if (entry.num_new_tokens < 0) {
      return absl::InvalidArgumentError(absl::StrCat("entries[", i,
                                                     "].num_new_tokens: expected >= 0, got ",
                                                     entry.num_new_tokens));
    }
    num_tokens += entry.num_new_tokens;
    if (entry.num_new_tokens == 0) continue;  // padding: inert, its pages unused
    if (!managed) {
      RETURN_IF_ERROR(ValidateExternalEntry(entry, i, cache->spec));
      table_pages += static_cast<int64_t>(entry.page_ids.size());
      continue;
    }
    if (entry.has_pages) {
      return absl::InvalidArgumentError(absl::StrCat(
          "entries[", i, "].pages: only for EXTERNAL page tables; cache '", spec.cache,
          "' is MANAGED"));
    }
    auto [where, inserted] = first_entry_of.emplace(entry.sequence_id, i);
    if (!inserted) {
      return absl::InvalidArgumentError(absl::StrCat("entries[", i, "].sequence_id: sequence ",
                                                     entry.sequence_id, " repeats entries[",
                                                     where->second, "]"));
    }
    int64_t length = 0;
    int64_t pages_held = 0;
    if (auto it = cache->sequences.find(entry.sequence_id); it != cache->sequences.end()) {
      const Sequence& sequence = it->second;
      if (sequence.open_steps != 0) {
        // A chained step (DESIGN 3b): it goes on top of the sequence's latest open step, which
        // must run through the same channel (whose machinery runs steps in plan order) and
        // must not be aborting.
        const std::shared_ptr<StepEntry> last = sequence.last_step.lock();
        const uint64_t last_id = last ? last->id : 0;
        if (last == nullptr || channel == nullptr || last->channel != channel) {
          return absl::FailedPreconditionError(absl::StrCat(
              "entries[", i, "].sequence_id: sequence ", entry.sequence_id,
              " is in open step ", last_id,
              "; end that step first (a step may be planned on top of an open one only "
              "through the same channel)"));
        }
        if (last->ending && last->outcome == StepOutcome::kAborted) {
          return absl::FailedPreconditionError(absl::StrCat(
              "entries[", i, "].sequence_id: sequence ", entry.sequence_id,
              " is in step ", last_id, ", which is aborting"));
        }
        if (std::find(parents.begin(), parents.end(), last) == parents.end()) {
          parents.push_back(last);
        }
      }
      length = sequence.pending_length;
      pages_held = static_cast<int64_t>(sequence.pages.size());
      pages_needed += CopyOnWritePagesNeededLocked(*cache, sequence, entry.num_new_tokens);
    } else if (cache->importing.contains(entry.sequence_id)) {
      return absl::FailedPreconditionError(absl::StrCat(
          "entries[", i, "].sequence_id: sequence ", entry.sequence_id,
          " is being imported (ImportSequence); plan it once the import has finished"));
    }
    if (length + entry.num_new_tokens > kMaxSequenceTokens) {
      return absl::InvalidArgumentError(absl::StrCat(
          "entries[", i, "].num_new_tokens: sequence ", entry.sequence_id, " would reach ",
          length + entry.num_new_tokens, " tokens, more than ", kMaxSequenceTokens));
    }
    pages_needed += PagesFor(length + entry.num_new_tokens, page_size) - pages_held;
    table_pages += PagesFor(length + entry.num_new_tokens, page_size);
  }
  if (managed) {
    // A padding slot may not name a sequence that has tokens in this plan (each id once per
    // plan); padding slots may share one id among themselves.
    for (size_t i = 0; i < spec.entries.size(); ++i) {
      if (spec.entries[i].num_new_tokens != 0) continue;
      auto it = first_entry_of.find(spec.entries[i].sequence_id);
      if (it != first_entry_of.end()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "entries[", i, "].sequence_id: padding slot names sequence ",
            spec.entries[i].sequence_id, " of entries[", it->second,
            "]; each id at most once per plan"));
      }
    }
  }
  if (num_tokens > limits.max_step_tokens) {
    return absl::InvalidArgumentError(absl::StrCat("entries: ", num_tokens,
                                                   " new tokens exceed the per-step limit of ",
                                                   limits.max_step_tokens,
                                                   " (--max_step_tokens)"));
  }
  if (channel != nullptr && num_tokens > channel->spec.max_tokens) {
    return absl::InvalidArgumentError(absl::StrCat(
        "entries: ", num_tokens, " new tokens exceed channel ", spec.channel_id,
        "'s max_tokens of ", channel->spec.max_tokens));
  }
  if (!managed) {
    RETURN_IF_ERROR(CheckExternalWrites(spec.entries, page_size, cache->spec.separate_kv));
  }
  if (managed && pages_needed > cache->allocator->free_pages()) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "entries: the step needs ", pages_needed, " new pages but cache '", spec.cache,
        "' has ", cache->allocator->free_pages(), " free of ", geometry.num_pages));
  }

  // Allocate and build the batch. Nothing below can fail; a failure of PrepareStep (or an
  // abort while it runs) rolls the allocation back (PublishPlanLocked).
  auto step = std::make_shared<StepEntry>();
  step->id = next_step_id++;
  step->owner = owner;
  step->tenant = spec.tenant;
  step->cache = cache;
  std::shared_ptr<StepBatch> batch = batches->Take();
  batch->batch_size = static_cast<int32_t>(spec.entries.size());
  batch->num_tokens = num_tokens;
  batch->options = options;
  batch->qo_indptr.reserve(spec.entries.size() + 1);
  batch->page_indptr.reserve(spec.entries.size() + 1);
  batch->qo_indptr.push_back(0);
  batch->page_indptr.push_back(0);
  batch->token_batch_indices.reserve(num_tokens);
  batch->token_positions.reserve(num_tokens);
  batch->k_page_indices.reserve(table_pages);
  if (cache->spec.separate_kv) batch->v_page_indices.reserve(table_pages);
  PlanResult& result = reservation.result;
  result.entries.resize(spec.entries.size());
  for (size_t i = 0; i < spec.entries.size(); ++i) {
    const PlanEntrySpec& entry = spec.entries[i];
    const int32_t new_tokens = entry.num_new_tokens;
    int64_t kv_len = 0;
    result.entries[i].row_offset = batch->qo_indptr.back();
    if (new_tokens > 0 && managed) {
      Sequence& sequence = cache->sequences[entry.sequence_id];
      SequenceChange change{entry.sequence_id, sequence.pending_length, sequence.pages.size(),
                            sequence.pending_length + new_tokens, sequence.last_step};
      if (CopyOnWritePagesNeededLocked(*cache, sequence, new_tokens) > 0) {
        CopyOnWriteLocked(*cache, sequence, change, *step, *batch);
      }
      const int64_t more = PagesFor(change.new_length, page_size) -
                           static_cast<int64_t>(sequence.pages.size());
      const size_t fresh_begin = sequence.pages.size();
      cache->allocator->Allocate(more, sequence.pages);  // cannot fail: checked above
      step->fresh_pages.insert(step->fresh_pages.end(), sequence.pages.begin() + fresh_begin,
                               sequence.pages.end());
      sequence.pending_length = change.new_length;
      ++sequence.open_steps;
      sequence.last_step = step;
      step->changes.push_back(change);
      kv_len = change.new_length;
      batch->k_page_indices.insert(batch->k_page_indices.end(), sequence.pages.begin(),
                                   sequence.pages.end());
    } else if (new_tokens > 0) {
      kv_len = entry.kv_len;
      batch->k_page_indices.insert(batch->k_page_indices.end(), entry.page_ids.begin(),
                                   entry.page_ids.end());
      if (cache->spec.separate_kv) {  // SHARED tables leave v_page_indices empty
        batch->v_page_indices.insert(batch->v_page_indices.end(), entry.v_page_ids.begin(),
                                     entry.v_page_ids.end());
      }
    }
    const int64_t start = kv_len - new_tokens;
    result.entries[i].start_position = new_tokens > 0 ? start : 0;
    for (int32_t t = 0; t < new_tokens; ++t) {
      batch->token_batch_indices.push_back(static_cast<int32_t>(i));
      batch->token_positions.push_back(static_cast<int32_t>(start + t));
    }
    if (new_tokens == 1) step->decode_tokens += 1;
    if (new_tokens > 1) step->prefill_tokens += new_tokens;
    batch->qo_indptr.push_back(batch->qo_indptr.back() + new_tokens);
    batch->page_indptr.push_back(static_cast<int32_t>(batch->k_page_indices.size()));
    const int64_t pages = PagesFor(kv_len, page_size);
    batch->last_page_len.push_back(
        pages == 0 ? 0 : static_cast<int32_t>(kv_len - (pages - 1) * page_size));
  }
  batch->phase = StepPhaseOf(batch->qo_indptr);

  // Registered as preparing: open for the limits and for aborts, unseen by Forward and EndStep.
  step->preparing = true;
  step->batch = batch;
  for (const auto& parent : parents) parent->children.push_back(step);
  step->parents = std::move(parents);
  step->layers.assign(geometry.num_layers, LayerState::kPending);
  step->last_activity = absl::Now();
  ++cache->open_steps;
  open_steps[step->id] = step;
  if (!spec.tenant.empty()) ++open_steps_by_tenant[spec.tenant];
  if (channel != nullptr) {
    // Its channel's ring stays until the step is finalized (TakeIdleChannelsLocked).
    step->channel = channel;
    ++channel->open_steps;
  }
  PublishPagesLocked(*cache);
  result.step_id = step->id;
  result.num_tokens = num_tokens;
  reservation.step = std::move(step);
  reservation.batch = std::move(batch);
  reservation.channel = std::move(channel);
  return absl::OkStatus();
}

absl::Status Engine::State::PublishPlanLocked(const PlanSpec& spec,
                                              PlanReservation& reservation,
                                              std::unique_ptr<BackendStep>& backend_step,
                                              absl::Status prepared, Deferred& deferred) {
  const std::shared_ptr<StepEntry>& step = reservation.step;
  CacheEntry& cache = *step->cache;
  step->preparing = false;
  absl::Status refused;
  if (!prepared.ok()) {
    refused = absl::Status(prepared.code(), absl::StrCat("plan step for cache '", spec.cache,
                                                         "': ", prepared.message()));
  } else if (step->ending) {
    // Aborted while it was prepared: by a forced DeleteCache, its channel closing, the step it
    // follows aborting, or its stream ending.
    auto registered = caches.find(spec.cache);
    const bool deleted = registered == caches.end() || registered->second != step->cache;
    const bool closed = step->channel != nullptr && step->channel->closed;
    refused = absl::AbortedError(absl::StrCat(
        "plan step for cache '", spec.cache, "': step ", step->id, " was aborted while it was "
        "planned (", deleted ? "the cache was deleted"
                     : closed ? absl::StrCat("channel ", step->channel->id, " closed")
                              : "a step it follows aborted, or its stream ended", ")"));
  } else if (cache.failed) {
    refused = absl::InternalError(absl::StrCat("cache '", spec.cache, "' failed: ", cache.failure,
                                               "; delete it"));
  }
  if (!refused.ok()) {
    // Nothing of this step may survive: EndLocked (or the abort that already ended it) rolls
    // its sequences back and frees its fresh pages now that Plan no longer holds it.
    if (step->ending) {
      TryFinalizeLocked(step, deferred);
    } else {
      EndLocked(step, StepOutcome::kAborted, deferred);
    }
    return refused;
  }
  step->backend_step = std::move(backend_step);
  step->planned = true;
  step->last_activity = absl::Now();
  PlanResult& result = reservation.result;
  result.kernel = std::string(step->backend_step->KernelName());
  if (step->channel != nullptr) {
    // Every layer is in flight from now on, waiting for its ready word on the channel.
    ChannelEntry& channel = *step->channel;
    step->channel_sequence = ++channel.last_sequence;
    std::fill(step->layers.begin(), step->layers.end(), LayerState::kRunning);
    step->in_flight = static_cast<int32_t>(step->layers.size());
    layers_in_flight += step->in_flight;
    result.channel_sequence = step->channel_sequence;
    StartChannelStep(step);
  }
  return absl::OkStatus();
}

}  // namespace attnd
