// Split-KV planning of MLA decode (DESIGN 4.4, 4.6): which CTA computes which rows of which
// request over which keys, and how partial results merge. Built once per step on the host,
// uploaded once (Pack), read by every layer's MlaDecode launch (View). Plain data.
//
// Three ways to cut a batch's keys into chunks (one CTA per chunk and 64-row tile):
//  - one wave: the smallest chunk whose CTAs all fit in the grid the device runs at once (the
//    rule of batch decode, DESIGN 4.2). With many CTAs per request (128 heads = 2 row tiles) and
//    a few long requests, the wave is soon full and the longest request sets the kernel time.
//  - oversubscription: the chunk follows the longest sequence, ceil(max_len / min_tokens_per_cta)
//    splits (at most max_splits), every request cut with that chunk, the CTA count capped at
//    max_waves waves. Short requests simply get fewer chunks: their CTAs are never launched.
//    Longest chunks launch first, so the waves drain evenly.
//  - none: one chunk per request.
// kAuto picks the cheaper of the first two by a cost estimate (EstimatedCost below); within
// oversubscription the planner also tries min_tokens_per_cta x 2, x 4, ... (as many as
// oversubscribe_candidates) and keeps the cheapest chunk, since whole waves of equal CTAs
// finish together and a slightly larger chunk can save a round.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "plan/mla_work.h"

namespace attnd::plan {

enum class MlaSplitMode : int32_t {
  kAuto = 0,          // options only: the cheaper of kOversubscribe and kOneWave
  kOversubscribe = 1,
  kOneWave = 2,
  kNone = 3,
  kFixed = 4,         // plans only: chunk pinned (fixed_split_tokens or deterministic)
};

const char* MlaSplitModeName(MlaSplitMode mode);

// Chunk of deterministic MLA decode when the caller pins none: fixed in tokens, so a request's
// chunking (and its reduction order) depends on the request alone.
inline constexpr int32_t kMlaDeterministicChunkTokens = 2048;

struct MlaPlanOptions {
  int32_t num_heads = 0;      // query heads; a request has q_len * num_heads rows
  // CTAs of the MLA decode kernel the device runs at once (resident CTAs per SM x SMs), measured
  // by attnd::cuda::MlaDecodeCtasPerWave. Unused when the chunk is pinned.
  int32_t ctas_per_wave = 0;
  MlaSplitMode split_mode = MlaSplitMode::kAuto;
  // Oversubscription: the smallest chunk it cuts, the most chunks of one request, the most
  // waves of CTAs it launches (the chunk grows until the CTAs fit), and how many doublings of
  // min_tokens_per_cta it compares (1: the plain rule). Chosen from the H100 sweep
  // (docs/benchmarks.md, MLA; plain rule): max_waves 4 left batch 256 unsplit (39.8% of copy vs
  // 50.2% at 8), 16 cost 4-13% at batch 32-256; min_tokens_per_cta 1024 is within 8% of 2048
  // at batch 64-256, 4096 up to 9% slower there; searching the doublings gained 9-12% at batch
  // 32 (chunk 16384 instead of 2048).
  int32_t min_tokens_per_cta = 2048;
  int32_t max_splits = 128;
  int32_t max_waves = 8;
  int32_t oversubscribe_candidates = 4;
  // One wave: the smallest chunk it cuts.
  int32_t min_chunk_tokens = 256;
  // Cost model (EstimatedCost): a CTA's fixed cost (q tile load, output or partial store) in
  // key tokens, and the merge's cost per partial (token, head) row in key tokens of one CTA
  // slot. Fitted on an H100 (docs/benchmarks.md, MLA): the Hopper kernel streams a key per CTA
  // in ~49 ns and costs ~20 us besides (the mma.sync kernel: ~88 ns and ~16 us); the merge of
  // 486 x 128 partial rows took ~50 us. (That fit is of the kernel with one CTA per unit, not
  // of a launch's own cost: on an H200, 1052 such CTAs ran as fast as 254 units chained in a
  // persistent grid, docs/benchmarks.md, MLA, twenty-first session.)
  int32_t cta_overhead_tokens = 384;
  int32_t merge_tokens_per_partial_row = 1;
  int32_t fixed_split_tokens = 0;  // > 0 pins the chunk (tokens)
  bool deterministic = false;      // chunk fixed in tokens (fixed_split_tokens or the default)
  bool longest_first = true;       // launch order: longest chunks first (else request order)
};

struct MlaPlan {
  MlaSplitMode mode = MlaSplitMode::kNone;  // the scheme used
  int32_t kv_chunk_tokens = 0;              // 0 when the batch has no rows
  int32_t max_chunks = 0;                   // most chunks of one request
  // Cost estimates (units: key tokens of one CTA) of the scheme used, and of the two kAuto
  // compared (0 when not computed).
  int64_t estimated_cost = 0;
  int64_t oversubscribe_cost = 0;
  int64_t one_wave_cost = 0;
  std::vector<MlaWorkUnit> units;  // launch order
  std::vector<int32_t> merge_indptr{0};
  std::vector<int32_t> merge_q_row;
  int32_t num_partials = 0;

  int32_t num_units() const { return static_cast<int32_t>(units.size()); }
  int32_t num_merge_rows() const { return static_cast<int32_t>(merge_q_row.size()); }

  // Units (12 int32 each), then merge_indptr and merge_q_row, in one buffer for one upload.
  std::vector<int32_t> Pack() const;
  // Pointers into `packed`, a 16-byte aligned copy of Pack() (typically device memory).
  MlaWorkView View(const int32_t* packed) const;
  std::string DebugString() const;
};

// Plans an MLA decode batch. Request b has kv_lengths[b] keys (this step's tokens included) and
// qo_indptr[b + 1] - qo_indptr[b] query tokens (0: a padding slot, no work, no output).
// INVALID_ARGUMENT for decreasing qo_indptr, negative or too long lengths, or bad options.
absl::StatusOr<MlaPlan> PlanMlaDecode(std::span<const int32_t> qo_indptr,
                                      std::span<const int64_t> kv_lengths,
                                      const MlaPlanOptions& options);

// The cost model behind kAuto, in key tokens of one CTA: every CTA costs its keys plus
// cta_overhead_tokens; the CTAs, longest first, each start on the CTA slot (of ctas_per_wave)
// that frees first, and the estimate is the last slot's finish (so a wave that is only partly
// filled costs a whole chunk), plus merge_tokens_per_partial_row * partial rows / ctas_per_wave.
int64_t EstimatedCost(std::span<const int32_t> qo_indptr, std::span<const int64_t> kv_lengths,
                      int64_t chunk_tokens, const MlaPlanOptions& options);

}  // namespace attnd::plan
