// Internal state of the Engine, shared by engine.cc (caches, commit, rollback, step end),
// plan.cc (Plan), forward.cc (Forward, EndStep), channels.cc (channel steps) and lifecycle.cc
// (fork, export, import). Everything here is guarded by State::mu unless it says otherwise.
//
// Locks, in the order they are taken (a thread holding one takes only those below it):
//   1. CacheEntry::plan_mu  one per cache: Plans of that cache run one at a time, from their
//                           reservation through the backend's PrepareStep to their publication
//                           (so channel sequences, chained steps and lanes see plan order).
//                           Held across device work; no other call of the engine waits for it.
//   2. State::mu            the engine's state: caches, sequences, pages, steps, channels.
//                           Never held across a backend call that can wait for or allocate on
//                           the device (PrepareStep, CreateCache, CreateChannel, ReadPages, a
//                           cache's or channel's destruction). Held across calls that only queue
//                           or signal (BackendChannel::StartStep, SignalReady). Work that must
//                           wait for the lock's release goes into a Deferred, which the caller
//                           runs after it: answers, channel cancels, an early commit's page
//                           copies (StartCommitCopiesLocked), and the step references a call let
//                           go of (the last one to a deleted cache's step frees its pools).
//   3. StepBatchPool::mu_, and the backend's own locks (taken inside backend calls).
// Backend callbacks (a layer landed) take State::mu on backend threads: nothing that holds
// State::mu may wait for a backend thread.
//
// What clang's -Wthread-safety checks (clang builds: the fuzz preset): State's own fields are
// ABSL_GUARDED_BY(mu). The per-cache objects below (CacheEntry, Sequence, StepEntry,
// ChannelEntry) are guarded by State::mu as well, but are not annotated field by field: the
// analysis names a mutex by the expression that reaches it and has no alias analysis, so a
// field of CacheEntry cannot name State::mu (a member pointing at it, `cache->engine_mu`, is
// another expression than the `state_->mu` the code locks, at every use). Instead, every
// function that touches those fields is either a State method annotated
// ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) (the *Locked methods, copy-on-write and status included),
// whose callers the analysis checks, or an Engine method that takes mu itself around the
// access. The fields read without the lock are set before the object is shared and never
// written after: CacheEntry::spec, backend, the allocator pointer (not its contents);
// StepEntry::id, owner, tenant, cache, batch, channel (set by ReservePlanLocked) and
// backend_step (set by PublishPlanLocked, reset by FinalizeLocked, which waits for every layer
// in flight); ChannelEntry::id, tenant, cache, spec, layout, and backend (reset only once the
// channel is out of the engine: TakeIdleChannelsLocked).
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "engine/engine.h"
#include "engine/page_allocator.h"
#include "metrics/metrics.h"

namespace attnd {

struct StepEntry;

struct Sequence {
  std::vector<int32_t> pages;  // page ids covering [0, pending_length)
  int64_t length = 0;          // committed tokens
  int64_t pending_length = 0;  // length plus the new tokens of its open steps
  int32_t open_steps = 0;      // open (not yet finalized) steps with tokens of it
  // The latest of those steps: a chained Plan (DESIGN 3b) goes on top of it.
  std::weak_ptr<StepEntry> last_step;
};

struct CacheEntry {
  // Serialises this cache's Plans (lock order: before State::mu). Guards nothing else.
  absl::Mutex plan_mu;
  CacheSpec spec;
  std::unique_ptr<BackendCache> backend;
  std::unique_ptr<PageAllocator> allocator;  // MANAGED mode only
  absl::flat_hash_map<uint64_t, Sequence> sequences;
  // Ids reserved by imports in progress (SequenceImport): not yet sequences, not plannable.
  absl::flat_hash_set<uint64_t> importing;
  int32_t open_steps = 0;
  bool failed = false;
  std::string failure;
};

// How a managed sequence changes if the step commits; undone on abort.
struct SequenceChange {
  uint64_t sequence_id = 0;
  int64_t old_length = 0;  // pending length before the step: its first new position
  size_t old_num_pages = 0;
  int64_t new_length = 0;
  std::weak_ptr<StepEntry> previous_step;  // the sequence's last_step before this one
  // Copy-on-write: the shared page that a fresh copy replaced at pages[old_num_pages - 1]
  // (-1: none). The step holds its reference until it ends: commit drops it, abort puts the
  // page back.
  int32_t replaced_page = -1;
};

// A channel (DESIGN 3b): the backend's ring and the steps planned on it.
struct ChannelEntry {
  uint64_t id = 0;
  std::string tenant;
  std::shared_ptr<CacheEntry> cache;
  ChannelSpec spec;
  std::shared_ptr<const ChannelLayout> layout;
  std::unique_ptr<BackendChannel> backend;
  uint32_t last_sequence = 0;
  int32_t open_steps = 0;  // planned (or being planned) and not yet finalized
  // Lent to a sequence transfer (ChannelTransfer): Plan refuses the channel meanwhile, and a
  // closed channel keeps its ring until the transfer lets go.
  bool transferring = false;
  bool closed = false;
  std::function<void(std::string)> on_closed;
  int64_t bytes_in = 0;
  int64_t bytes_out = 0;
};

enum class LayerState : uint8_t { kPending, kRunning, kDone };

struct StepEntry {
  uint64_t id = 0;
  // Plan reserved the step's pages and sequences but its backend step is being prepared,
  // outside State::mu. Such a step counts as open (limits, GetCache, a non-forced DeleteCache)
  // and may be aborted (forced delete, its channel closing, its parent aborting, its stream
  // ending), but Forward and EndStep do not see it, the TTL does not expire it, and it is not
  // finalized until Plan lets go of it: like a layer in flight, preparing holds its pages.
  bool preparing = false;
  // Plan published the step (its id went to the client).
  bool planned = false;
  uint64_t owner = 0;
  std::string tenant;
  std::shared_ptr<CacheEntry> cache;
  std::shared_ptr<const StepBatch> batch;
  std::unique_ptr<BackendStep> backend_step;
  std::vector<LayerState> layers;
  int32_t layers_done = 0;
  int32_t in_flight = 0;
  std::vector<SequenceChange> changes;
  std::vector<int32_t> fresh_pages;
  int64_t decode_tokens = 0;
  int64_t prefill_tokens = 0;
  absl::Time last_activity;
  // Set once the step's fate is decided; the decision is applied when in_flight drops to 0.
  bool ending = false;
  StepOutcome outcome = StepOutcome::kCommitted;
  std::vector<std::function<void(absl::StatusOr<EndStepResult>)>> end_waiters;
  // Steps on a channel: every layer is in flight from Plan until the channel reports it.
  std::shared_ptr<ChannelEntry> channel;
  uint32_t channel_sequence = 0;
  // Forward{use_channel} calls waiting for their layer, by layer (empty until one comes).
  std::vector<std::function<void(absl::Status)>> channel_waiters;
  // Chained steps (DESIGN 3b): the open steps this one was planned on top of (its sequences'
  // previous new tokens are theirs) and the steps planned on top of it. A step commits only
  // after its parents have; an aborting step aborts its children and rolls back after them.
  std::vector<std::shared_ptr<StepEntry>> parents;  // released when this step is finalized
  std::vector<std::weak_ptr<StepEntry>> children;
  // A step that commits before running every layer copies its copy-on-write pages in the layers
  // it did not run before it is finalized (State::StartCommitCopiesLocked). The copies are made
  // without State::mu (`copying`); meanwhile the step is not finalized, so its sequences stay in
  // an open step: no Plan, fork, export or free sees them with a copy missing.
  bool copying = false;
  bool copies_made = false;  // started once; not again when the step is finalized after them
  bool finalized = false;
};

// StepBatches of ended steps, reused, so that a step's arrays (the page ids run to MBs for long
// sequences) land in memory already touched rather than in fresh pages. Has its own lock: batches
// come back from backend threads and from under State::mu.
class StepBatchPool : public std::enable_shared_from_this<StepBatchPool> {
 public:
  // An empty batch (its vectors keep their capacity) that returns here when its last reference
  // goes.
  std::shared_ptr<StepBatch> Take();

 private:
  static constexpr size_t kKept = 8;
  void Return(StepBatch* batch);

  std::mutex mu_;
  std::vector<std::unique_ptr<StepBatch>> free_;
};

struct Engine::State {
  EngineOptions options;
  Backend* backend = nullptr;
  Metrics* metrics = nullptr;
  const std::shared_ptr<StepBatchPool> batches = std::make_shared<StepBatchPool>();

  mutable absl::Mutex mu;
  absl::flat_hash_map<std::string, std::shared_ptr<CacheEntry>> caches ABSL_GUARDED_BY(mu);
  // Names of caches whose pools CreateCache is allocating (outside the lock), with their
  // geometry: taken, but not yet caches.
  absl::flat_hash_map<std::string, CacheGeometry> creating ABSL_GUARDED_BY(mu);
  absl::flat_hash_map<uint64_t, std::shared_ptr<StepEntry>> open_steps ABSL_GUARDED_BY(mu);
  // Outcomes of recently ended steps, so a late EndStep or Forward (of the step's tenant) gets a
  // precise answer.
  struct FinishedStep {
    EndStepResult result;
    std::string tenant;
    // The step itself until it is finalized (an ended step may still wait for its parents or its
    // commit copies): an EndStep meanwhile waits for it, so that its answer comes once the
    // sequences' lengths moved.
    std::weak_ptr<StepEntry> entry;
  };
  absl::flat_hash_map<uint64_t, FinishedStep> finished ABSL_GUARDED_BY(mu);
  // Open steps per non-empty tenant (entries at zero are erased).
  absl::flat_hash_map<std::string, int32_t> open_steps_by_tenant ABSL_GUARDED_BY(mu);
  std::deque<uint64_t> finished_order ABSL_GUARDED_BY(mu);
  uint64_t next_step_id ABSL_GUARDED_BY(mu) = 1;
  absl::flat_hash_map<uint64_t, std::shared_ptr<ChannelEntry>> channels ABSL_GUARDED_BY(mu);
  // Closed channels whose steps still have layers in flight; the reaper frees them.
  std::vector<std::shared_ptr<ChannelEntry>> closing_channels ABSL_GUARDED_BY(mu);
  uint64_t next_channel_id ABSL_GUARDED_BY(mu) = 1;
  // OpenChannel calls making their rings (without the lock); they count as open channels.
  int32_t opening_channels ABSL_GUARDED_BY(mu) = 0;
  int64_t channel_bytes ABSL_GUARDED_BY(mu) = 0;
  bool draining ABSL_GUARDED_BY(mu) = false;
  bool stopping ABSL_GUARDED_BY(mu) = false;
  // Layers running on the backend across all steps, and early commits' page copies being made;
  // the engine outlives them (destructor waits).
  int64_t layers_in_flight ABSL_GUARDED_BY(mu) = 0;
  int64_t copies_in_flight ABSL_GUARDED_BY(mu) = 0;
  std::thread reaper;

  // A condition for mu.Await (which evaluates it with mu held).
  bool NothingInFlight() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    return layers_in_flight == 0 && copies_in_flight == 0;
  }

  // What a call made under mu leaves for after the lock's release; the caller runs it then.
  // Callbacks: answers, channel cancels, an early commit's page copies. Released steps: step
  // references the call let go of, any of which may be the last one to its step and through it
  // to a deleted cache (its pools; on a GPU, its streams, which their destruction waits for) or
  // a channel: a step is destroyed only here, after the lock.
  class Deferred {
   public:
    Deferred() = default;
    Deferred(const Deferred&) = delete;
    Deferred& operator=(const Deferred&) = delete;
    void Add(std::function<void()> callback) { callbacks_.push_back(std::move(callback)); }
    void Release(std::shared_ptr<StepEntry> step) {
      if (step != nullptr) steps_.push_back(std::move(step));
    }
    void Release(std::vector<std::shared_ptr<StepEntry>>&& steps);
    bool empty() const { return callbacks_.empty() && steps_.empty(); }
    // Runs the callbacks in order, then drops them and the released steps. Without mu.
    void Run();

   private:
    std::vector<std::function<void()>> callbacks_;
    std::vector<std::shared_ptr<StepEntry>> steps_;
  };

  // Decides the step's fate; applies it now if nothing is in flight. Returns callbacks to run.
  void EndLocked(const std::shared_ptr<StepEntry>& step, StepOutcome outcome, Deferred& deferred)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // Applies a decided outcome once it can: nothing of the step in flight, and (commit) its
  // parents finalized or (abort) its children finalized; then does the same for the steps that
  // were waiting for this one.
  void TryFinalizeLocked(const std::shared_ptr<StepEntry>& step, Deferred& deferred)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // Commits lengths or rolls back pages. Called by TryFinalizeLocked only.
  void FinalizeLocked(StepEntry& step, Deferred& deferred) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // A step committing before it ran every layer: when it replaced shared pages by copies
  // (copy-on-write), the layers it did not run need the copies too. Marks the step `copying`
  // and defers MakeCommitCopies (device copies and a wait: not under the lock); returns false
  // when there is nothing to copy (or it was done) and the step may be finalized now.
  bool StartCommitCopiesLocked(const std::shared_ptr<StepEntry>& step, Deferred& deferred)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // Makes those copies (without mu), then finalizes the step (a failed copy fails the cache).
  void MakeCommitCopies(const std::shared_ptr<StepEntry>& step, BackendCache* backend,
                        std::shared_ptr<const StepBatch> batch, std::vector<int32_t> layers)
      ABSL_LOCKS_EXCLUDED(mu);
  void PublishPagesLocked(const CacheEntry& cache) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // attnd_device_kv_bytes of every device (at start, and when a cache is created or deleted; a
  // deleted cache whose last layer is still landing frees its budget a moment later).
  void PublishDevices() const;
  // Aborts open steps idle for longer than the TTL.
  void ExpireLocked(absl::Time now, Deferred& deferred) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  void ReaperLoop();
  // Marks the channel closed, aborts its steps, queues on_closed; the ring goes once idle.
  // By value: the caller's reference may be the registry's own entry, which this erases.
  void CloseChannelLocked(std::shared_ptr<ChannelEntry> channel, const std::string& reason,
                          Deferred& deferred) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // A backend channel's on_broken: closes it (if still open) with the reason; takes the lock.
  // Destroys nothing: the reaper thread does, once the channel is idle.
  void CloseBrokenChannel(uint64_t channel_id, const absl::Status& why)
      ABSL_LOCKS_EXCLUDED(mu);
  // Takes closed channels with no step left out of the engine: their destruction (which joins
  // backend threads) must run outside the lock, so the caller destroys them.
  std::vector<std::shared_ptr<ChannelEntry>> TakeIdleChannelsLocked()
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // A channel step's layer reached its end (ChannelLayerDone).
  void ChannelLayerDone(const std::shared_ptr<StepEntry>& step, int32_t layer,
                        absl::Status status);
  // Starts a planned channel step on its channel. Under the lock (StartStep only queues), so it
  // precedes any CancelStep of the step, which an abort defers to after the lock.
  void StartChannelStep(const std::shared_ptr<StepEntry>& step) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);

  // Plan (plan.cc), in three parts. ReservePlanLocked validates the spec against `cache`,
  // allocates the step's slots all-or-nothing, builds its batch and registers it as preparing
  // (see StepEntry::preparing). The caller then prepares the backend step without the lock and
  // hands it to PublishPlanLocked, which makes the step plannable-on and runnable, or, when the
  // preparation failed or the step was aborted meanwhile, rolls the reservation back and
  // returns why.
  struct PlanReservation {
    std::shared_ptr<StepEntry> step;
    std::shared_ptr<StepBatch> batch;
    std::shared_ptr<ChannelEntry> channel;
    PlanResult result;
  };
  absl::Status ReservePlanLocked(const PlanSpec& spec, uint64_t owner,
                                 const std::shared_ptr<CacheEntry>& cache,
                                 PlanReservation& reservation) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  absl::Status PublishPlanLocked(const PlanSpec& spec, PlanReservation& reservation,
                                 std::unique_ptr<BackendStep>& backend_step,
                                 absl::Status prepared, Deferred& deferred)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);

  // The cache a new step or channel may use: NOT_FOUND, or INTERNAL when it failed.
  absl::StatusOr<std::shared_ptr<CacheEntry>> UsableCacheLocked(const std::string& name) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // Why `step_id` is not an open step of `tenant`: FAILED_PRECONDITION when it ended recently
  // (saying how), else NOT_FOUND.
  absl::Status NotOpenLocked(uint64_t step_id, const std::string& tenant) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // A layer of `step` finished on the device with `status`: counts it (committing the step
  // after its last layer) or, on a device fault, fails the cache. Returns the status to report.
  absl::Status LayerLandedLocked(const std::shared_ptr<StepEntry>& step, int32_t layer,
                                 absl::Status status, Deferred& deferred)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);

  // What GetCache/ListCaches and OpenChannel report (engine.cc, channels.cc).
  CacheStatus CacheStatusLocked(const CacheEntry& cache) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  ChannelStatus ChannelStatusLocked(const ChannelEntry& channel) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);

  // Copy-on-write and a step's hold on its sequences (lifecycle.cc).
  // Pages a step appending `new_tokens` to `sequence` must allocate for copies: 1 when it
  // writes into a partial last page that others hold, else 0.
  int64_t CopyOnWritePagesNeededLocked(const CacheEntry& cache, const Sequence& sequence,
                                       int32_t new_tokens) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // Replaces such a page in `sequence` by a fresh copy (a fresh page of `step`, a copy of
  // `batch`), noting it in `change`. Call before the step's other pages are allocated; the pool
  // holds the page (checked by CopyOnWritePagesNeededLocked).
  void CopyOnWriteLocked(CacheEntry& cache, Sequence& sequence, SequenceChange& change,
                         StepEntry& step, StepBatch& batch) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // Undoes `change` on `sequence` (abort, or Plan failing after allocation): length and pages
  // as they were, the replaced page back in place. The step's fresh pages are freed by the
  // caller.
  void RestoreSequenceLocked(Sequence& sequence, const SequenceChange& change)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // `step` lets go of the sequence `change` names: it leaves the sequence's open steps (its
  // latest open step reverts to the one before), and the sequence's length moves to the step's
  // end (`committed`) or the change is undone (RestoreSequenceLocked), the sequence erased when
  // nothing of it is left. Used by FinalizeLocked, for every end of a step (a Plan that fails
  // after allocating included).
  void EndSequenceChangeLocked(CacheEntry& cache, const StepEntry& step,
                               const SequenceChange& change, bool committed)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // The layers whose copy-on-write copies a committing step must still make: those it never ran
  // (an early commit), so the copied prefix is whole in every layer. Empty when the step made
  // no copies, ran every layer, or its cache failed.
  std::vector<int32_t> LayersToCopyAtCommitLocked(const CacheEntry& cache,
                                                  const StepEntry& step) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // A committed step lets go of the shared pages its copies replaced.
  void ReleaseReplacedPagesLocked(CacheEntry& cache, const StepEntry& step)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
};


}  // namespace attnd
