// The engine holds no daemon-wide lock across a backend call that can touch the device: while
// one cache's Plan is in PrepareStep (or a cache's pools, or a channel's ring, are being made,
// or an early commit's copy-on-write pages are being copied), every other call completes; and
// whatever ends a step meanwhile (a forced delete, TTL expiry of the step it follows, its
// stream ending, the preparation failing) leaves no half step behind.
//
// The backend is the CPU backend behind a wrapper whose PrepareStep, CreateCache,
// CreateChannel and CopyPages block at a gate when armed, standing in for a device that takes
// its time.
#include <functional>
#include <thread>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "engine/engine.h"
#include "engine_test_util.h"

namespace attnd {
namespace {

using ::attnd::testing::Decode;
using ::attnd::testing::EndStepSync;
using ::attnd::testing::ForwardSync;
using ::attnd::testing::RandomLayer;
using ::attnd::testing::RunAllLayers;
using ::attnd::testing::SmallCache;
using ::testing::HasSubstr;

// Long enough for a loaded CI machine; a call that waits for the gated one never gets there.
constexpr absl::Duration kPatience = absl::Seconds(20);

// Where a backend call blocks while armed: the calls after Arm() wait in Pass() until Release().
class Gate {
 public:
  void Arm(absl::Status failure = absl::OkStatus()) {
    absl::MutexLock lock(&mu_);
    armed_ = true;
    released_ = false;
    failure_ = std::move(failure);
  }
  // Called by the backend: blocks while armed and not released; returns the injected failure.
  absl::Status Pass() {
    absl::MutexLock lock(&mu_);
    if (!armed_) return absl::OkStatus();
    ++entered_;
    mu_.Await(absl::Condition(&released_));
    return failure_;
  }
  bool WaitEntered(int count = 1) {
    absl::MutexLock lock(&mu_);
    auto entered = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return entered_ >= count; };
    return mu_.AwaitWithTimeout(absl::Condition(&entered), kPatience);
  }
  void Release() {
    absl::MutexLock lock(&mu_);
    armed_ = false;
    released_ = true;
  }

 private:
  absl::Mutex mu_;
  bool armed_ ABSL_GUARDED_BY(mu_) = false;
  bool released_ ABSL_GUARDED_BY(mu_) = false;
  int entered_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Status failure_ ABSL_GUARDED_BY(mu_);
};

// A cache's gates: shared by the cache and the test, which may outlive the cache.
struct CacheGates {
  Gate prepare;  // PrepareStep and PrepareChannelStep
  Gate channel;  // CreateChannel
  Gate copy;     // CopyPages
};

class GatedCache final : public BackendCache {
 public:
  GatedCache(std::unique_ptr<BackendCache> inner, std::shared_ptr<CacheGates> gates)
      : inner_(std::move(inner)), gates_(std::move(gates)) {}
  const CacheGeometry& geometry() const override { return inner_->geometry(); }
  int32_t device() const override { return inner_->device(); }
  absl::StatusOr<std::unique_ptr<BackendStep>> PrepareStep(
      std::shared_ptr<const StepBatch> batch) override {
    if (absl::Status status = gates_->prepare.Pass(); !status.ok()) return status;
    return inner_->PrepareStep(std::move(batch));
  }
  absl::StatusOr<std::unique_ptr<BackendStep>> PrepareChannelStep(
      std::shared_ptr<const StepBatch> batch, BackendChannel* channel) override {
    if (absl::Status status = gates_->prepare.Pass(); !status.ok()) return status;
    return inner_->PrepareChannelStep(std::move(batch), channel);
  }
  absl::StatusOr<std::unique_ptr<BackendChannel>> CreateChannel(
      const ChannelSpec& spec) override {
    if (absl::Status status = gates_->channel.Pass(); !status.ok()) return status;
    return inner_->CreateChannel(spec);
  }
  absl::Status ReadPages(int32_t layer, bool v_pool, int64_t first_page,
                         std::span<uint8_t> bytes) override {
    return inner_->ReadPages(layer, v_pool, first_page, bytes);
  }
  absl::Status CopyPages(int32_t layer, std::span<const PageCopy> copies) override {
    if (absl::Status status = gates_->copy.Pass(); !status.ok()) return status;
    return inner_->CopyPages(layer, copies);
  }

 private:
  std::unique_ptr<BackendCache> inner_;
  std::shared_ptr<CacheGates> gates_;
};

// The CPU backend, with a gate on CreateCache and gates of each cache, by creation order.
class GatedBackend final : public Backend {
 public:
  GatedBackend() {
    CpuBackendOptions options;
    options.kv_budget_bytes = 64 << 20;
    options.num_workers = 2;
    inner_ = MakeCpuBackend(options);
  }
  BackendInfo Info() const override { return inner_->Info(); }
  int64_t KvFreeBytes() const override { return inner_->KvFreeBytes(); }
  int64_t KvFreeBytesOn(int32_t device) const override { return inner_->KvFreeBytesOn(device); }
  absl::StatusOr<std::unique_ptr<BackendCache>> CreateCache(const CacheGeometry& geometry,
                                                            int32_t device) override {
    if (absl::Status status = create.Pass(); !status.ok()) return status;
    absl::StatusOr<std::unique_ptr<BackendCache>> cache = inner_->CreateCache(geometry, device);
    if (!cache.ok()) return cache.status();
    auto gates = std::make_shared<CacheGates>();
    {
      absl::MutexLock lock(&mu_);
      gates_.push_back(gates);
    }
    return std::unique_ptr<BackendCache>(
        std::make_unique<GatedCache>(std::move(cache).value(), std::move(gates)));
  }
  // The gates of the index-th cache created.
  CacheGates& gates(size_t index) {
    absl::MutexLock lock(&mu_);
    return *gates_.at(index);
  }
  void ReleaseAll() {
    create.Release();
    absl::MutexLock lock(&mu_);
    for (auto& gates : gates_) {
      gates->prepare.Release();
      gates->channel.Release();
      gates->copy.Release();
    }
  }

  Gate create;

 private:
  std::unique_ptr<Backend> inner_;
  absl::Mutex mu_;
  std::vector<std::shared_ptr<CacheGates>> gates_ ABSL_GUARDED_BY(mu_);
};

// Runs `calls` on another thread and fails (instead of hanging) when they do not finish within
// kPatience: they would be waiting for the call held at `gate`, which is then opened so that
// everything can end.
void CompletesWhileGated(const std::function<void()>& calls, Gate& gate) {
  absl::Notification done;
  std::thread thread([&] {
    calls();
    done.Notify();
  });
  const bool finished = done.WaitForNotificationWithTimeout(kPatience);
  if (!finished) gate.Release();
  thread.join();
  EXPECT_TRUE(finished) << "a call waited for the gated backend call";
}

class PlanConcurrencyTest : public ::testing::Test {
 protected:
  void SetUp() override {
    engine_ = std::make_unique<Engine>(EngineOptions(), &backend_, nullptr);
    ASSERT_TRUE(engine_->CreateCache(SmallCache("slow")).ok());
    ASSERT_TRUE(engine_->CreateCache(SmallCache("fast")).ok());
  }
  void TearDown() override {
    backend_.ReleaseAll();
    if (planner_.joinable()) planner_.join();
    engine_.reset();
  }
  // The gates of cache "slow" (created first); "fast" is never gated.
  Gate& SlowPrepare() { return backend_.gates(0).prepare; }
  Gate& SlowChannel() { return backend_.gates(0).channel; }
  Gate& SlowCopy() { return backend_.gates(0).copy; }
  // Starts a Plan on cache "slow" on another thread and waits until it blocks in PrepareStep.
  void StartGatedPlan(PlanSpec spec, uint64_t owner = 0) {
    SlowPrepare().Arm(prepare_failure_);
    planner_ = std::thread([this, spec = std::move(spec), owner] {
      gated_plan_ = engine_->Plan(spec, owner);
    });
    ASSERT_TRUE(SlowPrepare().WaitEntered()) << "Plan never reached PrepareStep";
  }
  absl::StatusOr<PlanResult> FinishGatedPlan() {
    SlowPrepare().Release();
    planner_.join();
    return gated_plan_;
  }
  int64_t UsedPages(const std::string& cache) { return engine_->GetCache(cache)->used_pages; }
  // Layer `layer`'s K and V pools of cache "slow", page by page.
  std::vector<std::string> SlowPages(int32_t layer) {
    std::vector<std::string> pages;
    for (const bool v_pool : {false, true}) {
      const int64_t page_bytes = v_pool ? geometry_.VPageBytes() : geometry_.KPageBytes();
      std::string pool(page_bytes * geometry_.num_pages, '\0');
      EXPECT_TRUE(engine_
                      ->ReadPages("slow", layer, v_pool, 0,
                                  std::span<uint8_t>(reinterpret_cast<uint8_t*>(pool.data()),
                                                     pool.size()))
                      .ok());
      for (int64_t page = 0; page < geometry_.num_pages; ++page) {
        pages.push_back(pool.substr(page * page_bytes, page_bytes));
      }
    }
    return pages;
  }
  // Sequence 2 of cache "slow": a fork of sequence 1's 6 tokens (two pages, the second partial
  // and shared), planned for one token, which copies the shared page; layer 0 run. Returns
  // the step, ready to commit early: layer 1 gets its copy at the commit.
  uint64_t PlanForkedDecodeWithLayerZero() {
    auto source = engine_->Plan(Decode("slow", {{1, 6}}));
    EXPECT_TRUE(source.ok()) << source.status();
    RunAllLayers(*engine_, geometry_, *source);
    EXPECT_TRUE(engine_->ForkSequence(ForkSpec{"slow", 1, 2, 0}).ok());
    auto plan = engine_->Plan(Decode("slow", {{2, 1}}));
    EXPECT_TRUE(plan.ok()) << plan.status();
    EXPECT_EQ(UsedPages("slow"), 3);  // the source's two and the copy
    const testing::LayerTensors t = RandomLayer(geometry_, 1, 9);
    EXPECT_TRUE(ForwardSync(*engine_, t.Args(plan->step_id, 0, geometry_, 1))->status.ok());
    return plan->step_id;
  }
  // Pages come back once nothing of a step runs: a channel step's cancelled layers land on the
  // channel's own thread, so wait a little for them.
  bool SettlesTo(const std::string& cache, int64_t used_pages) {
    const absl::Time deadline = absl::Now() + kPatience;
    while (absl::Now() < deadline) {
      if (UsedPages(cache) == used_pages && engine_->OpenSteps() == 0) return true;
      absl::SleepFor(absl::Milliseconds(5));
    }
    return false;
  }

  GatedBackend backend_;
  std::unique_ptr<Engine> engine_;
  std::thread planner_;
  absl::StatusOr<PlanResult> gated_plan_;
  absl::Status prepare_failure_;
  const CacheGeometry geometry_ = SmallCache("any").geometry;
};

TEST_F(PlanConcurrencyTest, PlanInPrepareStepBlocksNoOtherCall) {
  StartGatedPlan(Decode("slow", {{1, 3}}));
  CompletesWhileGated([&] {
    // The registry, with the step being planned counted and its pages reserved.
    auto slow = engine_->GetCache("slow");
    ASSERT_TRUE(slow.ok());
    EXPECT_EQ(slow->open_steps, 1);
    EXPECT_EQ(slow->used_pages, 1);
    EXPECT_EQ(engine_->ListCaches().size(), 2u);
    EXPECT_EQ(engine_->SequenceLength("slow", 1, /*pending=*/true).value(), 3);
    // A whole step on another cache: Plan, every layer's Forward and its completion, commit.
    auto fast = engine_->Plan(Decode("fast", {{1, 5}}));
    ASSERT_TRUE(fast.ok()) << fast.status();
    RunAllLayers(*engine_, geometry_, *fast);
    EXPECT_EQ(engine_->SequenceLength("fast", 1).value(), 5);
    auto aborted = engine_->Plan(Decode("fast", {{2, 1}}));
    ASSERT_TRUE(aborted.ok());
    EXPECT_TRUE(EndStepSync(*engine_, aborted->step_id, /*abort=*/true).ok());
    // The step being planned is not a step yet: not for Forward, not for EndStep (its id is
    // the first one), not for the TTL; its sequence is busy, its cache not deletable without
    // force.
    const testing::LayerTensors t = RandomLayer(geometry_, 3, 1);
    EXPECT_EQ(ForwardSync(*engine_, t.Args(1, 0, geometry_, 3))->status.code(),
              absl::StatusCode::kNotFound);
    EXPECT_EQ(EndStepSync(*engine_, 1, /*abort=*/true).status().code(),
              absl::StatusCode::kNotFound);
    engine_->ExpireSteps(absl::Now() + absl::Hours(24));
    EXPECT_EQ(engine_->OpenSteps(), 1);
    EXPECT_EQ(engine_->FreeSequences("slow", {1}).status().code(),
              absl::StatusCode::kFailedPrecondition);
    EXPECT_EQ(engine_->DeleteCache("slow", /*force=*/false).code(),
              absl::StatusCode::kFailedPrecondition);
    EXPECT_TRUE(engine_->CreateCache(SmallCache("third")).ok());
    EXPECT_TRUE(engine_->DeleteCache("third", /*force=*/false).ok());
  }, SlowPrepare());

  auto plan = FinishGatedPlan();
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->step_id, 1u);
  EXPECT_EQ(plan->entries[0].start_position, 0);
  RunAllLayers(*engine_, geometry_, *plan);
  EXPECT_EQ(engine_->SequenceLength("slow", 1).value(), 3);
  EXPECT_EQ(engine_->OpenSteps(), 0);
}

TEST_F(PlanConcurrencyTest, ForcedDeleteDuringPlanAbortsItAndFreesThePools) {
  const int64_t free_before = backend_.KvFreeBytes();
  const int64_t pool_bytes = geometry_.PoolBytes();
  StartGatedPlan(Decode("slow", {{1, 3}}));
  CompletesWhileGated([&] {
    EXPECT_TRUE(engine_->DeleteCache("slow", /*force=*/true).ok());
    EXPECT_EQ(engine_->GetCache("slow").status().code(), absl::StatusCode::kNotFound);
    EXPECT_EQ(engine_->OpenSteps(), 0);  // aborted: gone from the open steps at once
  }, SlowPrepare());
  // The pools stay while the Plan uses them.
  EXPECT_EQ(backend_.KvFreeBytes(), free_before);

  auto plan = FinishGatedPlan();
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kAborted);
  EXPECT_THAT(plan.status().message(), HasSubstr("the cache was deleted"));
  EXPECT_EQ(backend_.KvFreeBytes(), free_before + pool_bytes);
  EXPECT_EQ(engine_->OpenSteps(), 0);
  // The name is free again, and the new cache starts empty.
  ASSERT_TRUE(engine_->CreateCache(SmallCache("slow")).ok());
  EXPECT_EQ(UsedPages("slow"), 0);
  EXPECT_EQ(engine_->SequenceLength("slow", 1, /*pending=*/true).value(), 0);
}

TEST_F(PlanConcurrencyTest, StreamEndingDuringPlanAbortsItAndRollsBack) {
  auto committed = engine_->Plan(Decode("slow", {{1, 2}}));
  ASSERT_TRUE(committed.ok());
  RunAllLayers(*engine_, geometry_, *committed);
  StartGatedPlan(Decode("slow", {{1, 3}, {2, 4}}), /*owner=*/7);
  CompletesWhileGated([&] {
    EXPECT_EQ(UsedPages("slow"), 3);  // 5 tokens of sequence 1, 4 of sequence 2
    engine_->AbortOwnedSteps(7);
  }, SlowPrepare());

  auto plan = FinishGatedPlan();
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kAborted);
  EXPECT_EQ(UsedPages("slow"), 1);
  EXPECT_EQ(engine_->SequenceLength("slow", 1, /*pending=*/true).value(), 2);
  EXPECT_EQ(engine_->SequenceLength("slow", 2, /*pending=*/true).value(), 0);
  EXPECT_EQ(engine_->OpenSteps(), 0);
  auto next = engine_->Plan(Decode("slow", {{1, 1}}));
  ASSERT_TRUE(next.ok());
  EXPECT_EQ(next->entries[0].start_position, 2);
}

TEST_F(PlanConcurrencyTest, FailedPrepareStepChangesNothing) {
  prepare_failure_ = absl::ResourceExhaustedError("no room for the plan");
  StartGatedPlan(Decode("slow", {{1, 3}}));
  auto plan = FinishGatedPlan();
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(plan.status().message(), HasSubstr("plan step for cache 'slow'"));
  EXPECT_EQ(UsedPages("slow"), 0);
  EXPECT_EQ(engine_->GetCache("slow")->num_sequences, 0);
  EXPECT_EQ(engine_->OpenSteps(), 0);
}

TEST_F(PlanConcurrencyTest, ChainedPlanWhoseParentExpiresIsAbortedAndRolledBack) {
  ChannelOpenSpec open;
  open.cache = "slow";
  open.max_tokens = 8;
  auto channel = engine_->OpenChannel(open, [](std::string) {});
  ASSERT_TRUE(channel.ok()) << channel.status();
  PlanSpec parent = Decode("slow", {{1, 2}});
  parent.channel_id = channel->id;
  auto parent_plan = engine_->Plan(parent);
  ASSERT_TRUE(parent_plan.ok()) << parent_plan.status();

  // Planned on top of the open parent, through the same channel.
  PlanSpec child = Decode("slow", {{1, 1}});
  child.channel_id = channel->id;
  StartGatedPlan(child);
  CompletesWhileGated([&] {
    EXPECT_EQ(engine_->SequenceLength("slow", 1, /*pending=*/true).value(), 3);
    // The parent's ready words never come: its TTL runs out, and the child goes with it.
    engine_->ExpireSteps(absl::Now() + absl::Hours(24));
    EXPECT_EQ(engine_->OpenSteps(), 0);
  }, SlowPrepare());

  auto plan = FinishGatedPlan();
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kAborted);
  EXPECT_TRUE(SettlesTo("slow", 0));
  EXPECT_EQ(engine_->SequenceLength("slow", 1, /*pending=*/true).value(), 0);
  EXPECT_EQ(EndStepSync(*engine_, parent_plan->step_id, false)->outcome, StepOutcome::kAborted);
  // The channel is usable again: a new step gets the next sequence number.
  PlanSpec again = Decode("slow", {{1, 1}});
  again.channel_id = channel->id;
  auto next = engine_->Plan(again);
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_EQ(next->channel_sequence, parent_plan->channel_sequence + 1);
  EXPECT_TRUE(EndStepSync(*engine_, next->step_id, /*abort=*/true).ok());
}

TEST_F(PlanConcurrencyTest, ChannelClosingDuringPlanAbortsIt) {
  ChannelOpenSpec open;
  open.cache = "slow";
  open.max_tokens = 8;
  auto channel = engine_->OpenChannel(open, [](std::string) {});
  ASSERT_TRUE(channel.ok()) << channel.status();
  PlanSpec spec = Decode("slow", {{1, 2}});
  spec.channel_id = channel->id;
  StartGatedPlan(spec);
  CompletesWhileGated([&] {
    EXPECT_TRUE(engine_->CloseChannel(channel->id, "", "test").ok());
    EXPECT_EQ(engine_->OpenChannels(), 0);
  }, SlowPrepare());
  auto plan = FinishGatedPlan();
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kAborted);
  EXPECT_THAT(plan.status().message(), HasSubstr("closed"));
  EXPECT_TRUE(SettlesTo("slow", 0));
  EXPECT_EQ(engine_->SequenceLength("slow", 1, /*pending=*/true).value(), 0);
}

TEST_F(PlanConcurrencyTest, EarlyCommitCopiesPagesWithoutTheLockAndHidesTheSequence) {
  const uint64_t step_id = PlanForkedDecodeWithLayerZero();
  const std::vector<std::string> layer1_before = SlowPages(1);
  SlowCopy().Arm();
  absl::StatusOr<EndStepResult> ended;
  std::thread ender([&] { ended = EndStepSync(*engine_, step_id, /*abort=*/false); });
  ASSERT_TRUE(SlowCopy().WaitEntered()) << "the early commit never copied layer 1";
  CompletesWhileGated([&] {
    // Other caches, and other sequences of this cache, go on.
    auto fast = engine_->Plan(Decode("fast", {{1, 5}}));
    ASSERT_TRUE(fast.ok()) << fast.status();
    RunAllLayers(*engine_, geometry_, *fast);
    EXPECT_EQ(engine_->SequenceLength("fast", 1).value(), 5);
    auto other = engine_->Plan(Decode("slow", {{3, 2}}));
    ASSERT_TRUE(other.ok()) << other.status();
    RunAllLayers(*engine_, geometry_, *other);
    EXPECT_EQ(engine_->SequenceLength("slow", 3).value(), 2);
    // The committing step is still open on its cache, and its sequence out of reach: not
    // plannable, forkable, exportable or freeable, its committed length not yet moved.
    EXPECT_EQ(engine_->GetCache("slow")->open_steps, 1);
    EXPECT_EQ(engine_->SequenceLength("slow", 2).value(), 6);
    EXPECT_EQ(engine_->Plan(Decode("slow", {{2, 1}})).status().code(),
              absl::StatusCode::kFailedPrecondition);
    EXPECT_EQ(engine_->ForkSequence(ForkSpec{"slow", 2, 4, 0}).status().code(),
              absl::StatusCode::kFailedPrecondition);
    EXPECT_EQ(engine_->ExportSequence("slow", 2).status().code(),
              absl::StatusCode::kFailedPrecondition);
    EXPECT_EQ(engine_->FreeSequences("slow", {2}).status().code(),
              absl::StatusCode::kFailedPrecondition);
    EXPECT_EQ(engine_->DeleteCache("slow", /*force=*/false).code(),
              absl::StatusCode::kFailedPrecondition);
  }, SlowCopy());
  SlowCopy().Release();
  ender.join();
  ASSERT_TRUE(ended.ok()) << ended.status();
  EXPECT_EQ(ended->outcome, StepOutcome::kCommitted);
  EXPECT_EQ(ended->layers_run, 1);
  EXPECT_EQ(engine_->SequenceLength("slow", 2).value(), 7);
  EXPECT_EQ(engine_->GetCache("slow")->open_steps, 0);
  EXPECT_FALSE(engine_->GetCache("slow")->failed);
  // In layer 1, which the step never ran, the copy holds the shared page's bytes: of the pages
  // that changed there (the copy, and sequence 3's page), one is a copy of a page written before.
  const std::vector<std::string> layer1_after = SlowPages(1);
  int copies = 0;
  for (size_t page = 0; page < layer1_after.size(); ++page) {
    if (layer1_after[page] == layer1_before[page]) continue;
    for (size_t source = 0; source < layer1_before.size(); ++source) {
      if (source != page && layer1_after[page] == layer1_before[source] &&
          layer1_before[source] != std::string(layer1_before[source].size(), '\0')) {
        ++copies;
        break;
      }
    }
  }
  EXPECT_EQ(copies, 2);  // K and V
  EXPECT_TRUE(engine_->Plan(Decode("slow", {{2, 1}})).ok());
}

TEST_F(PlanConcurrencyTest, FailedEarlyCommitCopyFailsTheCache) {
  const uint64_t step_id = PlanForkedDecodeWithLayerZero();
  SlowCopy().Arm(absl::InternalError("device lost"));
  absl::StatusOr<EndStepResult> ended;
  std::thread ender([&] { ended = EndStepSync(*engine_, step_id, /*abort=*/false); });
  ASSERT_TRUE(SlowCopy().WaitEntered());
  SlowCopy().Release();
  ender.join();
  ASSERT_TRUE(ended.ok()) << ended.status();
  EXPECT_EQ(ended->outcome, StepOutcome::kCommitted);
  auto slow = engine_->GetCache("slow");
  EXPECT_TRUE(slow->failed);
  EXPECT_THAT(slow->failure, HasSubstr("copy-on-write of layer 1 at commit: device lost"));
  EXPECT_EQ(slow->open_steps, 0);
  EXPECT_EQ(engine_->Plan(Decode("slow", {{3, 1}})).status().code(), absl::StatusCode::kInternal);
  EXPECT_TRUE(engine_->DeleteCache("slow", /*force=*/false).ok());
}

TEST_F(PlanConcurrencyTest, CreateCacheAllocatesWithoutTheLock) {
  backend_.create.Arm();
  absl::StatusOr<CacheStatus> created;
  std::thread creator([&] { created = engine_->CreateCache(SmallCache("slow2")); });
  ASSERT_TRUE(backend_.create.WaitEntered());
  CompletesWhileGated([&] {
    // The name is taken, but the cache is not there yet.
    EXPECT_EQ(engine_->CreateCache(SmallCache("slow2")).status().code(),
              absl::StatusCode::kAlreadyExists);
    EXPECT_EQ(engine_->GetCache("slow2").status().code(), absl::StatusCode::kNotFound);
    EXPECT_EQ(engine_->ListCaches().size(), 2u);
    auto plan = engine_->Plan(Decode("fast", {{1, 2}}));
    ASSERT_TRUE(plan.ok());
    RunAllLayers(*engine_, geometry_, *plan);
  }, backend_.create);
  backend_.create.Release();
  creator.join();
  ASSERT_TRUE(created.ok()) << created.status();
  EXPECT_EQ(engine_->ListCaches().size(), 3u);

  // A failed creation gives the name back.
  backend_.create.Arm(absl::ResourceExhaustedError("no memory"));
  std::thread failing([&] { created = engine_->CreateCache(SmallCache("slow3")); });
  ASSERT_TRUE(backend_.create.WaitEntered(2));
  backend_.create.Release();
  failing.join();
  EXPECT_EQ(created.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(engine_->CreateCache(SmallCache("slow3")).ok());
}

TEST_F(PlanConcurrencyTest, AdmissionCountsCachesBeingCreated) {
  // A quota of 20 pages over caches named "t/...", of 16 pages each: one fits.
  auto quota = [](const std::vector<std::pair<std::string, int64_t>>& caches) {
    int64_t held = 0;
    for (const auto& [name, pages] : caches) held += name.rfind("t/", 0) == 0 ? pages : 0;
    return held + 16 > 20 ? absl::ResourceExhaustedError("over quota") : absl::OkStatus();
  };
  backend_.create.Arm();
  absl::StatusOr<CacheStatus> first;
  std::thread creator([&] { first = engine_->CreateCache(SmallCache("t/1"), quota); });
  ASSERT_TRUE(backend_.create.WaitEntered());
  CompletesWhileGated([&] {
    // Refused before it reaches the backend: the cache being created counts.
    EXPECT_EQ(engine_->CreateCache(SmallCache("t/2"), quota).status().code(),
              absl::StatusCode::kResourceExhausted);
  }, backend_.create);
  backend_.create.Release();
  creator.join();
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(engine_->CreateCache(SmallCache("t/2"), quota).status().code(),
            absl::StatusCode::kResourceExhausted);
  ASSERT_TRUE(engine_->DeleteCache("t/1", false).ok());
  EXPECT_TRUE(engine_->CreateCache(SmallCache("t/2"), quota).ok());
}

TEST_F(PlanConcurrencyTest, DeleteDuringOpenChannelRefusesTheChannel) {
  SlowChannel().Arm();
  ChannelOpenSpec open;
  open.cache = "slow";
  open.max_tokens = 8;
  absl::StatusOr<ChannelStatus> opened;
  std::thread opener([&] { opened = engine_->OpenChannel(open, [](std::string) {}); });
  ASSERT_TRUE(SlowChannel().WaitEntered());
  CompletesWhileGated([&] {
    EXPECT_TRUE(engine_->DeleteCache("slow", /*force=*/true).ok());
  }, SlowChannel());
  SlowChannel().Release();
  opener.join();
  EXPECT_EQ(opened.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(engine_->OpenChannels(), 0);
  // Its ring's bytes are free again: a channel on another cache opens.
  open.cache = "fast";
  EXPECT_TRUE(engine_->OpenChannel(open, [](std::string) {}).ok());
}

}  // namespace
}  // namespace attnd
