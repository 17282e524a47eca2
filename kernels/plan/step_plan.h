// The step-level kernel choice of the CUDA backend, built once at PrepareStep: which attention
// kernels run for which rows (over the planners of this directory), and the layout of the one
// buffer of int32 arrays (page table, COO append index, decode plan) that is uploaded once and
// read by every layer. Plain C++ (no CUDA calls): tests/unit/plan drives it without a GPU.
//
// Kernel choice:
// - decode-only steps (every entry 1 row or padding): BatchDecode, when a decode kernel exists
//   for the cache's dtypes, head_dim and GQA group; otherwise BatchPrefill. The decode planner
//   picks its CUDA-core or tensor-core kernel per step (plan::DecodePlanOptions).
// - steps with prefill rows: BatchPrefill for the entries of more than one row, and, when a
//   decode kernel exists, BatchDecode for the 1-row entries of the same step (launches on one
//   stream, each writing its own rows of o and lse). Where POD is not picked, this is the split
//   that keeps a decode request's kernel, and so its bits under deterministic=true, the same
//   whether or not prefill rows share its step. Without a decode kernel BatchPrefill runs
//   every row (it takes 1-row requests).
// - mixed steps that pod_choice.h picks (--pod=on, or auto by its measured rule; never
//   deterministic ones): one POD launch over every row (cuda::PodAttention), kernel "pod".
// - MLA caches: MlaDecode for every row (its units carry any number of query tokens per
//   request, causal among them), in one launch. Requests of at most kMlaSplitMaxQueryTokens rows
//   (decode, speculative decode) are planned with KV-split (oversubscription, one wave, pinned or
//   deterministic, as the options say); longer ones (prefill, chunked prefill) are never split:
//   their row tiles already fill the GPU, and the partials of q_len x chunks rows would need a
//   workspace that grows with the prompt. Either way a request's chunking depends on the request
//   alone, so deterministic=true holds.
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "attnd/kernels/cache_geometry.h"
#include "attnd/kernels/step_batch.h"
#include "plan/buffer_alignment.h"
#include "plan/decode_plan.h"
#include "plan/mla_plan.h"
#include "plan/pod_choice.h"
#include "plan/pod_plan.h"
#include "plan/prefill_plan.h"

namespace attnd::plan {

struct StepPlanContext {
  const CacheGeometry* geometry = nullptr;
  bool decode_supported = false;  // some decode kernel exists for the cache (either below)
  // The CUDA-core kernel (attnd::cuda::DecodeSupports, DecodeCtasPerWave) and the tensor-core
  // one (TensorCoreDecodeSupports, TensorCoreDecodeCtasPerWave); the decode planner picks
  // between them per step (plan::DecodePlanOptions).
  bool decode_cuda_core_supported = true;
  int32_t decode_ctas_per_wave = 0;
  bool decode_tensor_core_supported = false;
  int32_t decode_tensor_core_ctas_per_wave = 0;
  // CudaBackendOptions::decode_kernel (decode_choice.h), already reduced to a kernel the cache has.
  DecodeKernelChoice decode_kernel_choice = DecodeKernelChoice::kAuto;
  PrefillWaveSizes prefill_ctas_per_wave;  // attnd::cuda::BatchPrefillCtasPerWave
  int32_t mla_ctas_per_wave = 0;  // attnd::cuda::MlaDecodeCtasPerWave (MLA caches)
  PodMode pod_mode = PodMode::kOff;  // pod_choice.h: when a mixed step runs POD
  PodWaveSizes pod_ctas_per_wave;    // attnd::cuda::PodCtasPerWave
};

// MLA requests with more query rows than this are planned without KV-split (see above).
inline constexpr int32_t kMlaSplitMaxQueryTokens = 4;

// Byte offsets of the arrays inside the uploaded buffer; each kBufferAlignment-aligned.
struct StepArrayOffsets {
  int64_t qo_indptr = 0;            // [batch_size + 1]
  int64_t page_indptr = 0;          // [batch_size + 1]
  int64_t k_page_indices = 0;       // [num_pages]
  int64_t v_page_indices = 0;       // [num_pages]; == k_page_indices when SHARED
  int64_t last_page_len = 0;        // [batch_size]
  int64_t token_batch_indices = 0;  // [num_tokens]
  int64_t token_positions = 0;      // [num_tokens]
  int64_t decode_work = 0;          // DecodePlan::Pack()
  int64_t mla_work = 0;             // MlaPlan::Pack() (16-byte aligned units)
  int64_t total_bytes = 0;
};

struct StepPlan {
  bool run_decode = false;   // BatchDecode for the decode rows
  bool run_prefill = false;  // BatchPrefill for the prefill rows (or every row)
  DecodePlan decode;         // q rows are the step's rows (remapped when mixed)
  PrefillPlan prefill;
  bool run_mla = false;       // MlaDecode for every row (MLA caches)
  bool mla_has_prefill = false;  // some MLA request has more than one row
  MlaPlan mla;                // units' q rows are the step's rows
  // POD (pod_choice.h): a mixed step whose decode and prefill rows run in one fused launch
  // (cuda::PodAttention over `pod`; run_decode and run_prefill are then false).
  bool run_pod = false;
  PodPlan pod;
  // A mixed step whose prefill runs the Hopper kernel (SideBySidePrefillCtas): > 0 runs the
  // decode kernel and the prefill's launches side by side on two streams, the Hopper launches
  // persistent over this many CTAs (an SM each) so the decode keeps the rest of the GPU until
  // the prefill is done; the backend applies it where its lane has the second stream. The plan
  // itself (prefill.launches' grid_ctas) stays the one-after-the-other plan: a work item's bits
  // do not depend on the grid.
  int32_t side_by_side_prefill_ctas = 0;
  // With side_by_side_prefill_ctas: the rest of the wave, a second grid of the Hopper launches
  // that starts after the decode and takes the prefill's works still left then (works on demand,
  // cuda::BatchPrefillTail), so that the decode's SMs join the prefill once it is done.
  int32_t side_by_side_tail_ctas = 0;
  StepArrayOffsets offsets;

  // "none", "decode" or "prefill" (a step that runs both reports "prefill", its larger part);
  // "pod" for a fused mixed step;
  // MLA: "mla_decode", or "mla_prefill" when some request has more than one row (the names the
  // CPU backend reports).
  std::string_view KernelName() const;
  // Writes the arrays at their offsets into `buffer` (offsets.total_bytes bytes).
  void Fill(const StepBatch& batch, uint8_t* buffer) const;
};

absl::StatusOr<StepPlan> PlanStep(const StepBatch& batch, const StepPlanContext& context);

// Side by side (StepPlan::side_by_side_prefill_ctas), measured on an H100 with bench/pod_bench
// --split (docs/benchmarks.md, POD, 2026-11-28): the Hopper prefill (an SM per CTA, every
// register of it) cannot share an SM with decode CTAs, so the GPU is split by SMs. Giving the
// prefill ~55% of them won on all five reference cases at page sizes 1 and 16 (0.80-0.90 of
// the kernels one after the other; 24-40% of the SMs lost up to 1.45x): the decode is bound by
// HBM, not by its SMs, and takes the prefill's SMs once the prefill is done. Where the prefill,
// so restricted, would outlast the decode, the step runs one kernel after the other.
inline constexpr double kSideBySidePrefillShare = 0.55;
// The prefill is estimated at ~600 TFLOP/s and the decode at ~2.8 TB/s (H100): a prefill FLOP
// takes as long as 2.8 / 600 decode KV bytes. Side by side when the prefill's FLOPs <= 0.55 x
// 600 / 2.8 ~ 118 x the decode's KV bytes.
inline constexpr double kPrefillFlopsPerDecodeByte = 600.0 / 2.8;
inline constexpr double kSideBySideMaxFlopsPerByte = kSideBySidePrefillShare * kPrefillFlopsPerDecodeByte;
// Where that estimate puts under a fifth of the step's time in the prefill, it gets ~42.5% of the
// wave instead (56 of 132 SMs): measured on an H200 (pod_bench --split=56,73,88,100,112,
// docs/benchmarks.md, POD, 2026-11-28), 56 CTAs beat 73 by 2.6-6.5% where the decode was 3-4x
// the prefill (1x2048 + 128x2048 at page 16, 1x4096 + 128x8192), while 73 stayed best where the
// prefill was ~40% of the step; on the H100, 56-80 CTAs measured alike on every case.
inline constexpr double kSideBySideSmallPrefill = 0.2;
inline constexpr double kSideBySideSmallPrefillShare = 0.425;

// Persistent CTAs for the prefill of a mixed step side by side with its decode (0: run them one
// after the other): `hopper_wave` CTAs in a full wave; the rows and keys of its prefill
// (> 1 row) and decode (1 row) entries decide.
int32_t SideBySidePrefillCtas(const StepBatch& batch, const CacheGeometry& geometry,
                              int32_t hopper_wave);

// PlanPod over every entry of `batch` (decode rows become the 16-row decode role).
absl::StatusOr<PodPlan> PlanPodStep(const StepBatch& batch, const CacheGeometry& geometry,
                                    const PrefillWaveSizes& prefill_ctas_per_wave,
                                    const PodWaveSizes& pod_ctas_per_wave);

}  // namespace attnd::plan
