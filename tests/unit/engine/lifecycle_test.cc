// ForkSequence (copy-on-write prefix pages), ExportSequence and ImportSequence on the engine,
// over the CPU backend, and, built as tests/kernels' cuda_lifecycle_test with
// ATTND_LIFECYCLE_ON_CUDA, over the CUDA backend (skipped without a device). The property users
// rely on: a forked (or imported) sequence attends bitwise like a sequence that was prefilled
// with the same tokens, and nothing done to one sequence changes another's bytes.
#include <atomic>
#include <chrono>
#include <thread>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "engine/engine.h"
#include "engine_test_util.h"
#ifdef ATTND_LIFECYCLE_ON_CUDA
#include "backend/cuda_backend.h"
#endif

namespace attnd::testing {
namespace {

using ::testing::HasSubstr;

// One step of several entries with given per-entry rows. Each layer's q/k/v is the
// concatenation of the entries' rows, so two entries given the same rows see the same inputs.
struct Rows {
  std::vector<std::string> q, k, v;  // per layer
};

Rows RandomRows(const CacheGeometry& g, int64_t tokens, uint32_t seed) {
  Rows rows;
  for (int32_t layer = 0; layer < g.num_layers; ++layer) {
    const LayerTensors t = RandomLayer(g, tokens, seed * 131 + layer);
    rows.q.push_back(t.q);
    rows.k.push_back(t.k);
    rows.v.push_back(t.v);
  }
  return rows;
}

// The first `tokens` rows of `rows`.
Rows Prefix(const Rows& rows, const CacheGeometry& g, int64_t tokens) {
  Rows prefix;
  const int64_t element = DTypeBytes(g.q_dtype);
  for (size_t layer = 0; layer < rows.q.size(); ++layer) {
    prefix.q.push_back(rows.q[layer].substr(0, tokens * g.num_qo_heads * g.k_head_dim * element));
    prefix.k.push_back(rows.k[layer].substr(0, tokens * g.num_kv_heads * g.k_head_dim * element));
    prefix.v.push_back(rows.v[layer].substr(0, tokens * g.num_kv_heads * g.v_head_dim * element));
  }
  return prefix;
}

// Runs a step of `entries`, entry i taking rows[i]; returns each layer's o. `layers`: which
// layers to run (all when empty); the step then commits (early when some are left out).
std::vector<std::string> RunStep(Engine& engine, const CacheGeometry& g, const std::string& cache,
                                 const std::vector<std::pair<uint64_t, const Rows*>>& entries,
                                 std::vector<int32_t> layers = {}) {
  PlanSpec spec;
  spec.cache = cache;
  spec.options.deterministic = true;
  int64_t tokens = 0;
  for (const auto& [id, rows] : entries) {
    PlanEntrySpec& entry = spec.entries.emplace_back();
    entry.sequence_id = id;
    entry.num_new_tokens = static_cast<int32_t>(rows->q[0].size() /
                                                (g.num_qo_heads * g.k_head_dim * 2));
    tokens += entry.num_new_tokens;
  }
  absl::StatusOr<PlanResult> plan = engine.Plan(spec);
  EXPECT_TRUE(plan.ok()) << plan.status();
  if (!plan.ok()) return {};
  if (layers.empty()) {
    for (int32_t layer = 0; layer < g.num_layers; ++layer) layers.push_back(layer);
  }
  std::vector<std::string> outputs(g.num_layers);
  for (const int32_t layer : layers) {
    LayerTensors t;
    for (const auto& [id, rows] : entries) {
      t.q += rows->q[layer];
      t.k += rows->k[layer];
      t.v += rows->v[layer];
    }
    auto result = ForwardSync(engine, t.Args(plan->step_id, layer, g, tokens));
    EXPECT_TRUE(result->status.ok()) << result->status;
    outputs[layer] = result->o;
  }
  if (static_cast<int32_t>(layers.size()) < g.num_layers) {
    auto ended = EndStepSync(engine, plan->step_id, /*abort=*/false);
    EXPECT_TRUE(ended.ok()) << ended.status();
  }
  return outputs;
}

// o rows [first, first + count) of one layer's output.
std::string OutRows(const std::string& o, const CacheGeometry& g, int64_t first, int64_t count) {
  const int64_t row = g.num_qo_heads * g.v_head_dim * DTypeBytes(g.q_dtype);
  return o.substr(first * row, count * row);
}

// Every byte of every layer's K and V pools.
std::vector<std::string> PoolBytes(Engine& engine, const CacheSpec& spec) {
  const CacheGeometry& g = spec.geometry;
  std::vector<std::string> pools;
  for (int32_t layer = 0; layer < g.num_layers; ++layer) {
    for (const bool v_pool : {false, true}) {
      std::string bytes((v_pool ? g.VPageBytes() : g.KPageBytes()) * g.num_pages, '\0');
      EXPECT_TRUE(engine
                      .ReadPages(spec.name, layer, v_pool, 0,
                                 std::span<uint8_t>(reinterpret_cast<uint8_t*>(bytes.data()),
                                                    bytes.size()))
                      .ok());
      pools.push_back(std::move(bytes));
    }
  }
  return pools;
}

CacheStatus Status(Engine& engine, const std::string& cache) {
  absl::StatusOr<CacheStatus> status = engine.GetCache(cache);
  EXPECT_TRUE(status.ok()) << status.status();
  return *status;
}

absl::StatusOr<ForkResult> Fork(Engine& engine, const std::string& cache, uint64_t source,
                                uint64_t new_id, int64_t tokens) {
  ForkSpec spec;
  spec.cache = cache;
  spec.source_id = source;
  spec.new_id = new_id;
  spec.num_tokens = tokens;
  return engine.ForkSequence(spec);
}

// The backend under test: the CPU backend, or the CUDA backend when built for it (null
// without a device: the test skips).
std::unique_ptr<Backend> BackendUnderTest() {
#ifdef ATTND_LIFECYCLE_ON_CUDA
  if (CudaDeviceCount() == 0) return nullptr;
  CudaBackendOptions options;
  options.kv_budget_bytes = 64 << 20;
  absl::StatusOr<std::unique_ptr<Backend>> backend = MakeCudaBackend(options);
  return backend.ok() ? *std::move(backend) : nullptr;
#else
  CpuBackendOptions options;
  options.kv_budget_bytes = 64 << 20;
  options.num_workers = 2;
  return MakeCpuBackend(options);
#endif
}

class LifecycleTest : public ::testing::Test {
 protected:
  std::unique_ptr<Backend> backend = BackendUnderTest();
  // Without the backend (no device) the engine runs on a CPU backend that no test reaches.
  std::unique_ptr<Backend> unused = backend ? nullptr : MakeCpuBackend({});
  std::unique_ptr<Engine> owned_engine =
      std::make_unique<Engine>(EngineOptions(), backend ? backend.get() : unused.get(), nullptr);
  Engine& engine = *owned_engine;
  const CacheSpec spec = SmallCache("c", /*num_pages=*/32, /*page_size=*/4);
  const CacheGeometry& g = spec.geometry;
  void SetUp() override {
    if (backend == nullptr) GTEST_SKIP() << "no CUDA device";
    ASSERT_TRUE(engine.CreateCache(spec).ok());
  }
};

// Fork of `source` (prefilled with `rows`) at `fork_tokens` vs a sequence prefilled with the
// same first `fork_tokens` rows: both extended with the same rows (a prefill chunk, then
// decodes) in one step each time, their o must be bitwise equal in every layer.
void ExpectForkMatchesPrefilled(Engine& engine, const CacheGeometry& g, const std::string& cache,
                                uint64_t fork_id, uint64_t reference_id, const Rows& prefix,
                                uint32_t seed) {
  ASSERT_EQ(RunStep(engine, g, cache, {{reference_id, &prefix}}).size(),
            static_cast<size_t>(g.num_layers));
  for (const int64_t extend : {3, 1, 1, 4}) {
    const Rows more = RandomRows(g, extend, seed++);
    const std::vector<std::string> o =
        RunStep(engine, g, cache, {{fork_id, &more}, {reference_id, &more}});
    ASSERT_EQ(o.size(), static_cast<size_t>(g.num_layers));
    for (int32_t layer = 0; layer < g.num_layers; ++layer) {
      EXPECT_EQ(OutRows(o[layer], g, 0, extend), OutRows(o[layer], g, extend, extend))
          << "layer " << layer << " after extending by " << extend;
    }
  }
  EXPECT_EQ(*engine.SequenceLength(cache, fork_id), *engine.SequenceLength(cache, reference_id));
}

TEST_F(LifecycleTest, ForkInsidePageAttendsBitwiseLikePrefilledSequence) {
  const Rows source_rows = RandomRows(g, 10, 1);  // pages 0-1 full, page 2 holds 2 tokens
  RunStep(engine, g, "c", {{1, &source_rows}});
  const std::vector<std::string> before = PoolBytes(engine, spec);

  absl::StatusOr<ForkResult> forked = Fork(engine, "c", 1, 2, 6);  // ends inside page 1
  ASSERT_TRUE(forked.ok()) << forked.status();
  EXPECT_EQ(forked->num_tokens, 6);
  EXPECT_EQ(forked->shared_pages, 2);
  EXPECT_EQ(Status(engine, "c").used_pages, 3);  // the fork allocates nothing
  EXPECT_EQ(Status(engine, "c").shared_pages, 2);

  ExpectForkMatchesPrefilled(engine, g, "c", 2, 3, Prefix(source_rows, g, 6), 10);
  // The source's pages never changed: the fork's writes went to its copy and fresh pages.
  const std::vector<std::string> after = PoolBytes(engine, spec);
  for (size_t pool = 0; pool < before.size(); ++pool) {
    const int64_t page_bytes = (pool % 2 == 1) ? g.VPageBytes() : g.KPageBytes();
    // Pages 0..2 are the source's (allocated first, low ids first).
    EXPECT_EQ(after[pool].substr(0, 3 * page_bytes), before[pool].substr(0, 3 * page_bytes))
        << "pool " << pool;
  }
  EXPECT_EQ(*engine.SequenceLength("c", 1), 10);
}

TEST_F(LifecycleTest, ForkAtPageBoundarySharesWholePagesAndCopiesNothing) {
  const Rows source_rows = RandomRows(g, 8, 2);
  RunStep(engine, g, "c", {{1, &source_rows}});
  ASSERT_TRUE(Fork(engine, "c", 1, 2, 8).ok());
  EXPECT_EQ(Status(engine, "c").used_pages, 2);
  EXPECT_EQ(Status(engine, "c").shared_pages, 2);
  const Rows one = RandomRows(g, 1, 3);
  RunStep(engine, g, "c", {{2, &one}});
  EXPECT_EQ(Status(engine, "c").used_pages, 3);    // one fresh page, no copy
  EXPECT_EQ(Status(engine, "c").shared_pages, 2);  // the prefix is still shared
  ExpectForkMatchesPrefilled(engine, g, "c", 1, 5, source_rows, 20);
}

TEST_F(LifecycleTest, ForkOfWholeSourceWithZeroTokens) {
  const Rows source_rows = RandomRows(g, 5, 4);
  RunStep(engine, g, "c", {{1, &source_rows}});
  absl::StatusOr<ForkResult> forked = Fork(engine, "c", 1, 2, 0);
  ASSERT_TRUE(forked.ok());
  EXPECT_EQ(forked->num_tokens, 5);
  EXPECT_EQ(forked->shared_pages, 2);
  ExpectForkMatchesPrefilled(engine, g, "c", 2, 3, source_rows, 30);
}

TEST_F(LifecycleTest, SourceFreedFirstLeavesTheForkWhole) {
  const Rows source_rows = RandomRows(g, 7, 5);
  RunStep(engine, g, "c", {{1, &source_rows}});
  ASSERT_TRUE(Fork(engine, "c", 1, 2, 7).ok());
  absl::StatusOr<int64_t> freed = engine.FreeSequences("c", {1});
  ASSERT_TRUE(freed.ok());
  EXPECT_EQ(*freed, 0);  // every page is still the fork's
  EXPECT_EQ(Status(engine, "c").used_pages, 2);
  EXPECT_EQ(Status(engine, "c").shared_pages, 0);
  // Sole holder now: the fork writes its partial page in place.
  ExpectForkMatchesPrefilled(engine, g, "c", 2, 3, source_rows, 40);
  ASSERT_TRUE(engine.FreeSequences("c", {2, 3}).ok());
  EXPECT_EQ(Status(engine, "c").used_pages, 0);
}

TEST_F(LifecycleTest, ForkOfAForkAndFreesInAnyOrder) {
  const Rows source_rows = RandomRows(g, 11, 6);
  RunStep(engine, g, "c", {{1, &source_rows}});
  ASSERT_TRUE(Fork(engine, "c", 1, 2, 9).ok());
  ASSERT_TRUE(Fork(engine, "c", 2, 3, 5).ok());
  EXPECT_EQ(Status(engine, "c").used_pages, 3);
  ExpectForkMatchesPrefilled(engine, g, "c", 3, 4, Prefix(source_rows, g, 5), 50);
  ASSERT_TRUE(engine.FreeSequences("c", {2}).ok());
  ExpectForkMatchesPrefilled(engine, g, "c", 1, 5, source_rows, 60);
  ASSERT_TRUE(engine.FreeSequences("c", {1, 3, 4, 5}).ok());
  EXPECT_EQ(Status(engine, "c").used_pages, 0);
  EXPECT_EQ(Status(engine, "c").shared_pages, 0);
}

TEST_F(LifecycleTest, SourceAppendingIntoSharedPageCopiesItAndLeavesTheForkIntact) {
  const Rows source_rows = RandomRows(g, 6, 7);
  RunStep(engine, g, "c", {{1, &source_rows}});
  ASSERT_TRUE(Fork(engine, "c", 1, 2, 6).ok());
  const Rows other = RandomRows(g, 3, 8);
  RunStep(engine, g, "c", {{1, &other}});  // the source writes past 6 in its copy
  ExpectForkMatchesPrefilled(engine, g, "c", 2, 3, source_rows, 70);
}

TEST_F(LifecycleTest, AbortedStepRollsBackItsCopy) {
  const Rows source_rows = RandomRows(g, 6, 9);
  RunStep(engine, g, "c", {{1, &source_rows}});
  ASSERT_TRUE(Fork(engine, "c", 1, 2, 6).ok());
  const CacheStatus before = Status(engine, "c");
  absl::StatusOr<PlanResult> plan = engine.Plan(Decode("c", {{2, 1}}));
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(Status(engine, "c").used_pages, before.used_pages + 1);  // the copy
  RunAllLayers(engine, g, *plan);  // commits: run it again below on an aborted one
  ASSERT_TRUE(engine.FreeSequences("c", {2}).ok());
  ASSERT_TRUE(Fork(engine, "c", 1, 2, 6).ok());
  plan = engine.Plan(Decode("c", {{2, 1}}));
  ASSERT_TRUE(plan.ok());
  const LayerTensors t = RandomLayer(g, 1, 3);
  ASSERT_TRUE(ForwardSync(engine, t.Args(plan->step_id, 0, g, 1))->status.ok());
  ASSERT_TRUE(EndStepSync(engine, plan->step_id, /*abort=*/true).ok());
  const CacheStatus after = Status(engine, "c");
  EXPECT_EQ(after.used_pages, before.used_pages);
  EXPECT_EQ(after.shared_pages, before.shared_pages);
  EXPECT_EQ(*engine.SequenceLength("c", 2), 6);
  ExpectForkMatchesPrefilled(engine, g, "c", 2, 3, source_rows, 80);
}

TEST_F(LifecycleTest, EarlyCommitCopiesTheLayersItDidNotRun) {
  // Fresh pools read 0 in unwritten slots, so a fork and a prefilled sequence that both commit
  // a step after layer 0 only hold the same bytes in layer 1.
  const Rows source_rows = RandomRows(g, 6, 10);
  RunStep(engine, g, "c", {{1, &source_rows}});
  ASSERT_TRUE(Fork(engine, "c", 1, 2, 6).ok());
  const Rows prefix = source_rows;
  RunStep(engine, g, "c", {{3, &prefix}});
  const Rows more = RandomRows(g, 1, 11);
  RunStep(engine, g, "c", {{2, &more}, {3, &more}}, /*layers=*/{0});
  const Rows next = RandomRows(g, 1, 12);
  const std::vector<std::string> o = RunStep(engine, g, "c", {{2, &next}, {3, &next}});
  ASSERT_EQ(o.size(), static_cast<size_t>(g.num_layers));
  for (int32_t layer = 0; layer < g.num_layers; ++layer) {
    EXPECT_EQ(OutRows(o[layer], g, 0, 1), OutRows(o[layer], g, 1, 1)) << "layer " << layer;
  }
}

TEST_F(LifecycleTest, SharedPagesCountOnceAgainstCapacity) {
  const CacheSpec small = SmallCache("small", /*num_pages=*/8, /*page_size=*/4);
  ASSERT_TRUE(engine.CreateCache(small).ok());
  const Rows rows = RandomRows(g, 26, 13);  // 7 pages, the last holding 2 tokens
  RunStep(engine, g, "small", {{1, &rows}});
  for (uint64_t id = 2; id < 12; ++id) ASSERT_TRUE(Fork(engine, "small", 1, id, 0).ok());
  EXPECT_EQ(Status(engine, "small").used_pages, 7);
  EXPECT_EQ(Status(engine, "small").shared_pages, 7);
  EXPECT_EQ(Status(engine, "small").num_sequences, 11);
  // Two forks writing into the shared last page need a copy each; one page is free.
  absl::StatusOr<PlanResult> both = engine.Plan(Decode("small", {{2, 1}, {3, 1}}));
  EXPECT_EQ(both.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(both.status().message()), HasSubstr("needs 2 new pages"));
  EXPECT_EQ(Status(engine, "small").used_pages, 7);
  absl::StatusOr<PlanResult> one = engine.Plan(Decode("small", {{2, 1}}));
  ASSERT_TRUE(one.ok()) << one.status();
  RunAllLayers(engine, g, *one);
  EXPECT_EQ(Status(engine, "small").used_pages, 8);
}

TEST_F(LifecycleTest, ForkRefusalsNameTheFieldAndChangeNothing) {
  const Rows rows = RandomRows(g, 5, 14);
  RunStep(engine, g, "c", {{1, &rows}});
  EXPECT_EQ(Fork(engine, "nope", 1, 2, 0).status().code(), absl::StatusCode::kNotFound);
  absl::StatusOr<ForkResult> missing = Fork(engine, "c", 9, 2, 0);
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(missing.status().message()), HasSubstr("source_id"));
  absl::StatusOr<ForkResult> exists = Fork(engine, "c", 1, 1, 0);
  EXPECT_EQ(exists.status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_THAT(std::string(exists.status().message()), HasSubstr("new_id"));
  for (const int64_t tokens : {int64_t{-1}, int64_t{6}}) {
    absl::StatusOr<ForkResult> bad = Fork(engine, "c", 1, 2, tokens);
    EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(bad.status().message()), HasSubstr("num_tokens"));
  }
  absl::StatusOr<PlanResult> open = engine.Plan(Decode("c", {{1, 1}}));
  ASSERT_TRUE(open.ok());
  absl::StatusOr<ForkResult> busy = Fork(engine, "c", 1, 2, 0);
  EXPECT_EQ(busy.status().code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(EndStepSync(engine, open->step_id, true).ok());
  CacheSpec external = SmallCache("ext");
  external.external_pages = true;
  ASSERT_TRUE(engine.CreateCache(external).ok());
  EXPECT_EQ(Fork(engine, "ext", 1, 2, 0).status().code(),
            absl::StatusCode::kFailedPrecondition);
  const CacheStatus status = Status(engine, "c");
  EXPECT_EQ(status.num_sequences, 1);
  EXPECT_EQ(status.used_pages, 2);
  EXPECT_EQ(status.shared_pages, 0);
}

TEST_F(LifecycleTest, ConcurrentForksWhileStepsRun) {
  const Rows rows = RandomRows(g, 10, 15);
  RunStep(engine, g, "c", {{1, &rows}});
  const Rows other_rows = RandomRows(g, 3, 16);
  RunStep(engine, g, "c", {{1000, &other_rows}});
  std::atomic<bool> stop{false};
  std::thread stepper([&] {
    // Steps on the source itself (its shared partial page is copied each time the page is
    // shared) and on an unrelated sequence.
    uint32_t seed = 100;
    while (!stop.load()) {
      const Rows one = RandomRows(g, 1, seed++);
      RunStep(engine, g, "c", {{1, &one}, {1000, &one}});
      std::this_thread::sleep_for(std::chrono::microseconds(300));
    }
  });
  std::vector<std::thread> forkers;
  std::atomic<int> forked{0};
  for (int t = 0; t < 2; ++t) {
    forkers.emplace_back([&, t] {
      for (uint64_t i = 0; i < 40; ++i) {
        const uint64_t id = 2 + t * 100 + i;
        // FAILED_PRECONDITION while the source is in a step: retry.
        for (;;) {
          absl::StatusOr<ForkResult> result = Fork(engine, "c", 1, id, 10);
          if (result.ok()) break;
          ASSERT_EQ(result.status().code(), absl::StatusCode::kFailedPrecondition)
              << result.status();
        }
        ++forked;
        if (i % 2 == 0) {
          ASSERT_TRUE(engine.FreeSequences("c", {id}).ok());
        }
      }
    });
  }
  for (auto& thread : forkers) thread.join();
  stop = true;
  stepper.join();
  EXPECT_EQ(forked.load(), 80);
  // The forks kept exactly the source's first 10 tokens.
  ExpectForkMatchesPrefilled(engine, g, "c", 3, 5000, rows, 90);
  std::vector<uint64_t> all = {1, 1000, 5000};
  for (int t = 0; t < 2; ++t) {
    for (uint64_t i = 1; i < 40; i += 2) all.push_back(2 + t * 100 + i);
  }
  ASSERT_TRUE(engine.FreeSequences("c", all).ok());
  EXPECT_EQ(Status(engine, "c").used_pages, 0);
  EXPECT_EQ(Status(engine, "c").shared_pages, 0);
}

// Export -> import into another cache of the same shape, engine-level (the gRPC stream and its
// checksums are tested in tests/integration/sequence_test.cc).
void CopySequence(Engine& engine, const std::string& from, uint64_t id, const std::string& to,
                  uint64_t new_id) {
  absl::StatusOr<std::unique_ptr<SequenceExport>> exported = engine.ExportSequence(from, id);
  ASSERT_TRUE(exported.ok()) << exported.status();
  const CacheGeometry& g = (*exported)->spec().geometry;
  absl::StatusOr<std::unique_ptr<SequenceImport>> imported =
      engine.ImportSequence(to, new_id, (*exported)->num_tokens(), g);
  ASSERT_TRUE(imported.ok()) << imported.status();
  for (int32_t layer = 0; layer < g.num_layers; ++layer) {
    for (const bool v_pool : {false, true}) {
      const int64_t pages = (*exported)->num_pages();
      std::vector<uint8_t> bytes(pages * (v_pool ? g.VPageBytes() : g.KPageBytes()));
      ASSERT_TRUE((*exported)->Read(layer, v_pool, 0, pages, bytes).ok());
      ASSERT_TRUE((*imported)->Write(layer, v_pool, 0, pages, bytes).ok());
    }
  }
  ASSERT_TRUE((*imported)->Commit().ok());
}

TEST_F(LifecycleTest, ExportImportRoundTripAttendsBitwise) {
  CacheSpec other = spec;
  other.name = "d";
  ASSERT_TRUE(engine.CreateCache(other).ok());
  const Rows rows = RandomRows(g, 13, 17);
  RunStep(engine, g, "c", {{1, &rows}});
  CopySequence(engine, "c", 1, "d", 7);
  EXPECT_EQ(*engine.SequenceLength("d", 7), 13);
  EXPECT_EQ(Status(engine, "d").used_pages, 4);
  for (uint32_t seed = 200; seed < 203; ++seed) {
    const Rows more = RandomRows(g, seed == 200 ? 3 : 1, seed);
    const std::vector<std::string> a = RunStep(engine, g, "c", {{1, &more}});
    const std::vector<std::string> b = RunStep(engine, g, "d", {{7, &more}});
    ASSERT_EQ(a.size(), b.size());
    for (size_t layer = 0; layer < a.size(); ++layer) EXPECT_EQ(a[layer], b[layer]);
  }
}

TEST_F(LifecycleTest, ExportPinsPagesUntilItEnds) {
  const Rows rows = RandomRows(g, 6, 18);
  RunStep(engine, g, "c", {{1, &rows}});
  absl::StatusOr<std::unique_ptr<SequenceExport>> exported = engine.ExportSequence("c", 1);
  ASSERT_TRUE(exported.ok());
  // A step on the sequence now copies its partial page instead of writing it.
  const Rows one = RandomRows(g, 1, 19);
  RunStep(engine, g, "c", {{1, &one}});
  EXPECT_EQ(Status(engine, "c").used_pages, 3);  // the pinned 2 and the step's copy
  ASSERT_TRUE(engine.FreeSequences("c", {1}).ok());
  EXPECT_EQ(Status(engine, "c").used_pages, 2);  // the export's pages
  // The snapshot still reads what was committed when it began.
  CacheSpec other = spec;
  other.name = "d";
  ASSERT_TRUE(engine.CreateCache(other).ok());
  absl::StatusOr<std::unique_ptr<SequenceImport>> imported =
      engine.ImportSequence("d", 1, 6, g);
  ASSERT_TRUE(imported.ok());
  for (int32_t layer = 0; layer < g.num_layers; ++layer) {
    for (const bool v_pool : {false, true}) {
      std::vector<uint8_t> bytes(2 * (v_pool ? g.VPageBytes() : g.KPageBytes()));
      ASSERT_TRUE((*exported)->Read(layer, v_pool, 0, 2, bytes).ok());
      ASSERT_TRUE((*imported)->Write(layer, v_pool, 0, 2, bytes).ok());
    }
  }
  ASSERT_TRUE((*imported)->Commit().ok());
  exported->reset();
  EXPECT_EQ(Status(engine, "c").used_pages, 0);
  ExpectForkMatchesPrefilled(engine, g, "d", 1, 2, rows, 300);
}

TEST_F(LifecycleTest, UnfinishedImportChangesNothing) {
  {
    absl::StatusOr<std::unique_ptr<SequenceImport>> imported =
        engine.ImportSequence("c", 5, 9, g);
    ASSERT_TRUE(imported.ok());
    EXPECT_EQ(Status(engine, "c").used_pages, 3);  // reserved
    EXPECT_EQ(Status(engine, "c").num_sequences, 0);
    // The id is taken but not plannable, nor forkable into.
    absl::StatusOr<PlanResult> plan = engine.Plan(Decode("c", {{5, 1}}));
    EXPECT_EQ(plan.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_EQ(engine.ImportSequence("c", 5, 1, g).status().code(),
              absl::StatusCode::kAlreadyExists);
  }
  EXPECT_EQ(Status(engine, "c").used_pages, 0);
  EXPECT_EQ(Status(engine, "c").num_sequences, 0);
  absl::StatusOr<PlanResult> plan = engine.Plan(Decode("c", {{5, 1}}));
  EXPECT_TRUE(plan.ok());
  EXPECT_EQ(plan->entries[0].start_position, 0);
}

TEST_F(LifecycleTest, ImportRefusesWhatDoesNotFit) {
  CacheGeometry wrong = g;
  wrong.page_size = 8;
  absl::StatusOr<std::unique_ptr<SequenceImport>> shape = engine.ImportSequence("c", 1, 4, wrong);
  EXPECT_EQ(shape.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(shape.status().message()), HasSubstr("page_size"));
  absl::StatusOr<std::unique_ptr<SequenceImport>> big =
      engine.ImportSequence("c", 1, 33 * 4, g);
  EXPECT_EQ(big.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(Status(engine, "c").used_pages, 0);
  EXPECT_EQ(engine.ImportSequence("c", 1, 0, g).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(LifecycleTest, CacheDeletedDuringTransfersEndsThemCleanly) {
  const Rows rows = RandomRows(g, 6, 20);
  RunStep(engine, g, "c", {{1, &rows}});
  CacheSpec other = spec;
  other.name = "d";
  ASSERT_TRUE(engine.CreateCache(other).ok());
  absl::StatusOr<std::unique_ptr<SequenceExport>> exported = engine.ExportSequence("c", 1);
  ASSERT_TRUE(exported.ok());
  absl::StatusOr<std::unique_ptr<SequenceImport>> imported = engine.ImportSequence("d", 1, 6, g);
  ASSERT_TRUE(imported.ok());
  ASSERT_TRUE(engine.DeleteCache("c", false).ok());
  ASSERT_TRUE(engine.DeleteCache("d", false).ok());
  // The export still reads its snapshot (the pools live while it does); the import cannot
  // publish into a cache that is gone.
  std::vector<uint8_t> bytes(2 * g.KPageBytes());
  EXPECT_TRUE((*exported)->Read(0, false, 0, 2, bytes).ok());
  EXPECT_TRUE((*imported)->Write(0, false, 0, 2, bytes).ok());
  EXPECT_EQ((*imported)->Commit().code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE(engine.CreateCache(other).ok());  // a new "d" is not the import's
  EXPECT_EQ(Status(engine, "d").num_sequences, 0);
  exported->reset();
  imported->reset();
  EXPECT_EQ(Status(engine, "d").used_pages, 0);
}

}  // namespace
}  // namespace attnd::testing
