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

// Which kernel runs a launch. kMmaSync: the mma.sync kernel (every config, tiles 16/64/128).
// kHopper: the sm_90a wgmma kernel (128-row tiles; q and KV of one 16-bit type, head_dim 64 or
// 128). kAuto (input only): Hopper for the requests whose own tile is 128 rows when the device
// and dtypes have it (PrefillWaveSizes::hopper_tile128 > 0), mma.sync otherwise.
enum class PrefillKernel : int32_t { kAuto = 0, kMmaSync = 1, kHopper = 2 };

const char* PrefillKernelName(PrefillKernel kernel);

// CTAs the device runs at once (resident CTAs per SM x SMs) for each query tile size, and its
// SM count, measured by the launcher (cuda::BatchPrefillCtasPerWave). Zero never splits.
// hopper_tile128: the same for the Hopper kernel; 0 when the device or dtypes lack it.
struct PrefillWaveSizes {
  int32_t tile16 = 0;
  int32_t tile64 = 0;
  int32_t tile128 = 0;
  int32_t num_sms = 0;
  int32_t hopper_tile128 = 0;

  int32_t ForTile(int32_t tile_rows) const {
    return tile_rows == 16 ? tile16 : (tile_rows == 64 ? tile64 : tile128);
  }
};

struct PrefillPlanInput {
  std::span<const int32_t> qo_indptr;   // [batch_size + 1] query rows of each request (host)
  std::span<const int32_t> kv_lengths;  // [batch_size] keys of each request, this step's included
  int32_t num_qo_heads = 0;
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;  // 64, 128 or 256
  bool causal = true;
  // Split-KV (DESIGN 4.3-4.4): when a launch's CTAs leave at least half the SMs idle (at
  // q = kv = 512, 128 CTAs on 132 SMs, splitting measured 30% slower), each request's keys
  // are cut into chunks of equal token count, computed by separate CTAs into fp32 partials and
  // merged per row in chunk order. deterministic: a request's chunk size follows from that
  // request alone (its own CTAs against the wave), so its bits never depend on the batch.
  PrefillWaveSizes ctas_per_wave;
  bool deterministic = false;
  bool disable_split_kv = false;
  int32_t fixed_split_tokens = 0;   // > 0 pins the chunk size (rounded up to 64 tokens)
  int32_t min_chunk_tokens = 256;   // floor: shorter chunks cost more to merge than they gain
  // POD (DESIGN 4.5, pod_plan.h): CTAs of another launch that share the wave with this plan's
  // largest query tile (above 16 rows), e.g. the decode CTAs fused into its grid. That tile's
  // split then fills only the rest of the wave (none left, clamped at zero: no split). Ignored
  // when deterministic or with a fixed split (a request's chunk follows from the request alone).
  int32_t num_colocated_ctas = 0;
  // kAuto in production. kMmaSync / kHopper force every request onto one kernel (tests,
  // benchmarks); kHopper then runs even short requests in 128-row tiles, and needs
  // ctas_per_wave.hopper_tile128 > 0 (any head_dim: 64, 128 and 256).
  PrefillKernel kernel = PrefillKernel::kAuto;
};

// One CTA's work per KV head, in the layout the kernel loads (32 bytes).
struct PrefillWorkItem {
  int32_t request = 0;
  int32_t packed_row_start = 0;
  int32_t kv_chunk_start = 0;  // keys [kv_chunk_start, kv_chunk_end)
  int32_t kv_chunk_end = 0;
  // -1: the CTA writes o and lse. Otherwise token t's partial goes to slot
  // partial_first + t * partial_stride ([slot][num_qo_heads][head_dim] fp32 plus lse).
  int32_t partial_first = -1;
  int32_t partial_stride = 0;
  // Hopper launches (PrefillLaunch::per_head): the KV head of this item; elsewhere 0, and a CTA's
  // head is its index % num_kv_heads.
  int32_t kv_head = 0;
  int32_t reserved = 0;
};

// The longest work (keys of an item) of a Hopper launch that is "short" (PrefillLaunch::short_works):
// one 128-key tile. On an H100 (docs/benchmarks.md, 2026-12-07) the pipelined loop took 5-7% off
// prompts of 64 and 128 tokens, was 0.7% slower on works of two tiles (256-token prompts), and
// 1.3% slower on long ones.
inline constexpr int32_t kHopperShortWorkKeys = 128;

// One kernel launch: every item of one query tile size and kernel.
struct PrefillLaunch {
  PrefillKernel kernel = PrefillKernel::kMmaSync;  // never kAuto
  int32_t tile_rows = 0;   // packed query rows per CTA
  int32_t first_item = 0;  // into PrefillPlan::items
  int32_t num_items = 0;   // CTAs' worth of work: num_items * num_kv_heads, or num_items if per_head
  // Hopper: persistent CTAs that walk those CTAs' work, one wave (ctas_per_wave.hopper_tile128);
  // 0: one CTA per item and head.
  int32_t grid_ctas = 0;
  // Hopper: one item per (query tile, chunk, KV head), kv_head set, laid out for the persistent
  // grid: item r * balanced_grid + b is CTA b's r-th work, the rounds balanced by estimated time
  // (BalancePersistentWork in prefill_plan.cc).
  bool per_head = false;
  int32_t balanced_grid = 0;  // min(grid_ctas, its CTAs' worth of work)
  // Hopper: every item has at most kHopperShortWorkKeys keys, so the kernel (at head_dim 128)
  // pipelines its tile loop across works; longer works run the loop that drains after each.
  bool short_works = false;

  int64_t NumCtas(int32_t num_kv_heads) const { return per_head ? num_items : int64_t{num_items} * num_kv_heads; }
};

struct PrefillPlan {
  int32_t batch_size = 0;
  int32_t num_qo_heads = 0;
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;
  int64_t num_qo_rows = 0;  // qo_indptr[batch_size]
  std::vector<PrefillLaunch> launches;
  // Launch after launch: heaviest first within an mma.sync launch; a Hopper launch's one item per
  // KV head, laid out for its persistent grid (PrefillLaunch::per_head).
  std::vector<PrefillWorkItem> items;
  std::vector<int32_t> request_chunk_tokens;  // [batch_size]; 0: not split
  // Merge of split requests: output row r (a token) combines slots [merge_indptr[r],
  // merge_indptr[r + 1]) into row merge_out_rows[r] of o.
  int32_t num_partials = 0;
  std::vector<int32_t> merge_indptr{0};
  std::vector<int32_t> merge_out_rows;

  bool split_kv() const { return num_partials > 0; }
  int32_t num_merge_rows() const { return static_cast<int32_t>(merge_out_rows.size()); }
  int64_t NumCtas() const;
  std::string DebugString() const;
};

// Packed query rows per CTA for a request with `packed_rows` = q_len * group rows: the smallest
// tile that is not mostly padding. `hopper`: the Hopper kernel takes the 128-row tiles, at every
// head_dim; the mma.sync kernel's stop at 64 for head_dim 256 (its registers).
int32_t PrefillQueryTileRows(int64_t packed_rows, int32_t head_dim, bool hopper);

// Plans one CTA per (request, query tile, KV chunk, KV head). Requests with no query rows
// (padding slots) get no CTA. A request's kernel, tile and chunk follow from the request alone
// (and the device), never from the rest of the batch.
absl::StatusOr<PrefillPlan> PlanPrefill(const PrefillPlanInput& input);

}  // namespace attnd::plan
