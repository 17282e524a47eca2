#include "util/exit_watchdog.h"

#include <signal.h>
#include <string.h>
#include <unistd.h>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "util/log.h"

namespace attnd {
namespace {

sigset_t Watched() {
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  return signals;
}

}  // namespace

ExitWatchdog::ExitWatchdog() : thread_([this] { Loop(); }) {}

ExitWatchdog::~ExitWatchdog() { Done(); }

void ExitWatchdog::Serving() {
  std::lock_guard lock(mu_);
  state_ = State::kServing;
  changed_.notify_all();
}

void ExitWatchdog::ShuttingDown(absl::Duration limit) {
  std::lock_guard lock(mu_);
  state_ = State::kShuttingDown;
  limit_ = limit;
  deadline_ = absl::Now() + limit;
  changed_.notify_all();
}

void ExitWatchdog::Phase(std::string phase) {
  std::lock_guard lock(mu_);
  phase_ = std::move(phase);
}

void ExitWatchdog::Done() {
  {
    std::lock_guard lock(mu_);
    state_ = State::kDone;
    changed_.notify_all();
  }
  if (thread_.joinable()) thread_.join();
  // What is left (static destructors, gRPC's teardown at exit) must not outlast a SIGTERM: from
  // here a signal has its default effect in this thread.
  const sigset_t signals = Watched();
  pthread_sigmask(SIG_UNBLOCK, &signals, nullptr);
}

void ExitWatchdog::Loop() {
  const sigset_t signals = Watched();
  // Polled (100 ms), so that a state change needs no signal to reach the thread.
  const timespec period{0, 100 * 1000 * 1000};
  for (;;) {
    {
      std::unique_lock lock(mu_);
      changed_.wait(lock, [&] { return state_ != State::kServing; });
      if (state_ == State::kDone) return;
    }
    const int taken = sigtimedwait(&signals, nullptr, &period);
    std::unique_lock lock(mu_);
    if (state_ == State::kDone) return;
    if (taken > 0) {
      switch (state_) {
        case State::kServing:
          // Serving began while this thread waited: the main thread's sigwait takes it.
          kill(getpid(), taken);
          continue;
        case State::kStarting:
          LogError(absl::StrCat("received ", strsignal(taken), " while starting: exiting"));
          _exit(1);
        default:
          LogError(absl::StrCat("received ", strsignal(taken), " again while shutting down (",
                                phase_, "): exiting now"));
          _exit(1);
      }
    }
    if (state_ == State::kShuttingDown && absl::Now() > deadline_) {
      LogError(absl::StrCat("shutdown did not finish within ", absl::FormatDuration(limit_),
                            " (drain_grace + exit_grace + margin); stuck in: ", phase_,
                            "; exiting"));
      _exit(1);
    }
  }
}

}  // namespace attnd
