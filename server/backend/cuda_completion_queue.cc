#include "backend/cuda_completion_queue.h"

#include <utility>

namespace attnd::cuda_backend {

CompletionQueue::CompletionQueue(std::function<void()> on_start)
    : shared_(std::make_shared<Shared>()),
      thread_(&CompletionQueue::Loop, shared_, std::move(on_start)) {}

void CompletionQueue::Post(std::function<void()> task) {
  {
    std::lock_guard lock(shared_->mu);
    shared_->tasks.push_back(std::move(task));
  }
  shared_->ready.notify_one();
}

void CompletionQueue::Shutdown() {
  if (!thread_.joinable()) return;
  {
    std::lock_guard lock(shared_->mu);
    shared_->stopping = true;
  }
  shared_->ready.notify_one();
  if (thread_.get_id() == std::this_thread::get_id()) {
    thread_.detach();
  } else {
    thread_.join();
  }
}

void CompletionQueue::Loop(std::shared_ptr<Shared> shared, std::function<void()> on_start) {
  if (on_start) on_start();
  // Tasks are taken in batches by swapping vectors, so both keep their capacity.
  std::vector<std::function<void()>> batch;
  for (;;) {
    {
      std::unique_lock lock(shared->mu);
      shared->ready.wait(lock, [&] { return shared->stopping || !shared->tasks.empty(); });
      if (shared->tasks.empty()) return;  // stopping, and every posted task has run
      batch.swap(shared->tasks);
    }
    for (std::function<void()>& task : batch) {
      task();
      // Destroying the task may destroy this queue's owner (see the header): touch only
      // `shared` and `batch`.
      task = nullptr;
    }
    batch.clear();
  }
}

}  // namespace attnd::cuda_backend
