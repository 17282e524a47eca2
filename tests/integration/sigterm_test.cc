// SIGTERM to the attnd binary (--backend=cpu) while clients drive steps over unary calls and
// ForwardStreams: the daemon drains (open steps finish, new plans get UNAVAILABLE) and exits 0.
// Every call either completed, and then a completed step's outputs match the host reference,
// or failed with UNAVAILABLE or CANCELLED; nothing else.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "attnd/client/client.h"
#include "attnd/client/reference_cache.h"
#include "daemon_process.h"
#include "status_matchers.h"
#include "test_server.h"
#include "test_steps.h"

#ifndef ATTND_BINARY
#error "ATTND_BINARY: the path of the attnd executable"
#endif

namespace attnd::integration {
namespace {

using Code = absl::StatusCode;

bool DrainCode(const absl::Status& status) {
  return status.code() == Code::kUnavailable || status.code() == Code::kCancelled;
}

// What one load client saw.
struct ClientReport {
  int steps_committed = 0;
  int steps_committed_after_signal = 0;
  int steps_interrupted = 0;  // planned, then a layer failed with a drain code
  std::vector<absl::Status> errors;
  bool stopped_by_drain = false;
};

// Sequences of 5 prefill tokens and 7 decode steps each, freed at the end, on its own cache;
// odd clients step over a ForwardStream. Runs until a call fails.
void DriveSteps(client::Client& client, int index, const std::atomic<bool>& signalled,
                std::atomic<int>& committed, ClientReport& report) {
  const std::string cache = absl::StrCat("load-", index);
  ASSERT_OK_AND_ASSIGN(auto info, client.CreateCache(cache, SmallConfig(64)));
  ASSERT_OK_AND_ASSIGN(auto reference, client::ReferenceCache::Create(info.config()));
  std::unique_ptr<client::StreamSession> session;
  if (index % 2 == 1) {
    ASSERT_OK_AND_ASSIGN(session, client.OpenStream());
  }
  std::mt19937_64 rng(1000 + index);
  auto failed = [&](const absl::Status& status, const std::string& what) {
    report.errors.push_back(status);
    EXPECT_TRUE(DrainCode(status)) << "client " << index << ": " << what << ": " << status;
    report.stopped_by_drain = DrainCode(status);
  };
  for (uint64_t sequence = 1;; ++sequence) {
    for (int step_index = 0; step_index < 8; ++step_index) {
      const attnd::v1::PlanRequest plan =
          MakePlan(cache, {{sequence, step_index == 0 ? 5 : 1}, {0, 0}});
      auto step = session != nullptr ? session->BeginStep(plan) : client.BeginStep(plan);
      if (!step.ok()) return failed(step.status(), "Plan");
      ASSERT_OK(reference->BeginStep(plan));
      for (int32_t layer = 0; layer < info.config().num_layers(); ++layer) {
        const attnd::v1::ForwardRequest request =
            RandomLayer(rng, info.config(), (*step)->num_tokens(), layer);
        auto out = (*step)->Forward(request);
        if (!out.ok()) {
          ++report.steps_interrupted;
          reference->EndStep(/*abort=*/true);
          return failed(out.status(), "Forward");
        }
        ASSERT_OK_AND_ASSIGN(auto expected, reference->Forward(request));
        ExpectMatchesReference(*out, expected, reference->q_dtype(),
                               absl::StrCat("client ", index, " layer ", layer));
      }
      EXPECT_FALSE((*step)->open());
      reference->EndStep(/*abort=*/false);
      ++report.steps_committed;
      if (signalled.load()) ++report.steps_committed_after_signal;
      committed.fetch_add(1);
    }
    const std::vector<uint64_t> ids = {sequence};
    const absl::Status freed = client.FreeSequences(cache, ids).status();
    if (!freed.ok()) return failed(freed, "FreeSequences");
    reference->FreeSequences(ids);
  }
}

TEST(SigtermTest, DrainsUnderLoadAndExitsZero) {
  PinGrpcCallbackQueue();
  Daemon daemon(ATTND_BINARY,
                {"--backend=cpu", "--kv-memory-bytes=67108864", "--listen-address=127.0.0.1:0",
                 "--metrics-address=", "--drain-grace=20s", "--exit-grace=2s"});
  ASSERT_GT(daemon.pid(), 0);
  const std::string serving =
      daemon.AwaitLog("serving attnd.v1.AttentionService on port ", absl::Seconds(30));
  ASSERT_FALSE(serving.empty()) << daemon.log();
  int port = 0;
  const size_t at = serving.find("on port ") + 8;
  ASSERT_TRUE(absl::SimpleAtoi(serving.substr(at, serving.find(' ', at) - at), &port)) << serving;

  constexpr int kClients = 4;
  // The clients (their channels) are made and destroyed here, one at a time, not in their
  // threads. On Linux gRPC 1.51 runs callback-API completions on a shared completion queue with
  // its own threads, reference-counted by the channels that use it; channels made and destroyed
  // concurrently in the client threads once ended in an ASan double free inside gRPC
  // (grpc_cq_internal_unref, on one of those threads) in CI.
  std::vector<std::unique_ptr<client::Client>> connections;
  for (int i = 0; i < kClients; ++i) {
    client::ClientOptions options;
    options.address = absl::StrCat("127.0.0.1:", port);
    options.timeout = absl::Seconds(30);
    ASSERT_OK_AND_ASSIGN(auto made, client::Client::Connect(options));
    connections.push_back(std::move(made));
  }
  std::atomic<bool> signalled{false};
  std::atomic<int> committed{0};
  std::vector<ClientReport> reports(kClients);
  std::vector<std::thread> clients;
  for (int i = 0; i < kClients; ++i) {
    clients.emplace_back(
        [&, i] { DriveSteps(*connections[i], i, signalled, committed, reports[i]); });
  }
  // Signal once every client is well into its loop.
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  while (committed.load() < 10 * kClients && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  const int committed_at_signal = committed.load();
  EXPECT_GE(committed_at_signal, 10 * kClients) << "the load never got going";
  signalled = true;
  const absl::Time signal_time = absl::Now();
  daemon.Signal(SIGTERM);
  const int exit_code = daemon.Wait(absl::Seconds(60));
  const absl::Duration exit_after = absl::Now() - signal_time;
  for (std::thread& thread : clients) thread.join();

  EXPECT_EQ(exit_code, 0) << daemon.log();
  EXPECT_LT(exit_after, absl::Seconds(20)) << "the drain waited out its grace: a step leaked";
  EXPECT_NE(daemon.log().find("draining"), std::string::npos) << daemon.log();
  EXPECT_NE(daemon.log().find("stopped"), std::string::npos) << daemon.log();
  int after_signal = 0;
  int interrupted = 0;
  for (int i = 0; i < kClients; ++i) {
    EXPECT_TRUE(reports[i].stopped_by_drain) << "client " << i << " did not stop on the drain";
    after_signal += reports[i].steps_committed_after_signal;
    interrupted += reports[i].steps_interrupted;
  }
  std::printf("sigterm under load: %d steps committed before the signal, %d after it (open "
              "steps finishing during the drain), %d interrupted; exit %d after %s\n",
              committed_at_signal, after_signal, interrupted, exit_code,
              absl::FormatDuration(exit_after).c_str());
}

// Two micro-batches pipelined on one ForwardStream, two forwards in flight (the e2e case
// `attnctl bench --stream --micro_batches=2 --window=2` that once hung a GPU run, issue 18), on
// several streams; one client cancels its stream mid-step, then SIGTERM lands with the others'
// forwards in flight. Every stream must end and attnd must exit 0 within its grace.
void DrivePipelined(client::Client& client, int index, bool cancel_mid_step,
                    std::atomic<int>& committed, std::vector<absl::Status>& errors) {
  const std::string cache = absl::StrCat("pipelined-", index);
  ASSERT_OK_AND_ASSIGN(auto info, client.CreateCache(cache, SmallConfig(256)));
  ASSERT_OK_AND_ASSIGN(auto session, client.OpenStream({.window = 2}));
  std::mt19937_64 rng(2000 + index);
  for (int round = 0;; ++round) {
    // Micro-batch b holds sequences 2b+1 and 2b+2: a prefill first, decode after.
    std::vector<std::unique_ptr<client::Step>> steps;
    for (uint64_t b = 0; b < 2; ++b) {
      const int32_t tokens = round == 0 ? 3 : 1;
      auto step = session->BeginStep(MakePlan(cache, {{2 * b + 1, tokens}, {2 * b + 2, tokens}}));
      if (!step.ok()) return errors.push_back(step.status());
      steps.push_back(*std::move(step));
    }
    absl::Mutex mu;
    int in_flight = 0;
    absl::Status failed;
    for (int32_t layer = 0; layer < info.config().num_layers(); ++layer) {
      for (auto& step : steps) {
        {
          absl::MutexLock lock(&mu);
          mu.Await(absl::Condition(
              +[](int* count) { return *count < 2; }, &in_flight));
          ++in_flight;
        }
        step->ForwardAsync(RandomLayer(rng, info.config(), step->num_tokens(), layer),
                           [&](client::ForwardResult result) {
                             absl::MutexLock lock(&mu);
                             if (!result.ok() && failed.ok()) failed = result.status();
                             --in_flight;
                           });
        if (cancel_mid_step && round == 5 && layer == 0) session->Cancel();
      }
    }
    {
      absl::MutexLock lock(&mu);
      mu.Await(absl::Condition(+[](int* count) { return *count == 0; }, &in_flight));
    }
    if (!failed.ok()) return errors.push_back(failed);
    for (auto& step : steps) {
      if (!step->open()) continue;
      const absl::Status ended = step->End().status();
      if (!ended.ok()) return errors.push_back(ended);
    }
    committed.fetch_add(2);
  }
}

TEST(SigtermTest, PipelinedStreamsAndACancelledOneEndAndTheDaemonExits) {
  PinGrpcCallbackQueue();
  Daemon daemon(ATTND_BINARY,
                {"--backend=cpu", "--kv-memory-bytes=67108864", "--listen-address=127.0.0.1:0",
                 "--metrics-address=", "--drain-grace=10s", "--exit-grace=2s"});
  ASSERT_GT(daemon.pid(), 0);
  const std::string serving =
      daemon.AwaitLog("serving attnd.v1.AttentionService on port ", absl::Seconds(30));
  ASSERT_FALSE(serving.empty()) << daemon.log();
  int port = 0;
  const size_t at = serving.find("on port ") + 8;
  ASSERT_TRUE(absl::SimpleAtoi(serving.substr(at, serving.find(' ', at) - at), &port)) << serving;

  constexpr int kClients = 3;
  std::vector<std::unique_ptr<client::Client>> connections;
  for (int i = 0; i < kClients; ++i) {
    client::ClientOptions options;
    options.address = absl::StrCat("127.0.0.1:", port);
    options.timeout = absl::Seconds(30);
    ASSERT_OK_AND_ASSIGN(auto made, client::Client::Connect(options));
    connections.push_back(std::move(made));
  }
  std::atomic<int> committed{0};
  std::atomic<bool> cancelled_one_done{false};
  std::vector<std::vector<absl::Status>> errors(kClients);
  std::vector<std::thread> clients;
  for (int i = 0; i < kClients; ++i) {
    clients.emplace_back([&, i] {
      DrivePipelined(*connections[i], i, /*cancel_mid_step=*/i == 0, committed, errors[i]);
      if (i == 0) cancelled_one_done = true;
    });
  }
  // Signal once the cancelled stream is over and the others are well into their loops.
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while ((committed.load() < 40 || !cancelled_one_done.load()) && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_GE(committed.load(), 40) << "the load never got going";
  EXPECT_TRUE(cancelled_one_done.load()) << "the cancelled stream never ended";
  const absl::Time signal_time = absl::Now();
  daemon.Signal(SIGTERM);
  const int exit_code = daemon.Wait(absl::Seconds(30));
  const absl::Duration exit_after = absl::Now() - signal_time;
  for (std::thread& thread : clients) thread.join();
  EXPECT_EQ(exit_code, 0) << daemon.log();
  EXPECT_LT(exit_after, absl::Seconds(10)) << daemon.log();
  ASSERT_EQ(errors[0].size(), 1u);
  EXPECT_EQ(errors[0][0].code(), Code::kCancelled) << errors[0][0];
  for (int i = 1; i < kClients; ++i) {
    ASSERT_EQ(errors[i].size(), 1u) << "client " << i;
    EXPECT_TRUE(DrainCode(errors[i][0])) << "client " << i << ": " << errors[i][0];
  }
}

// A second SIGTERM while the drain waits for an open step ends the process at once (exit 1),
// instead of after --drain-grace; the first one alone would have waited it out.
TEST(SigtermTest, SecondSignalWhileDrainingExitsAtOnce) {
  PinGrpcCallbackQueue();
  Daemon daemon(ATTND_BINARY,
                {"--backend=cpu", "--kv-memory-bytes=67108864", "--listen-address=127.0.0.1:0",
                 "--metrics-address=", "--drain-grace=60s", "--exit-grace=2s"});
  ASSERT_GT(daemon.pid(), 0);
  const std::string serving =
      daemon.AwaitLog("serving attnd.v1.AttentionService on port ", absl::Seconds(30));
  ASSERT_FALSE(serving.empty()) << daemon.log();
  int port = 0;
  const size_t at = serving.find("on port ") + 8;
  ASSERT_TRUE(absl::SimpleAtoi(serving.substr(at, serving.find(' ', at) - at), &port)) << serving;
  client::ClientOptions options;
  options.address = absl::StrCat("127.0.0.1:", port);
  options.timeout = absl::Seconds(10);
  ASSERT_OK_AND_ASSIGN(auto client, client::Client::Connect(options));
  ASSERT_OK(client->CreateCache("held", SmallConfig(64)).status());
  // A step planned and never ended keeps the drain waiting.
  ASSERT_OK_AND_ASSIGN(auto step, client->BeginStep(MakePlan("held", {{1, 3}})));

  daemon.Signal(SIGTERM);
  ASSERT_FALSE(daemon.AwaitLog("draining: waiting up to 1m", absl::Seconds(10)).empty())
      << daemon.log();
  const absl::Time second = absl::Now();
  daemon.Signal(SIGTERM);
  EXPECT_EQ(daemon.Wait(absl::Seconds(10)), 1) << daemon.log();
  EXPECT_LT(absl::Now() - second, absl::Seconds(3));
  EXPECT_NE(daemon.log().find("again while shutting down"), std::string::npos) << daemon.log();
  step.reset();  // its abort fails against the daemon that is gone; the test only needs it gone
}

}  // namespace
}  // namespace attnd::integration
