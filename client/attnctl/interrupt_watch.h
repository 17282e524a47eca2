// SIGINT and SIGTERM during a long command (attnctl bench): the first asks the command to stop
// (it cancels what is in flight and reports what it measured), a second exits at once with
// 128 + the signal's number.
//
// The signals are blocked in the constructing thread and so in every thread it starts later
// (gRPC's included: construct the watch before the first channel), and taken by the watch's
// own thread with sigtimedwait; no handler runs in signal context.
#pragma once

#include <atomic>
#include <functional>
#include <mutex>
#include <thread>

namespace attnd::attnctl {

class InterruptWatch {
 public:
  InterruptWatch();
  // Stops watching and unblocks the signals in the calling thread (the one that constructed
  // the watch): a signal from then on ends the process.
  ~InterruptWatch();
  InterruptWatch(const InterruptWatch&) = delete;
  InterruptWatch& operator=(const InterruptWatch&) = delete;

  // The first signal taken (SIGINT or SIGTERM), 0 while none came.
  int signal() const { return signal_.load(); }
  // Runs `handler` on the watch's thread at the first signal, or here and now when it already
  // came. Set it to nullptr before what it refers to goes away.
  void OnInterrupt(std::function<void()> handler);

 private:
  void Loop();

  std::atomic<int> signal_{0};
  std::atomic<bool> stopping_{false};
  std::mutex mu_;
  std::function<void()> handler_;  // guarded by mu_
  std::thread thread_;
};

// The exit code of a command stopped by `signal`: 128 + its number, as a shell reports it.
inline int InterruptedExitCode(int signal) { return 128 + signal; }

}  // namespace attnd::attnctl
