// Engine: cache registry, sequences, and step end (commit / rollback). Plan lives in plan.cc,
// Forward in forward.cc.
#include "engine/engine.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "attnd/status_macros.h"
#include "engine/engine_state.h"

namespace attnd {
namespace {

constexpr size_t kFinishedStepsKept = 4096;

}  // namespace

void Engine::State::Deferred::Release(std::vector<std::shared_ptr<StepEntry>>&& steps) {
  for (std::shared_ptr<StepEntry>& step : steps) Release(std::move(step));
  steps.clear();
}

void Engine::State::Deferred::Run() {
  std::vector<std::function<void()>> callbacks = std::move(callbacks_);
  callbacks_.clear();
  for (auto& callback : callbacks) callback();
  // What the callbacks captured (an early commit's step) goes with them.
  callbacks.clear();
  steps_.clear();
}

CacheStatus Engine::State::CacheStatusLocked(const CacheEntry& cache) const {
  CacheStatus status;
  for (const auto& [id, channel] : channels) {
    if (channel->cache.get() == &cache) status.channels.push_back(ChannelStatusLocked(*channel));
  }
  std::sort(status.channels.begin(), status.channels.end(),
            [](const ChannelStatus& a, const ChannelStatus& b) { return a.id < b.id; });
  status.spec = cache.spec;
  status.failed = cache.failed;
  status.failure = cache.failure;
  status.pool_bytes = cache.spec.geometry.PoolBytes();
  status.used_pages = cache.allocator ? cache.allocator->used_pages() : 0;
  status.shared_pages = cache.allocator ? cache.allocator->shared_pages() : 0;
  status.num_sequences = static_cast<int64_t>(cache.sequences.size());
  status.open_steps = cache.open_steps;
  return status;
}

Engine::Engine(const EngineOptions& options, Backend* backend, Metrics* metrics)
    : state_(std::make_unique<State>()) {
  state_->options = options;
  state_->backend = backend;
  state_->metrics = metrics;
  state_->reaper = std::thread([state = state_.get()] { state->ReaperLoop(); });
  state_->PublishDevices();
}

void Engine::State::PublishDevices() const {
  if (metrics == nullptr) return;
  for (const DeviceInfo& device : backend->Info().devices) {
    const int64_t free = backend->KvFreeBytesOn(device.ordinal);
    metrics->SetDeviceKvBytes(device.ordinal, device.kv_budget_bytes - free, free);
  }
}

Engine::~Engine() {
  {
    absl::MutexLock lock(&state_->mu);
    state_->stopping = true;
  }
  state_->reaper.join();
  // Channel steps keep their layers in flight until the channel lets go of its waits.
  CloseAllChannels("server stopping");
  {
    // Backend callbacks of running layers (and early commits' copies) reference the state: let
    // them land first.
    absl::MutexLock lock(&state_->mu);
    state_->mu.Await(absl::Condition(state_.get(), &State::NothingInFlight));
  }
  // Abort what is still open so sequences and pages are consistent until destruction; layers
  // still in flight hold their own references to the cache.
  State::Deferred deferred;
  {
    absl::MutexLock lock(&state_->mu);
    std::vector<std::shared_ptr<StepEntry>> open;
    for (auto& [id, step] : state_->open_steps) open.push_back(step);
    for (auto& step : open) state_->EndLocked(step, StepOutcome::kAborted, deferred);
  }
  deferred.Run();
  std::vector<std::shared_ptr<ChannelEntry>> idle;
  {
    absl::MutexLock lock(&state_->mu);
    idle = state_->TakeIdleChannelsLocked();
  }
  for (auto& channel : idle) channel->backend.reset();
}

void Engine::State::ExpireLocked(absl::Time now, Deferred& deferred) {
  std::vector<std::shared_ptr<StepEntry>> expired;
  for (auto& [id, step] : open_steps) {
    if (step->preparing) continue;  // its Plan is running
    // A step with a layer on the device is active, whatever its last call's age; a channel
    // step's layers are in flight from Plan on, waiting for their ready words, so it expires
    // when no layer of it has finished for the TTL.
    const bool idle = step->channel != nullptr || step->in_flight == 0;
    // A step planned on top of an open one waits for it: it expires with it (and aborts with
    // it), not on its own.
    bool waits = false;
    for (const auto& parent : step->parents) waits |= !parent->finalized;
    if (waits) continue;
    if (idle && now - step->last_activity > options.step_ttl) {
      expired.push_back(step);
    }
  }
  for (auto& step : expired) EndLocked(step, StepOutcome::kAborted, deferred);
}

void Engine::State::ReaperLoop() {
  const absl::Duration period =
      std::clamp(options.step_ttl / 4, absl::Milliseconds(10), absl::Seconds(1));
  mu.Lock();
  while (!stopping) {
    mu.AwaitWithTimeout(absl::Condition(&stopping), period);
    if (stopping) break;
    Deferred deferred;
    ExpireLocked(absl::Now(), deferred);
    std::vector<std::shared_ptr<ChannelEntry>> idle = TakeIdleChannelsLocked();
    if (!deferred.empty() || !idle.empty()) {
      mu.Unlock();
      deferred.Run();
      // Joins the channel's threads: never under the lock.
      for (auto& channel : idle) channel->backend.reset();
      idle.clear();
      mu.Lock();
    }
  }
  mu.Unlock();
}

void Engine::ExpireSteps(absl::Time now) {
  State::Deferred deferred;
  {
    absl::MutexLock lock(&state_->mu);
    state_->ExpireLocked(now, deferred);
  }
  deferred.Run();
  ReapIdleChannels();
}

absl::StatusOr<std::shared_ptr<CacheEntry>> Engine::State::UsableCacheLocked(
    const std::string& name) const {
  auto it = caches.find(name);
  if (it == caches.end()) {
    return absl::NotFoundError(absl::StrCat("cache: no cache named '", name, "'"));
  }
  if (it->second->failed) {
    return absl::InternalError(
        absl::StrCat("cache '", name, "' failed: ", it->second->failure, "; delete it"));
  }
  return it->second;
}

absl::Status Engine::State::NotOpenLocked(uint64_t step_id, const std::string& tenant) const {
  auto it = finished.find(step_id);
  if (it != finished.end() && it->second.tenant == tenant) {
    return absl::FailedPreconditionError(absl::StrCat(
        "step_id: step ", step_id, " already ",
        it->second.result.outcome == StepOutcome::kCommitted ? "committed" : "aborted"));
  }
  return absl::NotFoundError(absl::StrCat("step_id: no open step ", step_id));
}

absl::Status Engine::State::LayerLandedLocked(const std::shared_ptr<StepEntry>& step,
                                              int32_t layer, absl::Status status,
                                              Deferred& deferred) {
  --step->in_flight;
  --layers_in_flight;
  step->last_activity = absl::Now();
  if (status.ok()) {
    step->layers[layer] = LayerState::kDone;
    ++step->layers_done;
    if (step->layers_done == static_cast<int32_t>(step->layers.size()) && !step->ending) {
      EndLocked(step, StepOutcome::kCommitted, deferred);
    }
    return status;
  }
  step->layers[layer] = LayerState::kPending;
  // Only device faults poison a cache; a backend refusing an input (or a cancelled channel
  // layer) leaves it usable.
  const bool fault = status.code() == absl::StatusCode::kInternal ||
                     status.code() == absl::StatusCode::kUnknown ||
                     status.code() == absl::StatusCode::kDataLoss;
  if (!fault) return status;
  CacheEntry& cache = *step->cache;
  cache.failed = true;
  cache.failure = std::string(status.message());
  return absl::InternalError(absl::StrCat("cache '", cache.spec.name, "' failed in layer ",
                                          layer, ": ", status.message()));
}

void Engine::State::PublishPagesLocked(const CacheEntry& cache) {
  if (metrics == nullptr || cache.allocator == nullptr) return;
  // A step of a deleted cache finalises when its running layer lands, after the delete took
  // the cache's series away: publishing then would bring them back, or overwrite those of a
  // new cache of the same name.
  auto registered = caches.find(cache.spec.name);
  if (registered == caches.end() || registered->second.get() != &cache) return;
  metrics->SetCachePages(cache.spec.name, cache.allocator->used_pages(),
                         cache.allocator->free_pages());
}

void Engine::State::EndLocked(const std::shared_ptr<StepEntry>& step, StepOutcome outcome,
                              Deferred& deferred) {
  if (step->ending) return;
  step->ending = true;
  step->outcome = outcome;
  open_steps.erase(step->id);
  if (!step->tenant.empty()) {
    auto count = open_steps_by_tenant.find(step->tenant);
    if (count != open_steps_by_tenant.end() && --count->second <= 0) {
      open_steps_by_tenant.erase(count);
    }
  }
  finished[step->id] = FinishedStep{EndStepResult{outcome, step->layers_done}, step->tenant, step};
  finished_order.push_back(step->id);
  while (finished_order.size() > kFinishedStepsKept) {
    finished.erase(finished_order.front());
    finished_order.pop_front();
  }
  if (outcome == StepOutcome::kAborted) {
    // Steps planned on top of this one lose the tokens they followed: they abort too. One that
    // had already decided to commit (it waits for this step) rolls back instead.
    for (const std::weak_ptr<StepEntry>& weak : step->children) {
      std::shared_ptr<StepEntry> child = weak.lock();
      if (child == nullptr || child->finalized) continue;
      if (child->ending && child->outcome == StepOutcome::kCommitted) {
        child->outcome = StepOutcome::kAborted;
        if (auto done = finished.find(child->id); done != finished.end()) {
          done->second.result.outcome = StepOutcome::kAborted;
        }
      }
      EndLocked(child, StepOutcome::kAborted, deferred);
      deferred.Release(std::move(child));
    }
  }
  if (step->in_flight != 0 && step->channel != nullptr && outcome == StepOutcome::kAborted) {
    // Its layers wait on ready words the client may never set: let go of them. The aborted
    // word says "every step up to this one aborted"; a step aborted on top of one that goes on
    // (the client's own EndStep; its answer says so) must not mark the one below.
    bool below_goes_on = false;
    for (const auto& parent : step->parents) {
      below_goes_on |= !parent->finalized &&
                       !(parent->ending && parent->outcome == StepOutcome::kAborted);
    }
    deferred.Add([channel = step->channel, sequence = step->channel_sequence,
                        mark = !below_goes_on] {
      if (channel->backend) channel->backend->CancelStep(sequence, mark);
    });
  }
  TryFinalizeLocked(step, deferred);
}

void Engine::State::TryFinalizeLocked(const std::shared_ptr<StepEntry>& step,
                                      Deferred& deferred) {
  if (!step->ending || step->finalized || step->in_flight != 0 || step->preparing ||
      step->copying) {
    return;
  }
  if (step->outcome == StepOutcome::kCommitted) {
    // Its sequences' lengths move past its parents' tokens only once those are committed.
    for (const auto& parent : step->parents) {
      if (!parent->finalized) return;
    }
  } else {
    // Pages are returned only when no child (whose appends may write into them) runs.
    for (const std::weak_ptr<StepEntry>& weak : step->children) {
      std::shared_ptr<StepEntry> child = weak.lock();
      if (child != nullptr && !child->finalized) return;
    }
  }
  // An early commit's copies come first (MakeCommitCopies comes back here once they landed).
  if (StartCommitCopiesLocked(step, deferred)) return;
  FinalizeLocked(*step, deferred);
  step->finalized = true;
  std::vector<std::shared_ptr<StepEntry>> waiting;
  if (step->outcome == StepOutcome::kCommitted) {
    const absl::Time now = absl::Now();
    for (const std::weak_ptr<StepEntry>& weak : step->children) {
      if (std::shared_ptr<StepEntry> child = weak.lock()) {
        child->last_activity = now;  // its TTL runs from here (see ExpireLocked)
        waiting.push_back(std::move(child));
      }
    }
  } else {
    waiting = step->parents;
  }
  // These links may hold the last reference to a step of a deleted cache, and through it to the
  // cache: they go after the lock.
  deferred.Release(std::move(step->parents));
  step->children.clear();
  for (const auto& next : waiting) TryFinalizeLocked(next, deferred);
  deferred.Release(std::move(waiting));
}

bool Engine::State::StartCommitCopiesLocked(const std::shared_ptr<StepEntry>& step,
                                            Deferred& deferred) {
  if (step->outcome != StepOutcome::kCommitted || step->copies_made) return false;
  step->copies_made = true;
  CacheEntry& cache = *step->cache;
  std::vector<int32_t> layers = LayersToCopyAtCommitLocked(cache, *step);
  if (layers.empty()) return false;
  step->copying = true;
  ++copies_in_flight;
  deferred.Add([this, step, backend = cache.backend.get(), batch = step->batch,
                layers = std::move(layers)] { MakeCommitCopies(step, backend, batch, layers); });
  return true;
}

void Engine::State::MakeCommitCopies(const std::shared_ptr<StepEntry>& step,
                                     BackendCache* backend,
                                     std::shared_ptr<const StepBatch> batch,
                                     std::vector<int32_t> layers) {
  // The copies' sources are pages the step still holds, their destinations its fresh pages in
  // layers no step writes: nothing else touches them until the step is finalized.
  absl::Status copied;
  int32_t failed_layer = -1;
  for (const int32_t layer : layers) {
    copied = backend->CopyPages(layer, batch->page_copies);
    if (!copied.ok()) {
      failed_layer = layer;
      break;
    }
  }
  Deferred deferred;
  {
    absl::MutexLock lock(&mu);
    --copies_in_flight;
    step->copying = false;
    CacheEntry& cache = *step->cache;
    if (!copied.ok() && !cache.failed) {
      cache.failed = true;
      cache.failure = absl::StrCat("copy-on-write of layer ", failed_layer, " at commit: ",
                                   copied.message());
    }
    TryFinalizeLocked(step, deferred);
  }
  deferred.Run();
}

void Engine::State::FinalizeLocked(StepEntry& step, Deferred& deferred) {
  CacheEntry& cache = *step.cache;
  const bool committed = step.outcome == StepOutcome::kCommitted;
  for (const SequenceChange& change : step.changes) {
    EndSequenceChangeLocked(cache, step, change, committed);
  }
  if (committed && cache.allocator) ReleaseReplacedPagesLocked(cache, step);
  if (!committed && cache.allocator) cache.allocator->Free(step.fresh_pages);
  step.fresh_pages.clear();
  step.changes.clear();
  --cache.open_steps;
  if (step.channel != nullptr) --step.channel->open_steps;
  PublishPagesLocked(cache);
  // A step refused at the end of its Plan was never a step for the client.
  if (metrics && step.planned) {
    metrics->StepEnded(committed, step.decode_tokens, step.prefill_tokens);
  }
  const EndStepResult result{step.outcome, step.layers_done};
  // Layers that were running when the step's fate was decided have landed by now: a later
  // EndStep reports them too.
  if (auto done = finished.find(step.id); done != finished.end()) done->second.result = result;
  for (auto& waiter : step.end_waiters) {
    deferred.Add([waiter = std::move(waiter), result] { waiter(result); });
  }
  step.end_waiters.clear();
  // Release the device-side plan now rather than when the last reference goes.
  step.backend_step.reset();
}

absl::StatusOr<CacheStatus> Engine::CreateCache(const CacheSpec& spec,
                                                const CacheAdmission& admit) {
  {
    absl::MutexLock lock(&state_->mu);
    if (admit) {
      std::vector<std::pair<std::string, int64_t>> held;
      held.reserve(state_->caches.size() + state_->creating.size());
      for (const auto& [name, cache] : state_->caches) {
        held.emplace_back(name, cache->spec.geometry.num_pages);
      }
      for (const auto& [name, geometry] : state_->creating) {
        held.emplace_back(name, geometry.num_pages);
      }
      RETURN_IF_ERROR(admit(held));
    }
    if (state_->caches.contains(spec.name) || state_->creating.contains(spec.name)) {
      return absl::AlreadyExistsError(
          absl::StrCat("name: a cache named '", spec.name, "' exists"));
    }
    state_->creating.emplace(spec.name, spec.geometry);
  }
  // The pools are carved (and, on a GPU, set up: streams, events, buffers) without the lock;
  // the name is taken meanwhile.
  auto backend_cache = state_->backend->CreateCache(spec.geometry, spec.device);
  absl::StatusOr<CacheStatus> created;
  {
    absl::MutexLock lock(&state_->mu);
    state_->creating.erase(spec.name);
    if (!backend_cache.ok()) {
      return absl::Status(backend_cache.status().code(),
                          absl::StrCat("create cache '", spec.name, "': ",
                                       backend_cache.status().message()));
    }
    auto cache = std::make_shared<CacheEntry>();
    cache->spec = spec;
    cache->backend = std::move(backend_cache).value();
    cache->spec.device = cache->backend->device();
    if (!spec.external_pages) {
      cache->allocator = std::make_unique<PageAllocator>(spec.geometry.num_pages);
    }
    state_->caches[spec.name] = cache;
    state_->PublishPagesLocked(*cache);
    created = state_->CacheStatusLocked(*cache);
  }
  state_->PublishDevices();
  return created;
}

absl::StatusOr<CacheStatus> Engine::GetCache(const std::string& name) const {
  absl::MutexLock lock(&state_->mu);
  auto it = state_->caches.find(name);
  if (it == state_->caches.end()) {
    return absl::NotFoundError(absl::StrCat("name: no cache named '", name, "'"));
  }
  return state_->CacheStatusLocked(*it->second);
}

std::vector<CacheStatus> Engine::ListCaches() const {
  absl::MutexLock lock(&state_->mu);
  std::vector<CacheStatus> list;
  for (const auto& [name, cache] : state_->caches) {
    list.push_back(state_->CacheStatusLocked(*cache));
  }
  std::sort(list.begin(), list.end(),
            [](const CacheStatus& a, const CacheStatus& b) { return a.spec.name < b.spec.name; });
  return list;
}

absl::Status Engine::DeleteCache(const std::string& name, bool force) {
  State::Deferred deferred;
  // The last reference to the cache may be this one: its pools (and a GPU's streams, which
  // their destruction waits for) go after the lock.
  std::shared_ptr<CacheEntry> cache;
  {
    absl::MutexLock lock(&state_->mu);
    auto it = state_->caches.find(name);
    if (it == state_->caches.end()) {
      return absl::NotFoundError(absl::StrCat("name: no cache named '", name, "'"));
    }
    cache = it->second;
    if (cache->open_steps > 0 && !force) {
      return absl::FailedPreconditionError(
          absl::StrCat("name: cache '", name, "' has ", cache->open_steps,
                       " open step(s); end them first or set force"));
    }
    std::vector<std::shared_ptr<StepEntry>> open;
    for (auto& [id, step] : state_->open_steps) {
      if (step->cache == cache) open.push_back(step);
    }
    for (auto& step : open) state_->EndLocked(step, StepOutcome::kAborted, deferred);
    std::vector<std::shared_ptr<ChannelEntry>> channels;
    for (auto& [id, channel] : state_->channels) {
      if (channel->cache == cache) channels.push_back(channel);
    }
    for (auto& channel : channels) {
      state_->CloseChannelLocked(channel, absl::StrCat("cache '", name, "' deleted"), deferred);
    }
    state_->caches.erase(it);
    if (state_->metrics) state_->metrics->RemoveCache(name);
    // The pools go when the last in-flight layer drops its reference to the cache.
  }
  deferred.Run();
  ReapIdleChannels();
  cache.reset();
  state_->PublishDevices();
  return absl::OkStatus();
}

absl::StatusOr<int64_t> Engine::FreeSequences(const std::string& cache_name,
                                              const std::vector<uint64_t>& sequence_ids) {
  absl::MutexLock lock(&state_->mu);
  auto it = state_->caches.find(cache_name);
  if (it == state_->caches.end()) {
    return absl::NotFoundError(absl::StrCat("cache: no cache named '", cache_name, "'"));
  }
  CacheEntry& cache = *it->second;
  if (cache.spec.external_pages) {
    return absl::FailedPreconditionError(absl::StrCat(
        "cache: '", cache_name, "' uses EXTERNAL page tables; the client owns its pages"));
  }
  // Validate everything first: all-or-nothing.
  absl::flat_hash_map<uint64_t, size_t> seen;
  for (size_t i = 0; i < sequence_ids.size(); ++i) {
    const uint64_t id = sequence_ids[i];
    auto [where, inserted] = seen.emplace(id, i);
    if (!inserted) {
      return absl::InvalidArgumentError(absl::StrCat("sequence_ids[", i, "]: sequence ", id,
                                                     " repeats sequence_ids[", where->second, "]"));
    }
    auto sequence = cache.sequences.find(id);
    if (sequence == cache.sequences.end()) {
      return absl::NotFoundError(absl::StrCat("sequence_ids[", i, "]: cache '", cache_name,
                                              "' has no sequence ", id));
    }
    if (sequence->second.open_steps != 0) {
      const std::shared_ptr<StepEntry> last = sequence->second.last_step.lock();
      return absl::FailedPreconditionError(absl::StrCat("sequence_ids[", i, "]: sequence ", id,
                                                        " is in open step ",
                                                        last ? last->id : 0));
    }
  }
  int64_t freed = 0;
  for (const uint64_t id : sequence_ids) {
    auto sequence = cache.sequences.find(id);
    freed += cache.allocator->Free(sequence->second.pages);  // shared pages stay
    cache.sequences.erase(sequence);
  }
  state_->PublishPagesLocked(cache);
  return freed;
}

void Engine::EndStep(uint64_t step_id, bool abort,
                     std::function<void(absl::StatusOr<EndStepResult>)> done,
                     const std::string& tenant) {
  // A commit of a channel step whose layers have not all finished: it may wait for them only if
  // the client has signalled every one of them (they are on their way; the client may well
  // have seen their done words before attnd counted them); otherwise they might never come.
  // The ready words are read outside the lock (on CUDA_IPC they are device memory).
  std::shared_ptr<ChannelEntry> channel;
  uint32_t sequence = 0;
  std::vector<int32_t> unfinished;
  if (!abort) {
    absl::MutexLock lock(&state_->mu);
    auto it = state_->open_steps.find(step_id);
    if (it != state_->open_steps.end() && it->second->tenant == tenant &&
        !it->second->preparing && it->second->channel != nullptr) {
      const StepEntry& step = *it->second;
      for (size_t layer = 0; layer < step.layers.size(); ++layer) {
        if (step.layers[layer] != LayerState::kDone) {
          unfinished.push_back(static_cast<int32_t>(layer));
        }
      }
      channel = step.channel;
      sequence = step.channel_sequence;
    }
  }
  int32_t unsignalled = -1;
  if (channel != nullptr && channel->backend != nullptr) {
    for (const int32_t layer : unfinished) {
      if (!channel->backend->ReadyReached(layer, sequence)) {
        unsignalled = layer;
        break;
      }
    }
  }

  State::Deferred deferred;
  {
    absl::MutexLock lock(&state_->mu);
    auto it = state_->open_steps.find(step_id);
    if (it != state_->open_steps.end() &&
        (it->second->tenant != tenant || it->second->preparing)) {
      // Another tenant's step does not exist for this caller; a step still being planned
      // does not exist yet.
      it = state_->open_steps.end();
    }
    if (it == state_->open_steps.end()) {
      auto finished = state_->finished.find(step_id);
      if (finished != state_->finished.end() && finished->second.tenant != tenant) {
        finished = state_->finished.end();
      }
      if (finished == state_->finished.end()) {
        deferred.Add([done, step_id] {
          done(absl::NotFoundError(absl::StrCat("step_id: no open step ", step_id)));
        });
      } else if (std::shared_ptr<StepEntry> ended = finished->second.entry.lock();
                 ended != nullptr && !ended->finalized) {
        // Ended (a channel step after its last layer, say) but not yet finalized: it waits for
        // a parent or its commit copies. The answer waits too, so that a Plan after it sees the
        // sequences' new lengths.
        ended->end_waiters.push_back(std::move(done));
      } else {
        // A repeated EndStep reports what happened, as the proto promises. An abort that
        // comes after the step committed changes nothing and answers COMMITTED: the caller
        // needs that outcome (its lengths moved) more than an error.
        const EndStepResult result = finished->second.result;
        deferred.Add([done, result] { done(result); });
      }
    } else if (!abort && it->second->channel != nullptr &&
               it->second->layers_done < static_cast<int32_t>(it->second->layers.size())) {
      if (unsignalled >= 0) {
        deferred.Add([done, step_id, unsignalled] {
          done(absl::FailedPreconditionError(absl::StrCat(
              "step_id: step ", step_id, " runs through a channel and its layer ", unsignalled,
              " has not been signalled (ready word); it commits after its last layer: signal "
              "the rest, or abort")));
        });
      } else {
        // Every remaining layer was signalled: they are running, and the step commits after
        // the last of them (or aborts at the TTL); this answer waits for it.
        it->second->end_waiters.push_back(std::move(done));
      }
    } else {
      std::shared_ptr<StepEntry> step = it->second;
      step->end_waiters.push_back(std::move(done));
      state_->EndLocked(step, abort ? StepOutcome::kAborted : StepOutcome::kCommitted, deferred);
    }
  }
  deferred.Run();
}

void Engine::AbortOwnedSteps(uint64_t owner) {
  if (owner == 0) return;
  State::Deferred deferred;
  {
    absl::MutexLock lock(&state_->mu);
    std::vector<std::shared_ptr<StepEntry>> owned;
    for (auto& [id, step] : state_->open_steps) {
      if (step->owner == owner) owned.push_back(step);
    }
    for (auto& step : owned) state_->EndLocked(step, StepOutcome::kAborted, deferred);
  }
  deferred.Run();
}

void Engine::SetDraining(bool draining) {
  absl::MutexLock lock(&state_->mu);
  state_->draining = draining;
}

int Engine::OpenSteps() const {
  absl::MutexLock lock(&state_->mu);
  return static_cast<int>(state_->open_steps.size());
}

absl::StatusOr<int64_t> Engine::SequenceLength(const std::string& cache_name,
                                               uint64_t sequence_id, bool pending) const {
  absl::MutexLock lock(&state_->mu);
  auto it = state_->caches.find(cache_name);
  if (it == state_->caches.end()) {
    return absl::NotFoundError(absl::StrCat("cache: no cache named '", cache_name, "'"));
  }
  auto sequence = it->second->sequences.find(sequence_id);
  if (sequence == it->second->sequences.end()) return int64_t{0};
  return pending ? sequence->second.pending_length : sequence->second.length;
}

absl::Status Engine::ReadPages(const std::string& cache_name, int32_t layer, bool v_pool,
                               int64_t first_page, std::span<uint8_t> bytes) const {
  std::shared_ptr<CacheEntry> cache;
  {
    absl::MutexLock lock(&state_->mu);
    auto it = state_->caches.find(cache_name);
    if (it == state_->caches.end()) {
      return absl::NotFoundError(absl::StrCat("cache: no cache named '", cache_name, "'"));
    }
    cache = it->second;
  }
  return cache->backend->ReadPages(layer, v_pool, first_page, bytes);
}

}  // namespace attnd
