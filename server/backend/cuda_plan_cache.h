// Kernel plans of recent step shapes, reused when a shape repeats (an orchestrator that keeps
// fixed batch shapes with padding entries, or micro-batches of equal lengths). A plan depends on
// the shape alone: each entry's query rows and key count, and the step's options; page ids only
// enter at plan::StepPlan::Fill. So the key is exactly those, and a hit skips the planners.
//
// Thread-safe; plans are shared and immutable.
#pragma once

#include <cstdint>
#include <list>
#include <memory>
#include <mutex>
#include <vector>

#include "absl/status/statusor.h"
#include "backend/backend.h"
#include "plan/step_plan.h"

namespace attnd::cuda_backend {

class PlanCache {
 public:
  explicit PlanCache(size_t capacity = 16) : capacity_(capacity) {}

  // The plan of `batch`, from the cache or built (plan::PlanStep) and cached.
  absl::StatusOr<std::shared_ptr<const plan::StepPlan>> Get(const StepBatch& batch,
                                                      const plan::StepPlanContext& context);

  int64_t hits() const;
  int64_t misses() const;

 private:
  struct Entry {
    uint64_t hash = 0;
    std::vector<int32_t> key;
    std::shared_ptr<const plan::StepPlan> plan;
  };

  const size_t capacity_;
  mutable std::mutex mu_;
  std::list<Entry> entries_;  // most recently used first
  int64_t hits_ = 0;
  int64_t misses_ = 0;
};

// The key of a batch's shape (exposed for tests): batch size, each entry's rows and keys, and
// every option the planners read.
void PlanKeyOf(const StepBatch& batch, int32_t page_size, std::vector<int32_t>& key);

}  // namespace attnd::cuda_backend
