// Faults in the middle of steps: clients that vanish (unary after Plan or after a layer; a
// stream cancelled between messages and with a layer running), EndStep{abort}, TTL expiry, a
// plan beyond the pool, steps racing for one sequence, cache deletion with open steps (refused,
// forced, forced with a layer running), and one tenant's faults next to another's steps.
//
// After each failed operation: the cache's used pages, sequence count and every sequence's
// length as before; no open step left (GetCache and the engine agree); the bytes of every
// committed token's slot, in every layer's K and V pool, identical to before (read with
// Engine::ReadPages); at most the failed step's own new-token slots written (they lie past the
// restored lengths, unreachable, and the next append overwrites them); a failure before any
// layer ran leaves every pool byte as it was. Then a fresh step over every sequence matches
// the host reference, which never saw the failed operation: the daemon still serves.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <future>
#include <latch>
#include <map>
#include <random>
#include <span>
#include <thread>

#include <unistd.h>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "attnd/client/channel.h"
#include "attnd/client/reference_cache.h"
#include "channel_steps.h"
#include "fault_server.h"
#include "status_matchers.h"
#include "test_steps.h"

namespace attnd::integration {
namespace {

using Code = absl::StatusCode;
using ::testing::AnyOf;
using ::testing::HasSubstr;

constexpr char kCache[] = "c";
// Sequences of the starting state; 7 and 4 tokens, so their last 4-token pages are partly
// filled and a failed step writes into pages that also hold committed tokens.
constexpr uint64_t kSeqA = 1;
constexpr uint64_t kSeqB = 2;
// A sequence that only failed steps touch.
constexpr uint64_t kSeqNew = 9;

int64_t PagesFor(int64_t tokens) { return (tokens + 3) / 4; }

// Wide enough that the attention of one layer of a kLongPrefill-token prefill takes a good
// fraction of a second on the CPU backend (about 0.15 s optimised, 1 s in the unoptimised ASan
// build): a cancel or a delete sent once its append has written lands mid-layer.
#ifdef __OPTIMIZE__
constexpr int32_t kLongPrefill = 2048;
#else
constexpr int32_t kLongPrefill = 512;
#endif
attnd::v1::CacheConfig WideConfig() {
  attnd::v1::CacheConfig config = SmallConfig(1024);
  config.set_num_qo_heads(16);
  config.set_num_kv_heads(8);
  return config;
}

class FaultTest : public ::testing::Test {
 protected:
  virtual FaultServerOptions Options() const { return FaultServerOptions(); }

  void SetUp() override {
    ASSERT_OK_AND_ASSIGN(server_, FaultServer::Start(Options()));
    client_ = server_->NewClient();
    ASSERT_NE(client_, nullptr);
    ASSERT_OK(client_->WaitForConnected(absl::Seconds(10)));
  }

  void TearDown() override {
    client_.reset();
    server_.reset();
  }

  FaultServer& server() { return *server_; }
  client::Client& client() { return *client_; }

  // Creates the cache and commits two steps (lengths 7 and 4) through `on`, mirrored in the
  // reference.
  void CreateStartingState(int64_t num_pages = 256, client::Client* on = nullptr,
                           const std::string& name = kCache) {
    ASSERT_NO_FATAL_FAILURE(CreateStartingStateWith(SmallConfig(num_pages), on, name));
  }
  void CreateStartingStateWith(const attnd::v1::CacheConfig& config, client::Client* on = nullptr,
                               const std::string& name = kCache) {
    client::Client& c = on != nullptr ? *on : client();
    ASSERT_OK_AND_ASSIGN(cache_, c.CreateCache(name, config));
    ASSERT_OK_AND_ASSIGN(reference_, client::ReferenceCache::Create(cache_.config()));
    ASSERT_NO_FATAL_FAILURE(RunStepAndCheck(c, *reference_, cache_, {{kSeqA, 6}, {kSeqB, 3}}, rng_));
    ASSERT_NO_FATAL_FAILURE(RunStepAndCheck(c, *reference_, cache_, {{kSeqA, 1}, {kSeqB, 1}}, rng_));
  }

  struct Baseline {
    attnd::v1::CacheInfo info;
    std::map<uint64_t, int64_t> lengths;
    PoolBytes pools;
    std::set<Slot> committed;
  };

  // The state a failed operation must leave behind. `key`: the engine's name of the cache
  // (tenants prefix it).
  Baseline Capture(const std::string& key = kCache, client::Client* on = nullptr,
                   const std::string& name = kCache) {
    Baseline baseline;
    auto info = (on != nullptr ? *on : client()).GetCache(name);
    EXPECT_TRUE(info.ok()) << info.status();
    if (info.ok()) baseline.info = *info;
    for (const uint64_t id : {kSeqA, kSeqB, kSeqNew}) {
      auto length = server().engine().SequenceLength(key, id);
      EXPECT_TRUE(length.ok()) << length.status();
      baseline.lengths[id] = length.ok() ? *length : -1;
    }
    auto pools = ReadPools(server().engine(), key);
    EXPECT_TRUE(pools.ok()) << pools.status();
    if (pools.ok()) baseline.pools = *std::move(pools);
    // Valid because the cache has only ever committed steps when a test captures it.
    baseline.committed = NonZeroSlots(baseline.pools);
    EXPECT_EQ(baseline.info.open_steps(), 0);
    return baseline;
  }

  // Waits until the cache has no open step (aborts triggered by a disconnect land
  // asynchronously); returns the cache then.
  attnd::v1::CacheInfo AwaitNoOpenSteps(absl::Duration timeout, client::Client* on = nullptr,
                                        const std::string& name = kCache) {
    attnd::v1::CacheInfo info;
    const absl::Time deadline = absl::Now() + timeout;
    do {
      auto got = (on != nullptr ? *on : client()).GetCache(name);
      EXPECT_TRUE(got.ok()) << got.status();
      if (!got.ok()) break;
      info = *std::move(got);
      if (info.open_steps() == 0) break;
      absl::SleepFor(absl::Milliseconds(10));
    } while (absl::Now() < deadline);
    return info;
  }

  // Everything as in `before` (see the file comment); `max_written_slots`: slots of one pool
  // the failed step may have written (its new tokens; 0 when no layer ran).
  void ExpectRestored(const Baseline& before, int64_t max_written_slots,
                      const std::string& key = kCache, client::Client* on = nullptr,
                      const std::string& name = kCache) {
    const attnd::v1::CacheInfo info = AwaitNoOpenSteps(absl::Seconds(60), on, name);
    EXPECT_EQ(info.open_steps(), 0) << "a step of the failed operation is still open";
    EXPECT_EQ(server().engine().OpenSteps(), 0);
    EXPECT_EQ(info.used_pages(), before.info.used_pages()) << "pages leaked or lost";
    EXPECT_EQ(info.num_sequences(), before.info.num_sequences());
    for (const auto& [id, length] : before.lengths) {
      auto now = server().engine().SequenceLength(key, id);
      ASSERT_TRUE(now.ok()) << now.status();
      EXPECT_EQ(*now, length) << "length of sequence " << id;
    }
    ASSERT_OK_AND_ASSIGN(const PoolBytes after, ReadPools(server().engine(), key));
    const std::set<Slot> changed = ChangedSlots(before.pools, after);
    std::map<size_t, int64_t> written_per_pool;
    int64_t committed_changed = 0;
    for (const Slot& slot : changed) {
      if (before.committed.contains(slot)) {
        ++committed_changed;
      } else {
        ++written_per_pool[std::get<0>(slot)];
      }
    }
    EXPECT_EQ(committed_changed, 0) << "bytes of committed tokens changed";
    for (const auto& [pool, written] : written_per_pool) {
      EXPECT_LE(written, max_written_slots)
          << "pool " << pool << ": more slots written than the failed step had new tokens";
    }
    if (max_written_slots == 0) {
      EXPECT_TRUE(changed.empty()) << "no layer ran, yet " << changed.size() << " slots changed";
    }
  }

  // A decode step over both sequences (and the new one's absence): must match the reference.
  void ExpectStillServing(client::Client* on = nullptr) {
    client::Client& c = on != nullptr ? *on : client();
    ASSERT_NO_FATAL_FAILURE(RunStepAndCheck(c, *reference_, cache_, {{kSeqA, 1}, {kSeqB, 1}}, rng_));
    ASSERT_NO_FATAL_FAILURE(RunStepAndCheck(c, *reference_, cache_, {{kSeqNew, 3}, {kSeqA, 1}}, rng_));
  }

  // Waits until layer 0's K pool differs from `before`: the append of a running layer has
  // written, and its attention (the bulk of the layer) is under way. False on timeout.
  bool AwaitLayerRunning(const PoolBytes& before, const std::string& key = kCache) {
    std::string pool(before.pools.at(0).size(), '\0');
    const absl::Time deadline = absl::Now() + absl::Seconds(30);
    while (absl::Now() < deadline) {
      const absl::Status read = server().engine().ReadPages(
          key, 0, /*v_pool=*/false, 0,
          std::span<uint8_t>(reinterpret_cast<uint8_t*>(pool.data()), pool.size()));
      if (!read.ok()) return false;
      if (pool != before.pools[0]) return true;
      absl::SleepFor(absl::Microseconds(200));
    }
    return false;
  }

  // A layer of `rows` rows with random contents.
  attnd::v1::ForwardRequest Layer(int64_t rows, int32_t layer) {
    return RandomLayer(rng_, cache_.config(), rows, layer);
  }

  std::mt19937_64 rng_{77};
  attnd::v1::CacheInfo cache_;
  std::unique_ptr<client::ReferenceCache> reference_;

 private:
  std::unique_ptr<FaultServer> server_;
  std::unique_ptr<client::Client> client_;
};

// A short TTL, for clients that vanish without a word and for expiry.
class TtlFaultTest : public FaultTest {
 protected:
  static constexpr absl::Duration kTtl = absl::Milliseconds(400);
  FaultServerOptions Options() const override {
    FaultServerOptions options;
    options.step_ttl = kTtl;
    return options;
  }
};

TEST_F(TtlFaultTest, UnaryClientGoneAfterPlanIsRolledBackAtTheTtl) {
  ASSERT_NO_FATAL_FAILURE(CreateStartingState());
  const Baseline before = Capture();
  uint64_t step_id = 0;
  {
    auto gone = server().NewClient();
    ASSERT_NE(gone, nullptr);
    ASSERT_OK_AND_ASSIGN(auto plan, gone->Plan(MakePlan(kCache, {{kSeqA, 2}, {kSeqB, 1}, {kSeqNew, 5}})));
    step_id = plan.step_id();
    ASSERT_OK_AND_ASSIGN(auto during, client().GetCache(kCache));
    // 7 -> 9 tokens: +1 page; 4 -> 5: +1; 0 -> 5: +2.
    EXPECT_EQ(during.used_pages(), before.info.used_pages() + 4);
    EXPECT_EQ(during.open_steps(), 1);
  }  // the client goes away: no EndStep, no Forward
  ASSERT_OK_AND_ASSIGN(auto right_after, client().GetCache(kCache));
  EXPECT_EQ(right_after.open_steps(), 1) << "a disconnect alone must not end a unary step";
  ASSERT_NO_FATAL_FAILURE(ExpectRestored(before, 0));
  ASSERT_OK_AND_ASSIGN(auto ended, client().EndStep(step_id, false));
  EXPECT_EQ(ended.outcome(), attnd::v1::STEP_OUTCOME_ABORTED);
  attnd::v1::ForwardRequest late = Layer(8, 0);
  late.set_step_id(step_id);
  EXPECT_ERROR(client().Forward(late), Code::kFailedPrecondition, "aborted");
  ASSERT_NO_FATAL_FAILURE(ExpectStillServing());
}

TEST_F(TtlFaultTest, UnaryClientGoneAfterALayerIsRolledBackAtTheTtl) {
  ASSERT_NO_FATAL_FAILURE(CreateStartingState());
  const Baseline before = Capture();
  {
    auto gone = server().NewClient();
    ASSERT_NE(gone, nullptr);
    ASSERT_OK_AND_ASSIGN(auto plan, gone->Plan(MakePlan(kCache, {{kSeqA, 2}, {kSeqNew, 6}})));
    attnd::v1::ForwardRequest layer = Layer(8, 1);
    layer.set_step_id(plan.step_id());
    ASSERT_OK(gone->Forward(layer));
  }
  ASSERT_NO_FATAL_FAILURE(ExpectRestored(before, 8));
  ASSERT_NO_FATAL_FAILURE(ExpectStillServing());
}

TEST_F(TtlFaultTest, StepExpiringBetweenLayersRollsBackAndRefusesTheRest) {
  ASSERT_NO_FATAL_FAILURE(CreateStartingState());
  const Baseline before = Capture();
  ASSERT_OK_AND_ASSIGN(auto plan, client().Plan(MakePlan(kCache, {{kSeqB, 3}, {kSeqNew, 1}})));
  attnd::v1::ForwardRequest layer = Layer(4, 0);
  layer.set_step_id(plan.step_id());
  ASSERT_OK(client().Forward(layer));
  absl::SleepFor(kTtl * 3);
  ASSERT_NO_FATAL_FAILURE(ExpectRestored(before, 4));
  layer = Layer(4, 1);
  layer.set_step_id(plan.step_id());
  EXPECT_ERROR(client().Forward(layer), Code::kFailedPrecondition, "aborted");
  ASSERT_OK_AND_ASSIGN(auto ended, client().EndStep(plan.step_id(), false));
  EXPECT_EQ(ended.outcome(), attnd::v1::STEP_OUTCOME_ABORTED);
  EXPECT_EQ(ended.layers_run(), 1);
  ASSERT_NO_FATAL_FAILURE(ExpectStillServing());
}

TEST_F(FaultTest, StreamCancelledMidStepRollsBack) {
  ASSERT_NO_FATAL_FAILURE(CreateStartingState());
  const Baseline before = Capture();
  {
    ASSERT_OK_AND_ASSIGN(auto session, client().OpenStream());
    ASSERT_OK(session->Plan(MakePlan(kCache, {{kSeqA, 1}, {kSeqNew, 4}})));
    session->Cancel();
  }
  // The TTL is a minute: only the stream's end can have aborted the step this soon.
  ASSERT_NO_FATAL_FAILURE(ExpectRestored(before, 0));
  ASSERT_NO_FATAL_FAILURE(ExpectStillServing());
}

TEST_F(FaultTest, StreamCancelledMidForwardRollsBackOnceTheLayerLands) {
  ASSERT_NO_FATAL_FAILURE(CreateStartingStateWith(WideConfig()));
  const Baseline before = Capture();
  {
    ASSERT_OK_AND_ASSIGN(auto session, client().OpenStream());
    ASSERT_OK_AND_ASSIGN(auto step,
                         session->BeginStep(MakePlan(kCache, {{kSeqNew, kLongPrefill}, {kSeqA, 1}})));
    const attnd::v1::ForwardRequest layer = Layer(kLongPrefill + 1, 0);
    const absl::Time sent = absl::Now();
    std::future<client::ForwardResult> running = step->ForwardAsync(layer);
    // Vanish once the layer runs.
    ASSERT_TRUE(AwaitLayerRunning(before.pools)) << "the layer never started";
    session->Cancel();
    const client::ForwardResult result = running.get();
    EXPECT_EQ(result.status().code(), Code::kCancelled)
        << "the layer answered within " << absl::FormatDuration(absl::Now() - sent)
        << ", before the cancel: " << result.status();
  }
  ASSERT_NO_FATAL_FAILURE(ExpectRestored(before, kLongPrefill + 1));
  ASSERT_NO_FATAL_FAILURE(ExpectStillServing());
}

TEST_F(FaultTest, EndStepAbortRestoresEverything) {
  ASSERT_NO_FATAL_FAILURE(CreateStartingState());
  const Baseline before = Capture();
  // Unary, layers out of order, with padding slots.
  {
    ASSERT_OK_AND_ASSIGN(auto step, client().BeginStep(
                                        MakePlan(kCache, {{kSeqA, 2}, {0, 0}, {kSeqNew, 5}, {kSeqB, 1}})));
    ASSERT_OK(step->Forward(Layer(8, 1)));
    ASSERT_OK_AND_ASSIGN(auto ended, step->Abort());
    EXPECT_EQ(ended.outcome(), attnd::v1::STEP_OUTCOME_ABORTED);
    EXPECT_EQ(ended.layers_run(), 1);
  }
  ASSERT_NO_FATAL_FAILURE(ExpectRestored(before, 8));
  // The same over a stream, after the pages were handed back once.
  {
    ASSERT_OK_AND_ASSIGN(auto session, client().OpenStream());
    ASSERT_OK_AND_ASSIGN(auto step, session->BeginStep(MakePlan(kCache, {{kSeqNew, 7}, {kSeqB, 2}})));
    ASSERT_OK(step->Forward(Layer(9, 0)));
    ASSERT_OK_AND_ASSIGN(auto ended, step->Abort());
    EXPECT_EQ(ended.outcome(), attnd::v1::STEP_OUTCOME_ABORTED);
    EXPECT_OK(session->Close());
  }
  // Slots of both aborted steps may hold their bytes now; none is a committed one.
  ASSERT_NO_FATAL_FAILURE(ExpectRestored(before, 8 + 9));
  ASSERT_NO_FATAL_FAILURE(ExpectStillServing());
}

TEST_F(FaultTest, PlanBeyondCapacityChangesNothing) {
  // 16 pages; the starting state holds 3 (7 tokens: 2 pages, 4 tokens: 1).
  ASSERT_NO_FATAL_FAILURE(CreateStartingState(16));
  const Baseline before = Capture();
  ASSERT_EQ(before.info.used_pages(), 3);
  // A's 8th token fits its last page; B needs a page; the new sequence 13 more: 14 > 13 free.
  EXPECT_ERROR(client().Plan(MakePlan(kCache, {{kSeqA, 1}, {kSeqB, 1}, {kSeqNew, 49}})),
               Code::kResourceExhausted, "pages");
  ASSERT_NO_FATAL_FAILURE(ExpectRestored(before, 0));
  // Over a stream: a per-message error, and the stream lives on.
  ASSERT_OK_AND_ASSIGN(auto session, client().OpenStream());
  EXPECT_ERROR(session->Plan(MakePlan(kCache, {{kSeqNew, 13 * 4 + 1}})), Code::kResourceExhausted,
               "pages");
  ASSERT_NO_FATAL_FAILURE(ExpectRestored(before, 0));
  // Exactly the free pages: fits (the refusal above was not off by one).
  ASSERT_OK_AND_ASSIGN(auto fits, session->Plan(MakePlan(kCache, {{kSeqA, 1}, {kSeqB, 1}, {kSeqNew, 48}})));
  ASSERT_OK_AND_ASSIGN(auto full, client().GetCache(kCache));
  EXPECT_EQ(full.used_pages(), 16);
  ASSERT_OK_AND_ASSIGN(auto ended, session->EndStep(fits.step_id(), /*abort=*/true));
  EXPECT_EQ(ended.outcome(), attnd::v1::STEP_OUTCOME_ABORTED);
  EXPECT_OK(session->Close());
  ASSERT_NO_FATAL_FAILURE(ExpectRestored(before, 0));
  ASSERT_NO_FATAL_FAILURE(ExpectStillServing());
}

TEST_F(FaultTest, StepsRacingForOneSequenceAdmitExactlyOne) {
  ASSERT_NO_FATAL_FAILURE(CreateStartingState());
  constexpr int kRacers = 8;
  constexpr int kRounds = 12;
  // Half the racers plan over unary calls, half over their own stream; each plan also takes a
  // token for the racer's own sequence, which must stay untouched when the plan loses.
  std::vector<std::unique_ptr<client::Client>> clients;
  std::vector<std::unique_ptr<client::StreamSession>> sessions(kRacers);
  for (int r = 0; r < kRacers; ++r) {
    clients.push_back(server().NewClient());
    ASSERT_NE(clients.back(), nullptr);
    if (r % 2 == 1) {
      ASSERT_OK_AND_ASSIGN(sessions[r], clients.back()->OpenStream());
    }
  }
  auto own_sequence = [](int racer) { return uint64_t{100} + racer; };
  std::vector<int> wins(kRacers, 0);
  for (int round = 0; round < kRounds; ++round) {
    std::vector<attnd::v1::PlanRequest> plans;
    for (int r = 0; r < kRacers; ++r) {
      plans.push_back(MakePlan(kCache, {{own_sequence(r), 1}, {kSeqA, 1}}));
    }
    std::vector<absl::StatusOr<std::unique_ptr<client::Step>>> results(kRacers);
    std::latch start(1);
    std::vector<std::thread> racers;
    for (int r = 0; r < kRacers; ++r) {
      racers.emplace_back([&, r] {
        start.wait();
        results[r] = sessions[r] != nullptr ? sessions[r]->BeginStep(plans[r])
                                            : clients[r]->BeginStep(plans[r]);
      });
    }
    start.count_down();
    for (std::thread& racer : racers) racer.join();
    int winner = -1;
    for (int r = 0; r < kRacers; ++r) {
      if (results[r].ok()) {
        EXPECT_EQ(winner, -1) << "round " << round << ": racers " << winner << " and " << r
                              << " both hold sequence " << kSeqA;
        winner = r;
      } else {
        EXPECT_ERROR(results[r], Code::kFailedPrecondition, "sequence_id");
      }
    }
    ASSERT_NE(winner, -1) << "round " << round << ": nobody got the sequence";
    ++wins[winner];
    // The losers changed nothing: only the winner's pages are taken.
    ASSERT_OK(reference_->BeginStep(plans[winner]));
    ASSERT_NO_FATAL_FAILURE(RunLayersAndCheck(**results[winner], *reference_, cache_.config(), rng_));
    ASSERT_FALSE((*results[winner])->open());
  }
  int64_t pages = PagesFor(reference_->SequenceLength(kSeqA)) + PagesFor(reference_->SequenceLength(kSeqB));
  for (int r = 0; r < kRacers; ++r) {
    ASSERT_OK_AND_ASSIGN(const int64_t length, server().engine().SequenceLength(kCache, own_sequence(r)));
    EXPECT_EQ(length, wins[r]) << "racer " << r << "'s own sequence";
    pages += PagesFor(wins[r]);
  }
  ASSERT_OK_AND_ASSIGN(const int64_t length_a, server().engine().SequenceLength(kCache, kSeqA));
  EXPECT_EQ(length_a, 7 + kRounds);
  ASSERT_OK_AND_ASSIGN(auto info, client().GetCache(kCache));
  EXPECT_EQ(info.used_pages(), pages);
  EXPECT_EQ(info.open_steps(), 0);
  for (auto& session : sessions) {
    if (session != nullptr) EXPECT_OK(session->Close());
  }
  ASSERT_NO_FATAL_FAILURE(ExpectStillServing());
}

TEST_F(FaultTest, DeletingACacheWithAnOpenStepIsRefusedWithoutForce) {
  ASSERT_NO_FATAL_FAILURE(CreateStartingState());
  const attnd::v1::PlanRequest plan = MakePlan(kCache, {{kSeqA, 2}, {kSeqNew, 3}});
  ASSERT_OK_AND_ASSIGN(auto step, client().BeginStep(plan));
  ASSERT_OK(reference_->BeginStep(plan));
  const attnd::v1::ForwardRequest layer0 = Layer(5, 0);
  ASSERT_OK_AND_ASSIGN(auto out0, step->Forward(layer0));
  ASSERT_OK_AND_ASSIGN(auto expected0, reference_->Forward(layer0));
  ExpectMatchesReference(out0, expected0, reference_->q_dtype(), "layer 0");
  ASSERT_OK_AND_ASSIGN(const PoolBytes mid_step, ReadPools(server().engine(), kCache));
  ASSERT_OK_AND_ASSIGN(auto info_mid, client().GetCache(kCache));

  EXPECT_ERROR(client().DeleteCache(kCache, /*force=*/false), Code::kFailedPrecondition, "force");
  ASSERT_OK_AND_ASSIGN(auto info, client().GetCache(kCache));
  EXPECT_EQ(info.open_steps(), 1);
  EXPECT_EQ(info.used_pages(), info_mid.used_pages());
  ASSERT_OK_AND_ASSIGN(const PoolBytes after, ReadPools(server().engine(), kCache));
  EXPECT_TRUE(ChangedSlots(mid_step, after).empty()) << "a refused delete changed pool bytes";
  // The step carries on and commits as if nothing had happened.
  const attnd::v1::ForwardRequest layer1 = Layer(5, 1);
  ASSERT_OK_AND_ASSIGN(auto out1, step->Forward(layer1));
  ASSERT_OK_AND_ASSIGN(auto expected1, reference_->Forward(layer1));
  ExpectMatchesReference(out1, expected1, reference_->q_dtype(), "layer 1");
  EXPECT_TRUE(out1.step_committed());
  reference_->EndStep(false);
  ASSERT_NO_FATAL_FAILURE(ExpectStillServing());
}

TEST_F(FaultTest, ForcedDeleteWithALayerRunningFreesThePoolOnceItLands) {
  ASSERT_NO_FATAL_FAILURE(CreateStartingStateWith(WideConfig()));
  ASSERT_OK_AND_ASSIGN(auto info, client().GetServerInfo());
  const int64_t budget = info.kv_budget_bytes();
  EXPECT_LT(info.kv_free_bytes(), budget);
  ASSERT_OK_AND_ASSIGN(auto plan,
                       client().Plan(MakePlan(kCache, {{kSeqNew, kLongPrefill}, {kSeqA, 1}})));
  // A second open step on a stream, to be aborted too.
  ASSERT_OK_AND_ASSIGN(auto session, client().OpenStream());
  ASSERT_OK_AND_ASSIGN(auto stream_plan, session->Plan(MakePlan(kCache, {{kSeqB, 1}})));
  attnd::v1::ForwardRequest layer = Layer(kLongPrefill + 1, 0);
  layer.set_step_id(plan.step_id());
  ASSERT_OK_AND_ASSIGN(const PoolBytes before, ReadPools(server().engine(), kCache));
  auto running = std::async(std::launch::async, [&] { return client().Forward(layer); });
  ASSERT_TRUE(AwaitLayerRunning(before)) << "the layer never started";
  ASSERT_OK(client().DeleteCache(kCache, /*force=*/true));
  ASSERT_OK_AND_ASSIGN(info, client().GetServerInfo());
  const bool pools_held_after_delete = info.kv_free_bytes() < budget;
  const client::ForwardResult result = running.get();
  // The layer that was running finishes normally; the step is aborted under it.
  EXPECT_EQ(result.status().code(), Code::kOk) << result.status();
  EXPECT_TRUE(pools_held_after_delete)
      << "the pools went before the running layer finished (or the layer was not running)";

  EXPECT_ERROR(client().GetCache(kCache), Code::kNotFound, "name");
  EXPECT_EQ(server().engine().OpenSteps(), 0);
  for (const uint64_t step_id : {plan.step_id(), stream_plan.step_id()}) {
    ASSERT_OK_AND_ASSIGN(auto ended, client().EndStep(step_id, false));
    EXPECT_EQ(ended.outcome(), attnd::v1::STEP_OUTCOME_ABORTED) << "step " << step_id;
  }
  attnd::v1::ForwardRequest late = Layer(1, 0);
  late.set_step_id(stream_plan.step_id());
  EXPECT_ERROR(session->Forward(late), Code::kFailedPrecondition, "aborted");
  // The pools go back to the budget once the running layer has let go of them.
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  int64_t free_bytes = 0;
  do {
    ASSERT_OK_AND_ASSIGN(info, client().GetServerInfo());
    free_bytes = info.kv_free_bytes();
    if (free_bytes == budget) break;
    absl::SleepFor(absl::Milliseconds(10));
  } while (absl::Now() < deadline);
  EXPECT_EQ(free_bytes, budget) << "the deleted cache's pools were not returned";
  // The step finalised after the delete: it must not bring the deleted cache's page gauges
  // back (nor, once the name is reused, overwrite the new cache's).
  EXPECT_EQ(server().PageGauges(kCache), std::make_pair(-1.0, -1.0))
      << "attnd_kv_pages{cache=\"c\"} exists after its cache was deleted";
  EXPECT_OK(session->Close());
  // Still serving: the name is free again, and a new cache works from scratch.
  ASSERT_NO_FATAL_FAILURE(CreateStartingState());
  ASSERT_NO_FATAL_FAILURE(ExpectStillServing());
  ASSERT_OK_AND_ASSIGN(auto recreated, client().GetCache(kCache));
  EXPECT_EQ(server().PageGauges(kCache),
            std::make_pair(static_cast<double>(recreated.used_pages()),
                           static_cast<double>(recreated.num_pages() - recreated.used_pages())));
}

// Tenants (bearer tokens): one tenant's aborts, disconnects, deletes and guesses at step ids
// leave another tenant's open step and bytes alone.
class TenantFaultTest : public FaultTest {
 protected:
  static constexpr char kAlphaToken[] = "alpha-fault-token-0123456789";
  static constexpr char kBetaToken[] = "beta-fault-token-0123456789";

  FaultServerOptions Options() const override {
    FaultServerOptions options;
    options.token_file = token_file_;
    return options;
  }

  void SetUp() override {
    token_file_ = absl::StrCat(::testing::TempDir(), "/fault-tokens-", getpid(), ".txt");
    FILE* file = std::fopen(token_file_.c_str(), "w");
    ASSERT_NE(file, nullptr);
    std::fprintf(file, "alpha %s\nbeta %s\n", kAlphaToken, kBetaToken);
    std::fclose(file);
    FaultTest::SetUp();
  }

  std::string token_file_;
};

TEST_F(TenantFaultTest, AnotherTenantsFaultsLeaveMyStepAndBytesAlone) {
  auto alpha = server().NewClient(kAlphaToken);
  auto beta = server().NewClient(kBetaToken);
  ASSERT_NE(alpha, nullptr);
  ASSERT_NE(beta, nullptr);
  // Beta has a cache of the same name with its own state.
  ASSERT_OK(beta->CreateCache(kCache, SmallConfig(64)));
  std::mt19937_64 beta_rng(5);
  ASSERT_OK_AND_ASSIGN(auto beta_reference, client::ReferenceCache::Create(SmallConfig(64)));
  ASSERT_OK_AND_ASSIGN(auto beta_cache, beta->GetCache(kCache));
  ASSERT_NO_FATAL_FAILURE(RunStepAndCheck(*beta, *beta_reference, beta_cache, {{kSeqA, 5}}, beta_rng));
  ASSERT_NO_FATAL_FAILURE(CreateStartingState(256, alpha.get()));

  // Alpha's step is open with one layer run; that is the state beta's faults must not touch.
  const std::string alpha_key = absl::StrCat("alpha/", kCache);
  const attnd::v1::PlanRequest plan = MakePlan(kCache, {{kSeqA, 2}, {kSeqNew, 2}});
  ASSERT_OK_AND_ASSIGN(auto step, alpha->BeginStep(plan));
  ASSERT_OK(reference_->BeginStep(plan));
  const attnd::v1::ForwardRequest layer0 = Layer(4, 0);
  ASSERT_OK_AND_ASSIGN(auto out0, step->Forward(layer0));
  ASSERT_OK_AND_ASSIGN(auto expected0, reference_->Forward(layer0));
  ExpectMatchesReference(out0, expected0, reference_->q_dtype(), "alpha layer 0");
  ASSERT_OK_AND_ASSIGN(const PoolBytes alpha_mid, ReadPools(server().engine(), alpha_key));
  ASSERT_OK_AND_ASSIGN(auto alpha_info_mid, alpha->GetCache(kCache));

  // Beta guesses alpha's step id: not found, for abort, commit and forward alike.
  EXPECT_ERROR(beta->EndStep(step->id(), /*abort=*/true), Code::kNotFound, "step_id");
  EXPECT_ERROR(beta->EndStep(step->id(), /*abort=*/false), Code::kNotFound, "step_id");
  attnd::v1::ForwardRequest stolen = Layer(4, 1);
  stolen.set_step_id(step->id());
  EXPECT_ERROR(beta->Forward(stolen), Code::kNotFound, "step_id");
  // Beta's own stream is cancelled mid-step, then beta force-deletes its cache "c".
  {
    ASSERT_OK_AND_ASSIGN(auto session, beta->OpenStream());
    ASSERT_OK_AND_ASSIGN(auto beta_step, session->BeginStep(MakePlan(kCache, {{kSeqA, 3}})));
    ASSERT_OK(beta_step->Forward(RandomLayer(beta_rng, SmallConfig(64), 3, 0)));
    session->Cancel();
  }
  ASSERT_NO_FATAL_FAILURE(AwaitNoOpenSteps(absl::Seconds(10), beta.get()));
  ASSERT_OK(beta->DeleteCache(kCache, /*force=*/true));
  EXPECT_ERROR(beta->GetCache(kCache), Code::kNotFound, "name");

  ASSERT_OK_AND_ASSIGN(auto alpha_info, alpha->GetCache(kCache));
  EXPECT_EQ(alpha_info.open_steps(), 1);
  EXPECT_EQ(alpha_info.used_pages(), alpha_info_mid.used_pages());
  ASSERT_OK_AND_ASSIGN(const PoolBytes alpha_after, ReadPools(server().engine(), alpha_key));
  EXPECT_TRUE(ChangedSlots(alpha_mid, alpha_after).empty())
      << "another tenant's faults changed this tenant's pool bytes";
  // Alpha's step finishes as if nothing happened.
  const attnd::v1::ForwardRequest layer1 = Layer(4, 1);
  ASSERT_OK_AND_ASSIGN(auto out1, step->Forward(layer1));
  ASSERT_OK_AND_ASSIGN(auto expected1, reference_->Forward(layer1));
  ExpectMatchesReference(out1, expected1, reference_->q_dtype(), "alpha layer 1");
  EXPECT_TRUE(out1.step_committed());
  reference_->EndStep(false);
  ASSERT_NO_FATAL_FAILURE(ExpectStillServing(alpha.get()));
}


// ---- Channels (DESIGN 3b): a step whose layers run through a HOST_SHM channel, faulted ----

namespace {

absl::Status CloseChannel(client::Client& client, uint64_t channel_id) {
  auto context = client.NewContext();
  attnd::v1::CloseChannelRequest request;
  request.set_channel_id(channel_id);
  attnd::v1::CloseChannelResponse response;
  const grpc::Status status = client.stub().CloseChannel(context.get(), request, &response);
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
}

client::ChannelOptions SmallChannel() {
  client::ChannelOptions options;
  options.max_tokens = 8;
  options.with_lse = true;
  return options;
}

}  // namespace

class ChannelTtlFaultTest : public FaultTest {
 protected:
  // Short enough to wait for, long enough that the second step's layers (run back to back
  // from here) never come near it, also under ASan on a loaded machine.
  FaultServerOptions Options() const override {
    FaultServerOptions options;
    options.step_ttl = absl::Seconds(1);
    return options;
  }
};

TEST_F(ChannelTtlFaultTest, ChannelStepWhoseReadyFlagsNeverComeAbortsAtTheTtl) {
  ASSERT_NO_FATAL_FAILURE(CreateStartingState());
  const Baseline before = Capture();
  ASSERT_OK_AND_ASSIGN(auto channel, client::Channel::Open(client(), kCache, SmallChannel()));
  attnd::v1::PlanRequest plan = MakePlan(kCache, {{kSeqA, 1}, {kSeqNew, 3}});
  plan.set_channel_id(channel->id());
  ASSERT_OK_AND_ASSIGN(const attnd::v1::PlanResponse planned, client().Plan(plan));
  // No ready word is ever set: attnd lets go of its waits at the TTL and rolls the step back
  // with no byte written, and sets the done words so that no waiter hangs.
  ASSERT_NO_FATAL_FAILURE(ExpectRestored(before, /*max_written_slots=*/0));
  EXPECT_ERROR(channel->WaitDone(0, planned.channel_sequence(), absl::Seconds(10)),
               Code::kAborted, "aborted");
  EXPECT_TRUE(channel->Aborted(planned.channel_sequence()));
  ASSERT_OK_AND_ASSIGN(auto ended, client().EndStep(planned.step_id(), /*abort=*/false));
  EXPECT_EQ(ended.outcome(), attnd::v1::STEP_OUTCOME_ABORTED);
  EXPECT_EQ(ended.layers_run(), 0);

  // The channel itself stays open and carries the next step.
  attnd::v1::PlanRequest next = MakePlan(kCache, {{kSeqA, 1}});
  next.set_channel_id(channel->id());
  ASSERT_OK_AND_ASSIGN(const attnd::v1::PlanResponse second, client().Plan(next));
  EXPECT_EQ(second.channel_sequence(), planned.channel_sequence() + 1);
  for (int32_t layer = 0; layer < cache_.config().num_layers(); ++layer) {
    ASSERT_OK(ForwardThroughChannel(*channel, second.channel_sequence(),
                                    RandomLayer(rng_, cache_.config(), 1, layer), cache_.config(),
                                    1, true)
                  .status());
  }
  ASSERT_OK_AND_ASSIGN(auto committed, client().EndStep(second.step_id(), /*abort=*/false));
  EXPECT_EQ(committed.outcome(), attnd::v1::STEP_OUTCOME_COMMITTED);
}

TEST_F(FaultTest, ClosingAChannelMidStepAbortsItsStep) {
  ASSERT_NO_FATAL_FAILURE(CreateStartingState());
  const Baseline before = Capture();
  ASSERT_OK_AND_ASSIGN(auto channel, client::Channel::Open(client(), kCache, SmallChannel()));
  attnd::v1::PlanRequest plan = MakePlan(kCache, {{kSeqA, 2}, {kSeqNew, 2}});
  plan.set_channel_id(channel->id());
  ASSERT_OK_AND_ASSIGN(const attnd::v1::PlanResponse planned, client().Plan(plan));
  ASSERT_OK(ForwardThroughChannel(*channel, planned.channel_sequence(),
                                  RandomLayer(rng_, cache_.config(), 4, 0), cache_.config(), 4,
                                  true)
                .status());
  ASSERT_OK(CloseChannel(client(), channel->id()));
  ASSERT_NO_FATAL_FAILURE(ExpectRestored(before, /*max_written_slots=*/4));
  ASSERT_OK_AND_ASSIGN(auto ended, client().EndStep(planned.step_id(), /*abort=*/true));
  EXPECT_EQ(ended.outcome(), attnd::v1::STEP_OUTCOME_ABORTED);
  EXPECT_EQ(ended.layers_run(), 1);
  ASSERT_OK_AND_ASSIGN(auto info, client().GetCache(kCache));
  EXPECT_EQ(info.channels_size(), 0);
  // The OpenChannel call ended with the reason; a second close finds nothing.
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (channel->closed_reason().empty() && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  EXPECT_THAT(channel->closed_reason(), HasSubstr("CloseChannel"));
  EXPECT_ERROR(CloseChannel(client(), channel->id()), Code::kNotFound, "channel_id");
  ASSERT_NO_FATAL_FAILURE(ExpectStillServing());
}

TEST_F(FaultTest, ChannelClientKilledMidStepLosesItsChannelAndStep) {
  ASSERT_NO_FATAL_FAILURE(CreateStartingState());
  const Baseline before = Capture();
  // The client runs in another process; it maps the ring, plans a 3-token step of sequence 7,
  // runs layer 0 through the channel and is then killed.
  const std::string command =
      absl::StrCat(CHANNEL_TEST_CLIENT, " hang ", server().address(), " ", kCache);
  FILE* child = popen(absl::StrCat("exec ", command).c_str(), "r");
  ASSERT_NE(child, nullptr);
  char line[256] = {};
  ASSERT_NE(std::fgets(line, sizeof(line), child), nullptr) << "the client printed nothing";
  ASSERT_THAT(std::string(line), HasSubstr("hanging")) << line;
  ASSERT_OK_AND_ASSIGN(auto mid, client().GetCache(kCache));
  EXPECT_EQ(mid.channels_size(), 1);
  EXPECT_EQ(mid.open_steps(), 1);
  std::system("pkill -KILL -f 'channel_test_client hang' >/dev/null 2>&1");
  pclose(child);
  // Its OpenChannel call ends with the connection: the channel closes and the step rolls back.
  ASSERT_NO_FATAL_FAILURE(ExpectRestored(before, /*max_written_slots=*/3));
  ASSERT_OK_AND_ASSIGN(auto after, client().GetCache(kCache));
  EXPECT_EQ(after.channels_size(), 0);
  EXPECT_EQ(server().engine().OpenChannels(), 0);
  ASSERT_NO_FATAL_FAILURE(ExpectStillServing());
}

TEST_F(TenantFaultTest, AnotherTenantsChannelIsNotFound) {
  auto alpha = server().NewClient(kAlphaToken);
  auto beta = server().NewClient(kBetaToken);
  ASSERT_NO_FATAL_FAILURE(CreateStartingState(256, alpha.get()));
  ASSERT_OK(beta->CreateCache(kCache, SmallConfig(64)));
  ASSERT_OK_AND_ASSIGN(auto channel, client::Channel::Open(*alpha, kCache, SmallChannel()));
  // Beta cannot plan on alpha's channel, close it, or see it.
  attnd::v1::PlanRequest plan = MakePlan(kCache, {{kSeqA, 1}});
  plan.set_channel_id(channel->id());
  EXPECT_ERROR(beta->Plan(plan), Code::kNotFound, "channel_id");
  EXPECT_ERROR(CloseChannel(*beta, channel->id()), Code::kNotFound, "channel_id");
  ASSERT_OK_AND_ASSIGN(auto beta_info, beta->GetCache(kCache));
  EXPECT_EQ(beta_info.channels_size(), 0);
  ASSERT_OK_AND_ASSIGN(auto alpha_info, alpha->GetCache(kCache));
  ASSERT_EQ(alpha_info.channels_size(), 1);
  EXPECT_EQ(alpha_info.channels(0).cache(), kCache);  // in the tenant's own names
  // Alpha's plan on it works.
  ASSERT_OK_AND_ASSIGN(auto planned, alpha->Plan(plan));
  EXPECT_GT(planned.channel_sequence(), 0u);
  ASSERT_OK(alpha->EndStep(planned.step_id(), /*abort=*/true).status());
}

}  // namespace
}  // namespace attnd::integration
