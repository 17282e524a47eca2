// Host planning of batch prefill (DESIGN 4.3-4.4): which CTAs run, with which query tile, over
// which keys. Plain C++, built once per step and reused for every layer; a plan is data that can
// be printed and tested.
//
// Query rows are packed (token, head-in-group): a request with q_len tokens and GQA group size g
// has q_len * g packed rows per KV head, so the MMA's 16-row M dimension fills even for a few
// tokens. Each request gets its own query tile (16, 64 or 128 packed rows) from its own length,
// never from batch averages, so a request's reduction order, and with it its output bits, does
// not depend on the rest of the batch.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace attnd::plan {

struct PrefillPlanInput {
  std::span<const int32_t> qo_indptr;   // [batch_size + 1] query rows of each request (host)
  std::span<const int32_t> kv_lengths;  // [batch_size] keys of each request, this step's included
  int32_t num_qo_heads = 0;
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;  // 64, 128 or 256
  bool causal = true;
};

// One CTA's work per KV head, in the layout the kernel loads (16 bytes).
struct PrefillWorkItem {
  int32_t request = 0;
  int32_t packed_row_start = 0;
  int32_t kv_chunk_start = 0;  // keys [kv_chunk_start, kv_chunk_end)
  int32_t kv_chunk_end = 0;
};

// One kernel launch: every item of one query tile size.
struct PrefillLaunch {
  int32_t tile_rows = 0;   // packed query rows per CTA
  int32_t first_item = 0;  // into PrefillPlan::items
  int32_t num_items = 0;   // CTAs = num_items * num_kv_heads
};

struct PrefillPlan {
  int32_t batch_size = 0;
  int32_t num_qo_heads = 0;
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;
  int64_t num_qo_rows = 0;  // qo_indptr[batch_size]
  std::vector<PrefillLaunch> launches;
  std::vector<PrefillWorkItem> items;  // launch after launch, heaviest first within a launch

  int64_t NumCtas() const;
  std::string DebugString() const;
};

// Packed query rows per CTA for a request with `packed_rows` = q_len * group rows: the smallest
// tile that is not mostly padding. head_dim 256 stops at 64 (registers).
int32_t PrefillQueryTileRows(int64_t packed_rows, int32_t head_dim);

// Plans one whole-KV CTA per (request, query tile, KV head). Requests with no query rows
// (padding slots) get no CTA.
absl::StatusOr<PrefillPlan> PlanPrefill(const PrefillPlanInput& input);

}  // namespace attnd::plan
