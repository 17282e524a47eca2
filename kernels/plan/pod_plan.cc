#include "plan/pod_plan.h"

#include <algorithm>
#include <cinttypes>
#include <climits>
#include <cstdio>

namespace attnd::plan {
namespace {

int32_t FindLaunch(const PrefillPlan& plan, int32_t tile_rows) {
  for (size_t i = 0; i < plan.launches.size(); ++i) {
    if (plan.launches[i].tile_rows == tile_rows) return static_cast<int32_t>(i);
  }
  return -1;
}

// The prefill role: the largest tile above 16 rows among the launches (launches come largest
// first), or -1.
int32_t LargestTileLaunch(const PrefillPlan& plan) {
  int32_t best = -1;
  for (size_t i = 0; i < plan.launches.size(); ++i) {
    const int32_t rows = plan.launches[i].tile_rows;
    if (rows > 16 && (best < 0 || rows > plan.launches[best].tile_rows)) best = static_cast<int32_t>(i);
  }
  return best;
}

}  // namespace

int64_t PodPlan::PrefillRoleCtas() const {
  return fused() ? int64_t{prefill.launches[prefill_launch].num_items} * prefill.num_kv_heads : 0;
}

int64_t PodPlan::DecodeRoleCtas() const {
  return fused() ? int64_t{prefill.launches[decode_launch].num_items} * prefill.num_kv_heads : 0;
}

std::string PodPlan::DebugString() const {
  std::string out = prefill.DebugString();
  char line[160];
  if (fused()) {
    std::snprintf(line, sizeof line,
                  "  pod: prefill role launch %d (tile %d, %" PRId64 " CTAs) + decode role launch %d (%" PRId64
                  " CTAs), colocated %d\n",
                  prefill_launch, prefill_tile_rows(), PrefillRoleCtas(), decode_launch, DecodeRoleCtas(),
                  num_colocated_ctas);
  } else {
    std::snprintf(line, sizeof line, "  pod: not fused\n");
  }
  out += line;
  return out;
}

absl::StatusOr<PodPlan> PlanPod(PrefillPlanInput input, const PodWaveSizes& pod_waves) {
  input.kernel = PrefillKernel::kMmaSync;
  input.ctas_per_wave.hopper_tile128 = 0;
  input.num_colocated_ctas = 0;
  auto first = PlanPrefill(input);
  if (!first.ok()) return first.status();
  PodPlan pod;
  const int32_t decode_launch = FindLaunch(*first, 16);
  const int32_t prefill_launch = LargestTileLaunch(*first);
  if (decode_launch < 0 || prefill_launch < 0) {
    pod.prefill = *std::move(first);
    return pod;
  }
  if (input.deterministic) {
    // A request's chunk follows from the request and the separate kernels' waves alone, so its
    // bits are those of the separate mma.sync launches, fused or not, whatever shares the batch.
    pod.prefill = *std::move(first);
    pod.decode_launch = decode_launch;
    pod.prefill_launch = prefill_launch;
    return pod;
  }
  // The fused kernel's own residency sets the prefill role's wave; every other tile keeps its
  // wave, so the launches outside the fusion come out as in the first plan.
  const int32_t role_rows = first->launches[prefill_launch].tile_rows;
  const int32_t role_wave = role_rows == 128 ? pod_waves.tile128 : pod_waves.tile64;
  if (role_wave > 0) (role_rows == 128 ? input.ctas_per_wave.tile128 : input.ctas_per_wave.tile64) = role_wave;
  // The decode role's CTAs share the prefill role's wave. Only the largest tile's split reads
  // num_colocated_ctas, so the 16-row launch (and its CTA count) is the same in both plans.
  input.num_colocated_ctas = static_cast<int32_t>(
      std::min<int64_t>(INT32_MAX, int64_t{first->launches[decode_launch].num_items} * input.num_kv_heads));
  auto second = PlanPrefill(input);
  if (!second.ok()) return second.status();
  pod.prefill = *std::move(second);
  pod.decode_launch = FindLaunch(pod.prefill, 16);
  pod.prefill_launch = LargestTileLaunch(pod.prefill);
  pod.num_colocated_ctas = input.num_colocated_ctas;
  if (pod.decode_launch < 0 || pod.prefill_launch < 0) {
    return absl::InternalError("POD plan lost a role between its two passes");
  }
  return pod;
}

}  // namespace attnd::plan
