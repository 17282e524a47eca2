// The built attnd binary with --token_file: SIGHUP reloads the tokens in the running daemon,
// and SIGTERM still drains and exits 0 afterwards.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <signal.h>
#include <unistd.h>

#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "attnd/client/client.h"
#include "daemon_process.h"
#include "status_matchers.h"
#include "test_server.h"
#include "test_pki.h"

#ifndef ATTND_BINARY
#error "ATTND_BINARY: the path of the attnd executable"
#endif

namespace attnd::integration {
namespace {

using Code = absl::StatusCode;

std::unique_ptr<client::Client> ClientWithToken(int port, const std::string& token) {
  client::ClientOptions options;
  options.address = absl::StrCat("127.0.0.1:", port);
  options.timeout = absl::Seconds(10);
  options.bearer_token = token;
  auto made = client::Client::Connect(options);
  EXPECT_TRUE(made.ok()) << made.status();
  return made.ok() ? *std::move(made) : nullptr;
}

TEST(SighupTest, ReloadsTheTokenFileInTheRunningDaemon) {
  PinGrpcCallbackQueue();
  const std::string token_file = WriteTempFile("sighup-tokens.txt", "old old-token-0123456789\n");
  Daemon daemon(ATTND_BINARY,
                {"--backend=cpu", "--kv-memory-bytes=16777216", "--listen-address=127.0.0.1:0",
                 "--metrics-address=", "--drain-grace=200ms", "--exit-grace=500ms",
                 absl::StrCat("--token-file=", token_file)});
  ASSERT_GT(daemon.pid(), 0);
  const std::string serving = daemon.AwaitLog("serving attnd.v1.AttentionService on port ",
                                              absl::Seconds(30));
  ASSERT_FALSE(serving.empty()) << daemon.log();
  int port = 0;
  const size_t at = serving.find("on port ") + 8;
  ASSERT_TRUE(absl::SimpleAtoi(serving.substr(at, serving.find(' ', at) - at), &port)) << serving;

  auto old_client = ClientWithToken(port, "old-token-0123456789");
  auto new_client = ClientWithToken(port, "new-token-0123456789");
  EXPECT_OK(old_client->ListCaches());
  EXPECT_ERROR(new_client->ListCaches(), Code::kUnauthenticated, "authorization");

  WriteTempFile("sighup-tokens.txt", "new new-token-0123456789\n");
  daemon.Signal(SIGHUP);
  ASSERT_FALSE(daemon.AwaitLog("reloaded", absl::Seconds(10)).empty()) << daemon.log();
  EXPECT_OK(new_client->ListCaches());
  EXPECT_ERROR(old_client->ListCaches(), Code::kUnauthenticated, "authorization");

  // A broken file is logged and changes nothing; the daemon keeps serving.
  WriteTempFile("sighup-tokens.txt", "new\n");
  daemon.Signal(SIGHUP);
  ASSERT_FALSE(daemon.AwaitLog("not reloaded", absl::Seconds(10)).empty()) << daemon.log();
  EXPECT_OK(new_client->ListCaches());

  daemon.Signal(SIGTERM);
  EXPECT_EQ(daemon.Wait(absl::Seconds(20)), 0) << daemon.log();
}

}  // namespace
}  // namespace attnd::integration
