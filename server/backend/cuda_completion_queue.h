// A thread that runs tasks in the order they were posted: the CUDA backend posts, per layer,
// "wait for this layer's last event, copy its outputs out, report, call done". Tasks are posted
// in the order the layers were enqueued on the cache's stream, which is the order they finish,
// so waiting on the oldest first blocks on nothing that could have completed sooner.
//
// The queue's owner may be destroyed by a task (a task's `done` may drop the last reference to
// the cache that owns the queue). Shutdown() then detaches the thread, which exits when the
// task returns; state the thread still needs is shared with it.
#pragma once

#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace attnd::cuda_backend {

class CompletionQueue {
 public:
  // Starts the thread; `on_start` runs first on it (e.g. cudaSetDevice).
  explicit CompletionQueue(std::function<void()> on_start);
  CompletionQueue(const CompletionQueue&) = delete;
  CompletionQueue& operator=(const CompletionQueue&) = delete;
  ~CompletionQueue() { Shutdown(); }

  // Thread-safe. Tasks posted before Shutdown all run. A task of two pointers is stored
  // without allocating (std::function's local storage), and the queue's storage is reused, so
  // posting allocates nothing once the queue has grown to its working size.
  void Post(std::function<void()> task);
  // Runs the remaining tasks and stops the thread; joins it unless called from it.
  void Shutdown();

 private:
  struct Shared {
    std::mutex mu;
    std::condition_variable ready;
    std::vector<std::function<void()>> tasks;
    bool stopping = false;
  };
  static void Loop(std::shared_ptr<Shared> shared, std::function<void()> on_start);

  std::shared_ptr<Shared> shared_;
  std::thread thread_;
};

}  // namespace attnd::cuda_backend
