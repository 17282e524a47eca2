// SIGINT/SIGTERM to `attnctl bench` (processes: attnd --backend=cpu and the attnctl binary): the
// first signal ends the run cleanly (the stream cancelled, what was measured printed, the cache
// deleted, exit code 128 + the signal), a second one exits at once.
#include <gtest/gtest.h>

#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "attnd/client/client.h"
#include "daemon_process.h"
#include "status_matchers.h"
#include "test_server.h"

#ifndef ATTND_BINARY
#error "ATTND_BINARY: the path of the attnd executable"
#endif
#ifndef ATTNCTL_BINARY
#error "ATTNCTL_BINARY: the path of the attnctl executable"
#endif

namespace attnd::integration {
namespace {

// The port a daemon logged that it serves on (0 when it did not within the timeout).
int ServingPort(Daemon& daemon) {
  const std::string serving =
      daemon.AwaitLog("serving attnd.v1.AttentionService on port ", absl::Seconds(30));
  int port = 0;
  if (serving.empty()) return 0;
  const size_t at = serving.find("on port ") + 8;
  if (!absl::SimpleAtoi(serving.substr(at, serving.find(' ', at) - at), &port)) return 0;
  return port;
}

struct SignalCase {
  const char* name;
  int signal_number;
  std::vector<std::string> bench_flags;
};

// ctest and gtest print the case by name, not as raw bytes that change between builds.
void PrintTo(const SignalCase& signal_case, std::ostream* out) { *out << signal_case.name; }

class AttnctlSignalTest : public ::testing::TestWithParam<SignalCase> {};

TEST_P(AttnctlSignalTest, FirstSignalCancelsPrintsWhatWasMeasuredAndExits) {
  PinGrpcCallbackQueue();
  Daemon daemon(ATTND_BINARY, {"--backend=cpu", "--kv-memory-bytes=67108864",
                               "--listen-address=127.0.0.1:0", "--metrics-address=",
                               "--drain-grace=5s", "--exit-grace=2s"});
  ASSERT_GT(daemon.pid(), 0);
  const int port = ServingPort(daemon);
  ASSERT_GT(port, 0) << daemon.log();
  const std::string server = absl::StrCat("127.0.0.1:", port);

  // Many more steps than the test waits for: only the signal ends this run.
  std::vector<std::string> flags = {
      absl::StrCat("--server=", server), "bench", "--sequences=4", "--layers=2",
      "--qo_heads=2", "--kv_heads=1", "--head_dim=64", "--page_size=16", "--prompt_tokens=8",
      "--warmup_steps=1", "--steps=1000000", "--num_pages=1024"};
  flags.insert(flags.end(), GetParam().bench_flags.begin(), GetParam().bench_flags.end());
  Daemon bench(ATTNCTL_BINARY, flags, /*capture_stdout=*/true);
  ASSERT_GT(bench.pid(), 0);

  // Signal once timed steps have committed on the daemon.
  client::ClientOptions options;
  options.address = server;
  options.timeout = absl::Seconds(10);
  ASSERT_OK_AND_ASSIGN(auto client, client::Client::Connect(options));
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  int64_t committed = 0;
  while (committed < 20 && absl::Now() < deadline && bench.Running()) {
    auto stats = client->GetStats();
    if (stats.ok()) committed = stats->steps_committed();
    absl::SleepFor(absl::Milliseconds(20));
  }
  ASSERT_GE(committed, 20) << bench.log();
  ASSERT_TRUE(bench.Running()) << bench.log();

  const absl::Time signalled = absl::Now();
  bench.Signal(GetParam().signal_number);
  const int exit_code = bench.Wait(absl::Seconds(10));
  EXPECT_EQ(exit_code, 128 + GetParam().signal_number) << bench.log();
  EXPECT_LT(absl::Now() - signalled, absl::Seconds(5));
  EXPECT_NE(bench.log().find("stopping (cancelling what is in flight)"), std::string::npos)
      << bench.log();
  EXPECT_NE(bench.log().find("interrupted by"), std::string::npos) << bench.log();
  const size_t result = bench.log().find("\nRESULT ");
  ASSERT_NE(result, std::string::npos) << bench.log();
  const std::string line = bench.log().substr(result + 1, bench.log().find('\n', result + 1));
  EXPECT_NE(line.find(" errors=0 interrupted=1"), std::string::npos) << line;
  EXPECT_EQ(line.find(" steps=0 "), std::string::npos) << line;

  // The bench cleaned up after itself: no cache left, no step left open.
  ASSERT_OK_AND_ASSIGN(auto caches, client->ListCaches());
  EXPECT_TRUE(caches.empty());
  daemon.Signal(SIGTERM);
  EXPECT_EQ(daemon.Wait(absl::Seconds(15)), 0) << daemon.log();
}

INSTANTIATE_TEST_SUITE_P(
    Bench, AttnctlSignalTest,
    ::testing::Values(SignalCase{"SigintStreamMicroBatches", SIGINT,
                                 {"--stream", "--micro_batches=2", "--window=2"}},
                      SignalCase{"SigtermUnary", SIGTERM, {}}),
    [](const ::testing::TestParamInfo<SignalCase>& info) { return std::string(info.param.name); });

// A server that accepts connections and never answers: the bench's first call waits (its
// --timeout is long), the first signal cannot end a unary call, the second exits at once.
TEST(AttnctlInterruptTest, SecondSignalExitsAtOnce) {
  const int listener = socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(listener, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  address.sin_port = 0;
  ASSERT_EQ(bind(listener, reinterpret_cast<sockaddr*>(&address), sizeof(address)), 0);
  ASSERT_EQ(listen(listener, 16), 0);  // connections complete in the backlog, never accepted
  socklen_t length = sizeof(address);
  ASSERT_EQ(getsockname(listener, reinterpret_cast<sockaddr*>(&address), &length), 0);
  const int port = ntohs(address.sin_port);

  Daemon bench(ATTNCTL_BINARY,
               {absl::StrCat("--server=127.0.0.1:", port), "--timeout=120s", "bench",
                "--sequences=2", "--layers=1", "--steps=10"},
               /*capture_stdout=*/true);
  ASSERT_GT(bench.pid(), 0);
  // Into its first call: its connection waits in the listener's backlog (the listener turns
  // readable), which it opens only after its signal watch is up. A fixed wait raced a slow start
  // (under ASan on a loaded machine the default SIGTERM ended the bench before it watched).
  pollfd pending{listener, POLLIN, 0};
  ASSERT_EQ(poll(&pending, 1, /*timeout_ms=*/30000), 1) << "the bench never connected: " << bench.log();
  absl::SleepFor(absl::Milliseconds(100));
  ASSERT_TRUE(bench.Running()) << bench.log();
  bench.Signal(SIGTERM);
  ASSERT_FALSE(bench.AwaitLog("stopping (cancelling what is in flight)", absl::Seconds(5)).empty())
      << bench.log();
  ASSERT_TRUE(bench.Running()) << bench.log();
  const absl::Time second = absl::Now();
  bench.Signal(SIGTERM);
  EXPECT_EQ(bench.Wait(absl::Seconds(5)), 128 + SIGTERM) << bench.log();
  EXPECT_LT(absl::Now() - second, absl::Seconds(2));
  EXPECT_NE(bench.log().find("again: exiting now"), std::string::npos) << bench.log();
  close(listener);
}

}  // namespace
}  // namespace attnd::integration
