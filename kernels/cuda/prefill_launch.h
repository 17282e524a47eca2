// The steps of BatchPrefill (prefill.cc), for launchers that run a prefill plan's launches in
// another grid (POD, pod.cc): resolve the kernel parameters once, launch one planned launch,
// merge the split requests' partials once every launch has written them. Private to kernels/cuda.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "attnd/kernels/cuda/prefill.h"
#include "prefill_params.h"

namespace attnd::cuda::prefill {

// Validates args against the plan and the workspace size, and fills the parameters every
// launch of the plan shares; items points at the whole uploaded work list.
absl::StatusOr<KernelParams> ResolveKernelParams(const plan::PrefillPlan& plan, const BatchPrefillArgs& args,
                                                 void* workspace, int64_t workspace_bytes);

// Launches `launch` of `plan` (its kernel, tile and items) with `params` from ResolveKernelParams;
// with `tail`, only a Hopper launch's second grid (BatchPrefillArgs::tail_ctas).
absl::Status LaunchPlanned(const plan::PrefillPlan& plan, const plan::PrefillLaunch& launch, KernelParams params,
                           const BatchPrefillArgs& args, cudaStream_t stream, bool tail = false);

// MergeStates over the plan's partials (nothing when the plan does not split KV).
absl::Status MergePlannedPartials(const plan::PrefillPlan& plan, const BatchPrefillArgs& args, void* workspace,
                                  cudaStream_t stream);

}  // namespace attnd::cuda::prefill
