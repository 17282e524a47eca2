// A small persistent thread pool shared by every reference op, so that the CPU backend uses all
// cores without spawning threads per call.
#pragma once

#include <cstdint>
#include <functional>

namespace attnd::reference {

// Runs task(i) for every i in [0, num_tasks), spread over the shared pool, and returns when all
// have finished. The calling thread works too, so calls may come from several threads at once
// and from inside a task without deadlock. Tasks must not throw. Which thread runs which index
// is unspecified: results must not depend on it.
void ParallelFor(int64_t num_tasks, const std::function<void(int64_t)>& task);

// Threads that ParallelFor can use at once, the caller included: hardware_concurrency, or
// fewer when the process's CPU affinity allows fewer (>= 1).
int ParallelismLevel();

}  // namespace attnd::reference
