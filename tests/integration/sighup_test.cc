// The built attnd binary with --token_file: SIGHUP reloads the tokens in the running daemon,
// and SIGTERM still drains and exits 0 afterwards.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "attnd/client/client.h"
#include "status_matchers.h"
#include "test_pki.h"

#ifndef ATTND_BINARY
#error "ATTND_BINARY: the path of the attnd executable"
#endif

namespace attnd::integration {
namespace {

using Code = absl::StatusCode;

// attnd as a child process, its stderr read through a pipe.
class Daemon {
 public:
  explicit Daemon(const std::vector<std::string>& flags) {
    // Built before fork: the child of a threaded process may only make async-signal-safe calls.
    std::vector<std::string> args = {ATTND_BINARY};
    args.insert(args.end(), flags.begin(), flags.end());
    std::vector<char*> argv;
    for (std::string& arg : args) argv.push_back(arg.data());
    argv.push_back(nullptr);
    int fds[2];
    if (pipe(fds) != 0) return;
    pid_ = fork();
    if (pid_ == 0) {
      dup2(fds[1], STDERR_FILENO);
      close(fds[0]);
      close(fds[1]);
      execv(argv[0], argv.data());
      _exit(127);
    }
    close(fds[1]);
    stderr_fd_ = fds[0];
  }

  ~Daemon() {
    if (pid_ > 0 && !reaped_) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
    if (stderr_fd_ >= 0) close(stderr_fd_);
  }

  // Reads the log until a line contains `text`; returns that line ("" on timeout or exit).
  std::string AwaitLog(const std::string& text, absl::Duration timeout) {
    const absl::Time deadline = absl::Now() + timeout;
    while (absl::Now() < deadline) {
      for (size_t end; (end = log_.find('\n', scanned_)) != std::string::npos;) {
        std::string line = log_.substr(scanned_, end - scanned_);
        scanned_ = end + 1;
        if (line.find(text) != std::string::npos) return line;
      }
      pollfd fd{stderr_fd_, POLLIN, 0};
      if (poll(&fd, 1, 100) > 0) {
        char buffer[4096];
        const ssize_t n = read(stderr_fd_, buffer, sizeof(buffer));
        if (n <= 0) return "";
        log_.append(buffer, static_cast<size_t>(n));
      }
    }
    return "";
  }

  void Signal(int signal_number) { kill(pid_, signal_number); }

  // Waits for the exit; its status code, or -1.
  int Wait(absl::Duration timeout) {
    const absl::Time deadline = absl::Now() + timeout;
    while (absl::Now() < deadline) {
      int status = 0;
      if (waitpid(pid_, &status, WNOHANG) == pid_) {
        reaped_ = true;
        return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
      }
      AwaitLog("\x01", absl::Milliseconds(50));  // keep draining the pipe
    }
    return -1;
  }

  pid_t pid() const { return pid_; }
  const std::string& log() const { return log_; }

 private:
  pid_t pid_ = -1;
  int stderr_fd_ = -1;
  bool reaped_ = false;
  std::string log_;
  size_t scanned_ = 0;
};

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
  const std::string token_file = WriteTempFile("sighup-tokens.txt", "old old-token-0123456789\n");
  Daemon daemon({"--backend=cpu", "--kv-memory-bytes=16777216", "--listen-address=127.0.0.1:0",
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
