#include "interrupt_watch.h"

#include <signal.h>
#include <string.h>
#include <unistd.h>

#include <cstdio>
#include <string>

namespace attnd::attnctl {
namespace {

sigset_t Watched() {
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  return signals;
}

// Straight to the file descriptor: stdio may be locked by a thread in the middle of a line.
void Say(const std::string& line) {
  const ssize_t written = write(STDERR_FILENO, line.data(), line.size());
  (void)written;
}

}  // namespace

InterruptWatch::InterruptWatch() {
  const sigset_t signals = Watched();
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  thread_ = std::thread([this] { Loop(); });
}

InterruptWatch::~InterruptWatch() {
  stopping_.store(true);
  thread_.join();
  // From here a signal has its default effect again (the process ends), so that nothing after
  // the command (gRPC's teardown at exit) can outlast a SIGTERM.
  const sigset_t signals = Watched();
  pthread_sigmask(SIG_UNBLOCK, &signals, nullptr);
}

void InterruptWatch::OnInterrupt(std::function<void()> handler) {
  std::unique_lock lock(mu_);
  handler_ = std::move(handler);
  if (signal_.load() != 0 && handler_) {
    std::function<void()> run = handler_;
    lock.unlock();
    run();
  }
}

void InterruptWatch::Loop() {
  const sigset_t signals = Watched();
  // Polled, so that the destructor need not signal the thread to stop it.
  const timespec period{0, 100 * 1000 * 1000};
  while (!stopping_.load()) {
    const int taken = sigtimedwait(&signals, nullptr, &period);
    if (taken <= 0) continue;
    if (signal_.load() != 0) {
      Say(std::string("attnctl: ") + strsignal(taken) + " again: exiting now\n");
      _exit(InterruptedExitCode(signal_.load()));
    }
    signal_.store(taken);
    Say(std::string("attnctl: ") + strsignal(taken) +
        ": stopping (cancelling what is in flight); send it again to exit at once\n");
    // Under the lock, so that OnInterrupt(nullptr) returns only once the handler is done with
    // what it refers to.
    std::lock_guard lock(mu_);
    if (handler_) handler_();
  }
}

}  // namespace attnd::attnctl
