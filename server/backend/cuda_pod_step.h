// The POD side of a CUDA step's plan (cuda_step_plan.h): the shape the POD rule sees, and the
// POD plan of a mixed step over every row. Plain C++ (no CUDA calls).
#pragma once

#include "absl/status/statusor.h"
#include "backend/backend.h"
#include "backend/pod_choice.h"
#include "plan/pod_plan.h"
#include "plan/prefill_plan.h"

namespace attnd::cuda_backend {

// What the POD rule sees of `batch` on a cache of `page_size` whose separate prefill would run
// the Hopper kernel when `hopper_prefill`.
PodStepShape PodShapeOf(const StepBatch& batch, int32_t page_size, bool hopper_prefill);

// PlanPod over every entry of `batch` (decode rows become the 16-row decode role).
absl::StatusOr<plan::PodPlan> PlanPodStep(const StepBatch& batch, const CacheGeometry& geometry,
                                          const plan::PrefillWaveSizes& prefill_ctas_per_wave,
                                          const plan::PodWaveSizes& pod_ctas_per_wave);

}  // namespace attnd::cuda_backend
