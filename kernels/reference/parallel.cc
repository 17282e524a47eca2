#include "reference/parallel.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__linux__)
#include <sched.h>
#endif

namespace attnd::reference {
namespace {

// One ParallelFor call. Threads claim indices from `next` until it passes num_tasks; the caller
// waits for `finished` to reach num_tasks.
struct Job {
  const std::function<void(int64_t)>* task = nullptr;
  int64_t num_tasks = 0;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> finished{0};
  std::mutex mutex;
  std::condition_variable all_finished;

  // Runs claimed indices until none are left; returns how many this thread ran.
  void RunSome() {
    int64_t ran = 0;
    for (int64_t index = next.fetch_add(1); index < num_tasks; index = next.fetch_add(1)) {
      (*task)(index);
      ++ran;
    }
    if (ran > 0 && finished.fetch_add(ran) + ran == num_tasks) {
      std::lock_guard lock(mutex);
      all_finished.notify_all();
    }
  }
};

class ThreadPool {
 public:
  explicit ThreadPool(int num_workers) {
    for (int i = 0; i < num_workers; ++i) workers_.emplace_back([this] { WorkerLoop(); });
  }
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int parallelism() const { return static_cast<int>(workers_.size()) + 1; }

  void Run(int64_t num_tasks, const std::function<void(int64_t)>& task) {
    auto job = std::make_shared<Job>();
    job->task = &task;
    job->num_tasks = num_tasks;
    {
      std::lock_guard lock(mutex_);
      queue_.push_back(job);
    }
    work_available_.notify_all();
    job->RunSome();
    std::unique_lock lock(job->mutex);
    job->all_finished.wait(lock, [&] { return job->finished.load() == num_tasks; });
    // Workers may still hold the shared_ptr; they only touch `next` after this, never `task`.
  }

 private:
  void WorkerLoop() {
    for (;;) {
      std::shared_ptr<Job> job;
      {
        std::unique_lock lock(mutex_);
        work_available_.wait(lock, [&] { return !queue_.empty(); });
        job = queue_.front();
        // A job stays queued until its indices are all claimed, so idle workers join it.
        if (job->next.load() >= job->num_tasks) {
          queue_.pop_front();
          continue;
        }
      }
      job->RunSome();
      std::lock_guard lock(mutex_);
      if (!queue_.empty() && queue_.front() == job) queue_.pop_front();
    }
  }

  std::mutex mutex_;
  std::condition_variable work_available_;
  std::deque<std::shared_ptr<Job>> queue_;
  std::vector<std::thread> workers_;
};

// hardware_concurrency counts the machine's CPUs even when this process may only run on a few
// (taskset, a container's cpuset); more threads than usable CPUs only add context switches.
int UsableCpus() {
  int cpus = std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
#if defined(__linux__)
  cpu_set_t allowed;
  if (sched_getaffinity(0, sizeof allowed, &allowed) == 0) {
    cpus = std::min(cpus, std::max(1, CPU_COUNT(&allowed)));
  }
#endif
  return cpus;
}

ThreadPool& Pool() {
  // Never destroyed: workers block on the queue until the process exits, so no static
  // destructor can race a late ParallelFor.
  static ThreadPool* const pool = new ThreadPool(UsableCpus() - 1);
  return *pool;
}

}  // namespace

void ParallelFor(int64_t num_tasks, const std::function<void(int64_t)>& task) {
  if (num_tasks <= 0) return;
  if (num_tasks == 1 || Pool().parallelism() == 1) {
    for (int64_t i = 0; i < num_tasks; ++i) task(i);
    return;
  }
  Pool().Run(num_tasks, task);
}

int ParallelismLevel() { return Pool().parallelism(); }

}  // namespace attnd::reference
