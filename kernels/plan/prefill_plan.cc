#include "plan/prefill_plan.h"

#include <algorithm>
#include <array>
#include <cinttypes>
#include <cstdio>

#include "absl/status/status.h"

namespace attnd::plan {
namespace {

constexpr std::array<int32_t, 3> kTileRows = {16, 64, 128};

// Key-row products of one CTA, the order in which launches hand out CTAs: the causal diagonal
// makes late query tiles the longest, and starting them first keeps the last wave short.
int64_t ItemWork(const PrefillWorkItem& item, int32_t tile_rows, int32_t group, int32_t q_len,
                 int32_t kv_len, bool causal) {
  int64_t keys = item.kv_chunk_end - item.kv_chunk_start;
  if (causal) {
    const int32_t last_row = std::min<int64_t>(item.packed_row_start + tile_rows, int64_t{q_len} * group) - 1;
    const int64_t last_position = int64_t{kv_len} - q_len + last_row / group;
    keys = std::clamp<int64_t>(last_position + 1 - item.kv_chunk_start, 0, keys);
  }
  return keys * tile_rows;
}

}  // namespace

int32_t PrefillQueryTileRows(int64_t packed_rows, int32_t head_dim) {
  if (packed_rows > 64 && head_dim < 256) return 128;
  if (packed_rows > 16) return 64;
  return 16;
}

int64_t PrefillPlan::NumCtas() const { return static_cast<int64_t>(items.size()) * num_kv_heads; }

std::string PrefillPlan::DebugString() const {
  std::string out;
  char line[160];
  std::snprintf(line, sizeof line, "prefill plan: batch %d, heads %d/%d, head_dim %d, rows %" PRId64 "\n",
                batch_size, num_qo_heads, num_kv_heads, head_dim, num_qo_rows);
  out += line;
  for (const PrefillLaunch& launch : launches) {
    std::snprintf(line, sizeof line, "  launch tile %d: items [%d, %d)\n", launch.tile_rows,
                  launch.first_item, launch.first_item + launch.num_items);
    out += line;
  }
  return out;
}

absl::StatusOr<PrefillPlan> PlanPrefill(const PrefillPlanInput& input) {
  if (input.qo_indptr.empty()) return absl::InvalidArgumentError("qo_indptr: expected batch_size + 1 entries, got 0");
  const int64_t batch_size = static_cast<int64_t>(input.qo_indptr.size()) - 1;
  if (static_cast<int64_t>(input.kv_lengths.size()) != batch_size) {
    return absl::InvalidArgumentError("kv_lengths: expected " + std::to_string(batch_size) +
                                      " entries, got " + std::to_string(input.kv_lengths.size()));
  }
  if (input.num_kv_heads <= 0 || input.num_qo_heads <= 0 || input.num_qo_heads % input.num_kv_heads != 0) {
    return absl::InvalidArgumentError("num_qo_heads must be a positive multiple of num_kv_heads, got " +
                                      std::to_string(input.num_qo_heads) + "/" +
                                      std::to_string(input.num_kv_heads));
  }
  if (input.head_dim != 64 && input.head_dim != 128 && input.head_dim != 256) {
    return absl::InvalidArgumentError("head_dim: expected 64, 128 or 256, got " + std::to_string(input.head_dim));
  }
  if (input.qo_indptr[0] != 0) return absl::InvalidArgumentError("qo_indptr[0] must be 0");
  const int32_t group = input.num_qo_heads / input.num_kv_heads;

  PrefillPlan plan;
  plan.batch_size = static_cast<int32_t>(batch_size);
  plan.num_qo_heads = input.num_qo_heads;
  plan.num_kv_heads = input.num_kv_heads;
  plan.head_dim = input.head_dim;
  plan.num_qo_rows = input.qo_indptr[batch_size];

  // Items of each tile size with their work estimate.
  std::array<std::vector<std::pair<int64_t, PrefillWorkItem>>, kTileRows.size()> by_tile;
  for (int64_t b = 0; b < batch_size; ++b) {
    const int32_t q_len = input.qo_indptr[b + 1] - input.qo_indptr[b];
    const int32_t kv_len = input.kv_lengths[b];
    if (q_len < 0) return absl::InvalidArgumentError("qo_indptr must not decrease (request " + std::to_string(b) + ")");
    if (kv_len < 0) return absl::InvalidArgumentError("kv_lengths[" + std::to_string(b) + "] is negative");
    if (q_len == 0) continue;
    const int64_t packed_rows = int64_t{q_len} * group;
    if (packed_rows > INT32_MAX) return absl::InvalidArgumentError("q_len * group_size exceeds 2^31");
    const int32_t tile_rows = PrefillQueryTileRows(packed_rows, input.head_dim);
    const size_t slot = std::find(kTileRows.begin(), kTileRows.end(), tile_rows) - kTileRows.begin();
    for (int64_t row = 0; row < packed_rows; row += tile_rows) {
      PrefillWorkItem item;
      item.request = static_cast<int32_t>(b);
      item.packed_row_start = static_cast<int32_t>(row);
      item.kv_chunk_start = 0;
      item.kv_chunk_end = kv_len;
      by_tile[slot].emplace_back(ItemWork(item, tile_rows, group, q_len, kv_len, input.causal), item);
    }
  }
  // Largest tiles first: they run longest, so they should not start in the last wave.
  for (int slot = static_cast<int>(kTileRows.size()) - 1; slot >= 0; --slot) {
    auto& items = by_tile[slot];
    if (items.empty()) continue;
    std::stable_sort(items.begin(), items.end(),
                     [](const auto& a, const auto& b) { return a.first > b.first; });
    PrefillLaunch launch;
    launch.tile_rows = kTileRows[slot];
    launch.first_item = static_cast<int32_t>(plan.items.size());
    launch.num_items = static_cast<int32_t>(items.size());
    for (const auto& [work, item] : items) plan.items.push_back(item);
    plan.launches.push_back(launch);
  }
  if (plan.NumCtas() > INT32_MAX) return absl::InvalidArgumentError("prefill batch needs more than 2^31 CTAs");
  return plan;
}

}  // namespace attnd::plan
