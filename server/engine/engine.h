// The engine: caches, their page allocation and sequences, and the step life cycle
// (Plan -> Forward per layer -> commit, or roll back). Thread-safe; no call blocks on the
// device: Forward and EndStep report through callbacks run on backend threads.
//
// Rollback guarantee: a step that aborts (EndStep{abort}, its stream ending, TTL expiry, or a
// forced cache deletion) restores every sequence's length and page list and returns its fresh
// pages; pages are only returned once no layer of the step is still running on the device,
// so a later step can never receive a page that an aborted one is still writing.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "backend/backend.h"
#include "engine/specs.h"
#include "options.h"

namespace attnd {

class Metrics;
struct CacheEntry;
struct ChannelEntry;
struct ChannelLayout;
class ChannelTransfer;
class SequenceExport;
class SequenceImport;

struct EngineOptions {
  ServerLimitsOptions limits;
  absl::Duration step_ttl = absl::Seconds(60);
};

class Engine {
 public:
  // `backend` and `metrics` (may be null) must outlive the engine.
  Engine(const EngineOptions& options, Backend* backend, Metrics* metrics);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Decides whether a cache may be created, given every cache there is or is being created
  // (name, num_pages): a tenant's page quota. Runs under the engine's lock, so that concurrent
  // creations are counted against each other; it must be quick and must not call the engine.
  using CacheAdmission =
      std::function<absl::Status(const std::vector<std::pair<std::string, int64_t>>& caches)>;
  // The pools are allocated without the engine's lock, the name reserved meanwhile.
  absl::StatusOr<CacheStatus> CreateCache(const CacheSpec& spec,
                                          const CacheAdmission& admit = nullptr);
  absl::StatusOr<CacheStatus> GetCache(const std::string& name) const;
  std::vector<CacheStatus> ListCaches() const;
  absl::Status DeleteCache(const std::string& name, bool force);
  // Returns the number of pages freed.
  absl::StatusOr<int64_t> FreeSequences(const std::string& cache,
                                        const std::vector<uint64_t>& sequence_ids);

  // Sequence lifecycle (lifecycle.cc), MANAGED caches only. ForkSequence makes `spec.new_id`
  // share the source's first num_tokens (its pages by reference; see PageAllocator); the
  // partial last page is copied by the first step that writes into it (Plan).
  absl::StatusOr<ForkResult> ForkSequence(const ForkSpec& spec);
  // A snapshot of a committed sequence for export: its pages are pinned (one more holder each)
  // until the SequenceExport is destroyed. The engine must outlive it.
  absl::StatusOr<std::unique_ptr<SequenceExport>> ExportSequence(const std::string& cache,
                                                                 uint64_t sequence_id);
  // Reserves `sequence_id` and the pages of `num_tokens` tokens for an import; nothing is
  // visible until SequenceImport::Commit. `source` is the exported cache's geometry, checked
  // against the cache's. The engine must outlive it.
  absl::StatusOr<std::unique_ptr<SequenceImport>> ImportSequence(const std::string& cache,
                                                                 uint64_t sequence_id,
                                                                 int64_t num_tokens,
                                                                 const CacheGeometry& source);

  // `owner` tags the step with the stream that planned it (0: unary), see AbortOwnedSteps.
  absl::StatusOr<PlanResult> Plan(const PlanSpec& spec, uint64_t owner = 0);
  // Runs one layer; `done` runs exactly once, possibly before Forward returns (bad input).
  void Forward(const ForwardArgs& args, ForwardOutputs* outputs,
               std::function<void(absl::Status)> done);
  // Commits or aborts; `done` runs once no layer of the step is in flight. A step planned by
  // another tenant (PlanSpec::tenant) is NOT_FOUND, as for Forward.
  void EndStep(uint64_t step_id, bool abort,
               std::function<void(absl::StatusOr<EndStepResult>)> done,
               const std::string& tenant = "");
  // Aborts every open step planned with this owner (a stream that ended).
  void AbortOwnedSteps(uint64_t owner);

  // Channels (DESIGN 3b). OpenChannel creates the ring on the cache's backend; `on_closed`
  // runs exactly once, outside the engine's lock, with the reason, whatever closes the channel
  // (CloseChannel, DeleteCache, shutdown). Closing aborts the channel's open steps; its memory
  // is freed once no layer of it is in flight.
  absl::StatusOr<ChannelStatus> OpenChannel(const ChannelOpenSpec& spec,
                                            std::function<void(std::string reason)> on_closed);
  // NOT_FOUND for an unknown id or another tenant's channel.
  absl::Status CloseChannel(uint64_t channel_id, const std::string& tenant,
                            const std::string& reason);
  // Closes every channel (shutdown), so that their calls end.
  void CloseAllChannels(const std::string& reason);
  int OpenChannels() const;
  // Lends channel `channel_id` of `tenant` to one sequence transfer (sequence_transfer.h):
  // NOT_FOUND for an unknown id or another tenant's channel, FAILED_PRECONDITION for a channel
  // without a ring (NCCL), with open steps or already lent. The engine must outlive the loan.
  absl::StatusOr<std::unique_ptr<ChannelTransfer>> LendChannel(uint64_t channel_id,
                                                               const std::string& tenant);

  // Draining: Plan refuses new steps with UNAVAILABLE; open steps may finish.
  void SetDraining(bool draining);
  int OpenSteps() const;
  // Aborts open steps idle for longer than the step TTL. Called periodically by the engine's
  // own reaper thread; public for tests.
  void ExpireSteps(absl::Time now);

  // For tests and diagnostics: the committed length of a managed sequence or, with `pending`,
  // the length after its open steps (where a step planned now starts).
  absl::StatusOr<int64_t> SequenceLength(const std::string& cache, uint64_t sequence_id,
                                         bool pending = false) const;
  // For tests: raw bytes of a cache's pool pages (see BackendCache::ReadPages).
  absl::Status ReadPages(const std::string& cache, int32_t layer, bool v_pool,
                         int64_t first_page, std::span<uint8_t> bytes) const;

 private:
  void ForwardThroughChannel(const ForwardArgs& args, ForwardOutputs* outputs,
                             std::function<void(absl::Status)> done);
  // Frees closed channels with no step left (joins their threads: callers are API calls, never
  // a backend callback). The reaper thread does the same periodically.
  void ReapIdleChannels();

  struct State;
  std::unique_ptr<State> state_;
  friend class SequenceExport;
  friend class SequenceImport;
  friend class ChannelTransfer;
};

// A channel lent to one ExportSequence or ImportSequence (Engine::LendChannel). While it lives
// the channel carries nothing else (Plan on it is FAILED_PRECONDITION), and its ring stays
// mapped even when the channel closes meanwhile (CheckOpen then says so); destroying it gives
// the channel back. Thread-compatible.
class ChannelTransfer {
 public:
  ~ChannelTransfer();
  ChannelTransfer(const ChannelTransfer&) = delete;
  ChannelTransfer& operator=(const ChannelTransfer&) = delete;

  uint64_t channel_id() const;
  ChannelKind kind() const;
  const ChannelLayout& layout() const;
  // The ring's bytes and flag words (BackendChannel's transfer access).
  BackendChannel& ring() const;
  // UNAVAILABLE once the channel closed (CloseChannel, its OpenChannel call ended, shutdown).
  absl::Status CheckOpen() const;

 private:
  friend class Engine;
  ChannelTransfer() = default;
  Engine::State* state_ = nullptr;
  std::shared_ptr<ChannelEntry> channel_;
};

// An exported sequence's pages, pinned. Reads are synchronous device copies: call them off the
// gRPC threads' hot path, never under a lock. Thread-compatible.
class SequenceExport {
 public:
  ~SequenceExport();
  SequenceExport(const SequenceExport&) = delete;
  SequenceExport& operator=(const SequenceExport&) = delete;

  const CacheSpec& spec() const { return spec_; }
  uint64_t sequence_id() const { return sequence_id_; }
  int64_t num_tokens() const { return num_tokens_; }
  int64_t num_pages() const { return static_cast<int64_t>(pages_.size()); }
  // Copies pages [first_page, first_page + count) of the sequence, one layer's pool, to `bytes`
  // (count pages of K or V page bytes).
  absl::Status Read(int32_t layer, bool v_pool, int64_t first_page, int64_t count,
                    std::span<uint8_t> bytes) const;

 private:
  friend class Engine;
  SequenceExport() = default;
  Engine::State* state_ = nullptr;
  std::shared_ptr<CacheEntry> cache_;
  CacheSpec spec_;
  uint64_t sequence_id_ = 0;
  int64_t num_tokens_ = 0;
  std::vector<int32_t> pages_;
};

// A sequence being imported: its id reserved and its pages allocated but invisible (Plan,
// ForkSequence and another import of the id are refused) until Commit. Destroyed without a
// successful Commit, it frees both. Thread-compatible.
class SequenceImport {
 public:
  ~SequenceImport();
  SequenceImport(const SequenceImport&) = delete;
  SequenceImport& operator=(const SequenceImport&) = delete;

  const CacheGeometry& geometry() const;
  uint64_t sequence_id() const { return sequence_id_; }
  int64_t num_tokens() const { return num_tokens_; }
  int64_t num_pages() const { return static_cast<int64_t>(pages_.size()); }
  // Writes pages [first_page, first_page + count) of one layer's pool from `bytes`.
  absl::Status Write(int32_t layer, bool v_pool, int64_t first_page, int64_t count,
                     std::span<const uint8_t> bytes);
  // Makes the sequence visible, whole. The caller has written every page of every layer.
  absl::Status Commit();

 private:
  friend class Engine;
  SequenceImport() = default;
  Engine::State* state_ = nullptr;
  std::shared_ptr<CacheEntry> cache_;
  uint64_t sequence_id_ = 0;
  int64_t num_tokens_ = 0;
  std::vector<int32_t> pages_;
  bool committed_ = false;
};

}  // namespace attnd
