// attnd as a child process, for the tests that signal the built binary (sighup_test.cc,
// sigterm_test.cc).
#ifndef ATTND_TESTS_INTEGRATION_DAEMON_PROCESS_H_
#define ATTND_TESTS_INTEGRATION_DAEMON_PROCESS_H_

#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace attnd::integration {

// attnd (or attnctl) as a child process, its stderr (and with `capture_stdout` its stdout too)
// read through a pipe. Killed (SIGKILL) on destruction unless it already exited.
class Daemon {
 public:
  Daemon(const std::string& binary, const std::vector<std::string>& flags,
         bool capture_stdout = false) {
    // Built before fork: the child of a threaded process may only make async-signal-safe calls.
    std::vector<std::string> args = {binary};
    args.insert(args.end(), flags.begin(), flags.end());
    std::vector<char*> argv;
    for (std::string& arg : args) argv.push_back(arg.data());
    argv.push_back(nullptr);
    int fds[2];
    if (pipe(fds) != 0) return;
    pid_ = fork();
    if (pid_ == 0) {
      dup2(fds[1], STDERR_FILENO);
      if (capture_stdout) dup2(fds[1], STDOUT_FILENO);
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

  // Whether the process has not exited yet (reaps it when it has; see exit_status).
  bool Running() {
    if (reaped_) return false;
    int status = 0;
    if (waitpid(pid_, &status, WNOHANG) != pid_) return true;
    reaped_ = true;
    exit_status_ = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    return false;
  }
  int exit_status() const { return exit_status_; }

  // Waits for the exit; returns the exit status, or -1 (timeout or killed by a signal).
  int Wait(absl::Duration timeout) {
    const absl::Time deadline = absl::Now() + timeout;
    while (absl::Now() < deadline) {
      if (!Running()) {
        AwaitLog("\x01", absl::Milliseconds(50));  // what it wrote last
        return exit_status_;
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
  int exit_status_ = -1;
  std::string log_;
  size_t scanned_ = 0;
};

}  // namespace attnd::integration

#endif  // ATTND_TESTS_INTEGRATION_DAEMON_PROCESS_H_
