// Bounds how long attnd takes to go once it is told to (issue 18: a daemon that did not exit
// after SIGTERM held a GPU regression run until the device call was killed, with no clue why).
// A thread of its own takes SIGTERM and SIGINT (blocked in every thread) while the main thread
// cannot:
//   starting       a signal exits at once (there is nothing to drain yet, and Server::Start
//                  might never return);
//   serving        the thread leaves the signals to the main thread's sigwait;
//   shutting down  a second signal exits at once, and when the shutdown has not finished
//                  within its limit the process logs that it hung, and in which phase, and exits.
// Exits are _exit(1), after the log line.
#pragma once

#include <condition_variable>
#include <mutex>
#include <string>
#include <thread>

#include "absl/time/time.h"

namespace attnd {

class ExitWatchdog {
 public:
  // Call with SIGTERM and SIGINT already blocked in the calling thread. Starts in "starting".
  ExitWatchdog();
  ~ExitWatchdog();  // Done()
  ExitWatchdog(const ExitWatchdog&) = delete;
  ExitWatchdog& operator=(const ExitWatchdog&) = delete;

  void Serving();
  // The first signal came: the shutdown must be over within `limit` from now.
  void ShuttingDown(absl::Duration limit);
  // Named in the log line when the shutdown hangs.
  void Phase(std::string phase);
  // The shutdown finished: the thread stops, and SIGTERM/SIGINT are unblocked in the calling
  // thread (the main one), so that one arriving during the process's exit ends it.
  void Done();

 private:
  enum class State { kStarting, kServing, kShuttingDown, kDone };
  void Loop();

  std::mutex mu_;
  std::condition_variable changed_;
  State state_ = State::kStarting;  // guarded by mu_
  absl::Time deadline_;             // guarded by mu_
  absl::Duration limit_;            // guarded by mu_
  std::string phase_;               // guarded by mu_
  std::thread thread_;
};

}  // namespace attnd
