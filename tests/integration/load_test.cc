// Load and soak, bounded: the real server in-process on loopback (Server::Start; the CPU backend,
// or the CUDA one with ATTND_TEST_BACKEND=cuda as for the whole integration suite)
// and kDefaultClients clients, each driving mixed steps for kDefaultSeconds on one shared
// cache: prefill, decode,
// padding slots and mixed batches, every other step over a ForwardStream with all its layers in
// flight at once, sequences freed and replaced as they grow. Every layer's output is checked
// against the client's host reference; any failed call fails the test.
//
// Reported: steps run, step latency (plan to last layer) p50/p99, the process's RSS (server and
// clients) and the cache's used pages after warm-up and at the end, and the range of RSS and
// the peak of used pages sampled every 100 ms during the run. Flat means: used pages back to 0 and the open steps to 0 at both checkpoints
// (every client frees its sequences there), the KV budget's free bytes equal, and RSS grown by
// at most kRssToleranceBytes. Under AddressSanitizer the RSS check is skipped (its quarantine
// holds freed memory by design; LeakSanitizer checks leaks instead).
//
// ATTND_LOAD_CLIENTS and ATTND_LOAD_SECONDS override the sizes, e.g. for an hour-long soak.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <barrier>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <future>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "attnd/client/reference_cache.h"
#include "status_matchers.h"
#include "test_server.h"
#include "test_steps.h"

#if defined(__SANITIZE_ADDRESS__)
#define ATTND_LOAD_UNDER_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define ATTND_LOAD_UNDER_ASAN 1
#endif
#endif

namespace attnd::integration {
namespace {

constexpr int kDefaultClients = 8;
constexpr int kDefaultSeconds = 20;
// Long enough for the allocators' arenas and gRPC's buffers to reach their working size.
constexpr absl::Duration kWarmup = absl::Seconds(3);
constexpr int kMaxSequenceTokens = 24;  // a sequence is freed once it is this long
constexpr int64_t kCachePages = 512;
constexpr int64_t kRssToleranceBytes = int64_t{8} << 20;

int EnvInt(const char* name, int fallback) {
  const char* value = std::getenv(name);
  int parsed = 0;
  return value != nullptr && absl::SimpleAtoi(value, &parsed) && parsed > 0 ? parsed : fallback;
}

// VmRSS of this process, in bytes.
int64_t ResidentBytes() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("VmRSS:", 0) == 0) {
      int64_t kib = 0;
      absl::SimpleAtoi(absl::StripAsciiWhitespace(line.substr(6, line.size() - 6 - 3)), &kib);
      return kib * 1024;
    }
  }
  return -1;
}

struct Checkpoint {
  int64_t rss_bytes = 0;
  int64_t used_pages = 0;
  int64_t num_sequences = 0;
  int32_t open_steps = 0;
  int64_t kv_free_bytes = 0;
};

class LoadTest : public IntegrationTest {
 protected:
  Checkpoint Measure() {
    Checkpoint checkpoint;
    checkpoint.rss_bytes = ResidentBytes();
    auto cache = client().GetCache("shared");
    EXPECT_TRUE(cache.ok()) << cache.status();
    if (cache.ok()) {
      checkpoint.used_pages = cache->used_pages();
      checkpoint.num_sequences = cache->num_sequences();
      checkpoint.open_steps = cache->open_steps();
    }
    auto info = client().GetServerInfo();
    EXPECT_TRUE(info.ok()) << info.status();
    if (info.ok()) checkpoint.kv_free_bytes = info->kv_free_bytes();
    return checkpoint;
  }
};

// Step latencies in fixed log-spaced buckets (2% wide, 1 us to ~50 s): constant memory, so
// that recording them does not itself grow the RSS this test watches.
class LatencyHistogram {
 public:
  void Add(double micros) {
    const double clamped = std::max(micros, 1.0);
    const size_t bucket =
        std::min(counts_.size() - 1, static_cast<size_t>(std::log(clamped) / std::log(kGrowth)));
    ++counts_[bucket];
    ++total_;
  }
  void Merge(const LatencyHistogram& other) {
    for (size_t i = 0; i < counts_.size(); ++i) counts_[i] += other.counts_[i];
    total_ += other.total_;
  }
  int64_t count() const { return total_; }
  // The upper edge of the bucket holding the `fraction` quantile.
  double Quantile(double fraction) const {
    const int64_t rank = static_cast<int64_t>(fraction * static_cast<double>(total_));
    int64_t seen = 0;
    for (size_t i = 0; i < counts_.size(); ++i) {
      seen += counts_[i];
      if (seen > rank) return std::pow(kGrowth, static_cast<double>(i + 1));
    }
    return 0;
  }

 private:
  static constexpr double kGrowth = 1.02;
  std::vector<int64_t> counts_ = std::vector<int64_t>(900, 0);
  int64_t total_ = 0;
};

// One client's run: its own sequences (ids from `index` * 1000) in the shared cache.
class LoadClient {
 public:
  LoadClient(int index, std::unique_ptr<client::Client> client, const attnd::v1::CacheInfo& cache)
      : index_(index), client_(std::move(client)), cache_(cache), rng_(500 + index) {}

  void Start() {
    auto reference = client::ReferenceCache::Create(cache_.config());
    ASSERT_TRUE(reference.ok()) << reference.status();
    reference_ = *std::move(reference);
    auto session = client_->OpenStream({.window = 8});
    ASSERT_TRUE(session.ok()) << session.status();
    session_ = *std::move(session);
    live_ = {NextSequence(), NextSequence()};
  }

  // Runs `steps` steps, or until `deadline`; false (with a gtest failure recorded) on the
  // first error.
  bool Run(int steps, absl::Time deadline, LatencyHistogram& latencies_us) {
    for (int i = 0; i < steps && absl::Now() < deadline; ++i) {
      const auto start = std::chrono::steady_clock::now();
      if (!Step(step_count_ % 2 == 1)) return false;
      latencies_us.Add(
          std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start)
              .count());
      ++step_count_;
    }
    return true;
  }

  // Frees every sequence (a checkpoint needs the pool back at 0).
  bool FreeAll() {
    std::vector<uint64_t> ids;
    for (const uint64_t id : live_) {
      if (reference_->SequenceLength(id) > 0) ids.push_back(id);
    }
    if (!ids.empty()) {
      const absl::Status freed = client_->FreeSequences(cache_.name(), ids).status();
      EXPECT_TRUE(freed.ok()) << "client " << index_ << ": " << freed;
      if (!freed.ok()) return false;
      reference_->FreeSequences(ids);
    }
    live_ = {NextSequence(), NextSequence()};
    return true;
  }

  void Close() {
    if (session_ != nullptr) EXPECT_OK(session_->Close());
  }

 private:
  uint64_t NextSequence() { return uint64_t(index_) * 1000 + 1 + next_sequence_++; }

  // A step mixing both live sequences (new ones prefill, others decode) with padding; over the
  // stream with every layer sent before any answer is read.
  bool Step(bool over_stream) {
    Entries entries;
    for (const uint64_t id : live_) {
      const int64_t length = reference_->SequenceLength(id);
      entries.push_back({id, length == 0 ? 1 + static_cast<int32_t>(rng_() % 8) : 1});
    }
    if (rng_() % 3 == 0) entries.insert(entries.begin() + rng_() % 3, {0, 0});
    if (rng_() % 5 == 0) entries.pop_back();  // the second sequence sits this step out
    const attnd::v1::PlanRequest plan = MakePlan(cache_.name(), entries, rng_() % 2 == 0);
    auto step = over_stream ? session_->BeginStep(plan) : client_->BeginStep(plan);
    EXPECT_TRUE(step.ok()) << "client " << index_ << " plan: " << step.status();
    if (!step.ok()) return false;
    EXPECT_TRUE(reference_->BeginStep(plan).ok());
    const int32_t layers = cache_.config().num_layers();
    std::vector<attnd::v1::ForwardRequest> requests;
    std::vector<std::future<client::ForwardResult>> answers;
    for (int32_t layer = 0; layer < layers; ++layer) {
      requests.push_back(RandomLayer(rng_, cache_.config(), (*step)->num_tokens(), layer));
      if (over_stream) answers.push_back((*step)->ForwardAsync(requests.back()));
    }
    for (int32_t layer = 0; layer < layers; ++layer) {
      client::ForwardResult out =
          over_stream ? answers[layer].get() : (*step)->Forward(requests[layer]);
      EXPECT_TRUE(out.ok()) << "client " << index_ << " layer " << layer << ": " << out.status();
      if (!out.ok()) return false;
      auto expected = reference_->Forward(requests[layer]);
      EXPECT_TRUE(expected.ok()) << expected.status();
      if (!expected.ok()) return false;
      ExpectMatchesReference(*out, *expected, reference_->q_dtype(),
                             absl::StrCat("client ", index_, " step ", step_count_));
    }
    EXPECT_FALSE((*step)->open()) << "client " << index_ << ": step did not commit";
    reference_->EndStep(/*abort=*/false);
    // Sequences that grew long enough make room for new ones.
    for (uint64_t& id : live_) {
      if (reference_->SequenceLength(id) < kMaxSequenceTokens) continue;
      const std::vector<uint64_t> ids = {id};
      const absl::Status freed = client_->FreeSequences(cache_.name(), ids).status();
      EXPECT_TRUE(freed.ok()) << "client " << index_ << ": " << freed;
      if (!freed.ok()) return false;
      reference_->FreeSequences(ids);
      id = NextSequence();
    }
    return !::testing::Test::HasFailure();
  }

  const int index_;
  std::unique_ptr<client::Client> client_;
  const attnd::v1::CacheInfo cache_;
  std::mt19937_64 rng_;
  std::unique_ptr<client::ReferenceCache> reference_;
  std::unique_ptr<client::StreamSession> session_;
  std::vector<uint64_t> live_;
  uint64_t next_sequence_ = 0;
  int step_count_ = 0;
};

TEST_F(LoadTest, ConcurrentClientsMixedStepsHoldSteady) {
  const int num_clients = EnvInt("ATTND_LOAD_CLIENTS", kDefaultClients);
  const absl::Duration duration = absl::Seconds(EnvInt("ATTND_LOAD_SECONDS", kDefaultSeconds));
  ASSERT_OK_AND_ASSIGN(auto cache, client().CreateCache("shared", SmallConfig(kCachePages)));
  std::vector<std::unique_ptr<LoadClient>> clients;
  for (int i = 0; i < num_clients; ++i) {
    auto made = NewClient();
    ASSERT_NE(made, nullptr);
    clients.push_back(std::make_unique<LoadClient>(i, std::move(made), cache));
    ASSERT_NO_FATAL_FAILURE(clients.back()->Start());
  }

  // Two checkpoints where every client stands still with its sequences freed.
  Checkpoint warm, end;
  std::atomic<int64_t> peak_used_pages{0};
  std::atomic<int64_t> min_rss{std::numeric_limits<int64_t>::max()}, max_rss{0};
  std::atomic<bool> measuring{false};
  absl::Time deadline = absl::InfiniteFuture();
  const absl::Time warmup_end = absl::Now() + kWarmup;
  std::atomic<bool> running{true};
  std::vector<LatencyHistogram> latencies(num_clients);
  std::atomic<bool> failed{false};
  std::barrier sync(num_clients + 1);
  std::vector<std::thread> threads;
  for (int i = 0; i < num_clients; ++i) {
    threads.emplace_back([&, i] {
      LatencyHistogram warmup_latencies;
      bool ok = clients[i]->Run(std::numeric_limits<int>::max(), warmup_end, warmup_latencies) &&
                clients[i]->FreeAll();
      sync.arrive_and_wait();  // warm-up done
      sync.arrive_and_wait();  // measured; `deadline` set
      ok = ok && clients[i]->Run(std::numeric_limits<int>::max(), deadline, latencies[i]) &&
           clients[i]->FreeAll();
      if (!ok) failed = true;
      sync.arrive_and_wait();  // run done
    });
  }
  std::thread monitor([&] {
    auto watcher = NewClient();
    while (running.load()) {
      auto info = watcher->GetCache("shared");
      if (info.ok()) {
        int64_t peak = peak_used_pages.load();
        while (info->used_pages() > peak &&
               !peak_used_pages.compare_exchange_weak(peak, info->used_pages())) {
        }
      }
      if (measuring.load()) {
        const int64_t rss = ResidentBytes();
        min_rss = std::min(min_rss.load(), rss);
        max_rss = std::max(max_rss.load(), rss);
      }
      absl::SleepFor(absl::Milliseconds(100));
    }
  });
  sync.arrive_and_wait();
  warm = Measure();
  const absl::Time start = absl::Now();
  deadline = start + duration;
  measuring = true;
  sync.arrive_and_wait();
  sync.arrive_and_wait();
  const absl::Duration elapsed = absl::Now() - start;
  end = Measure();
  measuring = false;
  running = false;
  monitor.join();
  for (std::thread& thread : threads) thread.join();
  for (auto& load_client : clients) load_client->Close();
  ASSERT_FALSE(failed.load()) << "a call failed or an output differed from the reference";

  LatencyHistogram all;
  for (const LatencyHistogram& per_client : latencies) all.Merge(per_client);
  ASSERT_GE(all.count(), num_clients) << "no steps ran";
  const double p50 = all.Quantile(0.50);
  const double p99 = all.Quantile(0.99);
  std::printf(
      "load: %d clients, %lld mixed steps (half unary, half ForwardStream) in %s "
      "(%.0f steps/s); step latency p50 %.0f us, p99 %.0f us\n"
      "load: after warm-up: RSS %.1f MiB, used pages %lld, sequences %lld, open steps %d, "
      "KV free %lld bytes\n"
      "load: at the end:    RSS %.1f MiB, used pages %lld, sequences %lld, open steps %d, "
      "KV free %lld bytes\n"
      "load: during the run: RSS %.1f..%.1f MiB, peak used pages %lld of %lld\n",
      num_clients, static_cast<long long>(all.count()), absl::FormatDuration(elapsed).c_str(),
      static_cast<double>(all.count()) / absl::ToDoubleSeconds(elapsed), p50, p99,
      warm.rss_bytes / 1048576.0, static_cast<long long>(warm.used_pages),
      static_cast<long long>(warm.num_sequences), warm.open_steps,
      static_cast<long long>(warm.kv_free_bytes), end.rss_bytes / 1048576.0,
      static_cast<long long>(end.used_pages), static_cast<long long>(end.num_sequences),
      end.open_steps, static_cast<long long>(end.kv_free_bytes), min_rss.load() / 1048576.0,
      max_rss.load() / 1048576.0, static_cast<long long>(peak_used_pages.load()),
      static_cast<long long>(kCachePages));
  RecordProperty("step_p50_us", static_cast<int>(p50));
  RecordProperty("step_p99_us", static_cast<int>(p99));
  RecordProperty("rss_growth_bytes", static_cast<int>(end.rss_bytes - warm.rss_bytes));

  EXPECT_EQ(warm.used_pages, 0);
  EXPECT_EQ(end.used_pages, 0) << "pages leaked over the run";
  EXPECT_EQ(end.num_sequences, 0);
  EXPECT_EQ(warm.open_steps, 0);
  EXPECT_EQ(end.open_steps, 0) << "steps leaked over the run";
  EXPECT_EQ(end.kv_free_bytes, warm.kv_free_bytes);
  EXPECT_GT(peak_used_pages.load(), 0) << "the monitor never saw the load";
  // Each client holds at most two sequences of at most kMaxSequenceTokens tokens.
  EXPECT_LE(peak_used_pages.load(), num_clients * 2 * ((kMaxSequenceTokens + 3) / 4));
#ifndef ATTND_LOAD_UNDER_ASAN
  EXPECT_LE(end.rss_bytes - warm.rss_bytes, kRssToleranceBytes)
      << "RSS grew from " << warm.rss_bytes << " to " << end.rss_bytes << " bytes";
#endif
}

}  // namespace
}  // namespace attnd::integration
