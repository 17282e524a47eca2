#include "plan/prefill_plan.h"

#include <algorithm>
#include <array>
#include <cinttypes>
#include <cstdio>

#include "absl/status/status.h"

namespace attnd::plan {
namespace {

constexpr std::array<int32_t, 3> kTileRows = {16, 64, 128};
// Chunks are whole KV tiles of the 64-key kernels, so no chunk ends in a mostly empty tile.
constexpr int32_t kChunkGranularityTokens = 64;

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

struct RequestShape {
  int32_t request;
  int32_t q_len;
  int32_t kv_len;
  int64_t num_tiles;  // query tiles per KV head
};

// CTAs of `requests` when keys are cut into chunks of `chunk` tokens (0: uncut).
int64_t CtasAtChunk(std::span<const RequestShape> requests, int32_t num_kv_heads, int64_t chunk) {
  int64_t ctas = 0;
  for (const RequestShape& r : requests) {
    ctas += r.num_tiles * (chunk > 0 && r.kv_len > chunk ? CeilDiv(r.kv_len, chunk) : 1);
  }
  return ctas * num_kv_heads;
}

// The smallest chunk (a multiple of the granularity, at least `floor_tokens`) that keeps the
// CTAs within one wave; 0 when the uncut requests occupy more than half the SMs, or cutting
// cannot help.
int32_t PickChunkTokens(std::span<const RequestShape> requests, int32_t num_kv_heads, int32_t wave,
                        int32_t num_sms, int32_t floor_tokens) {
  if (wave <= 0 || requests.empty()) return 0;
  const int64_t uncut = CtasAtChunk(requests, num_kv_heads, 0);
  if (uncut >= wave || 2 * uncut > num_sms) return 0;
  int32_t max_kv = 0;
  for (const RequestShape& r : requests) max_kv = std::max(max_kv, r.kv_len);
  int64_t low = CeilDiv(floor_tokens, kChunkGranularityTokens);
  int64_t high = CeilDiv(max_kv, kChunkGranularityTokens);  // uncut: fits, checked above
  if (low >= high) return 0;
  while (low < high) {
    const int64_t mid = (low + high) / 2;
    if (CtasAtChunk(requests, num_kv_heads, mid * kChunkGranularityTokens) <= wave) {
      high = mid;
    } else {
      low = mid + 1;
    }
  }
  const int64_t chunk = low * kChunkGranularityTokens;
  return chunk >= max_kv ? 0 : static_cast<int32_t>(chunk);
}

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

const char* PrefillKernelName(PrefillKernel kernel) {
  switch (kernel) {
    case PrefillKernel::kAuto: return "auto";
    case PrefillKernel::kMmaSync: return "mma.sync";
    case PrefillKernel::kHopper: return "hopper";
  }
  return "?";
}

int64_t PrefillPlan::NumCtas() const { return static_cast<int64_t>(items.size()) * num_kv_heads; }

std::string PrefillPlan::DebugString() const {
  std::string out;
  char line[160];
  std::snprintf(line, sizeof line, "prefill plan: batch %d, heads %d/%d, head_dim %d, rows %" PRId64 "\n",
                batch_size, num_qo_heads, num_kv_heads, head_dim, num_qo_rows);
  out += line;
  if (split_kv()) {
    std::snprintf(line, sizeof line, "  split-KV: %d partials, %d merge rows\n", num_partials, num_merge_rows());
    out += line;
  }
  for (const PrefillLaunch& launch : launches) {
    std::snprintf(line, sizeof line, "  launch %s tile %d: items [%d, %d)\n", PrefillKernelName(launch.kernel),
                  launch.tile_rows, launch.first_item, launch.first_item + launch.num_items);
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
  if (input.fixed_split_tokens < 0 || input.min_chunk_tokens < 0 || input.num_colocated_ctas < 0) {
    return absl::InvalidArgumentError(
        "fixed_split_tokens, min_chunk_tokens and num_colocated_ctas must not be negative");
  }
  if (input.qo_indptr[0] != 0) return absl::InvalidArgumentError("qo_indptr[0] must be 0");
  const int32_t group = input.num_qo_heads / input.num_kv_heads;
  // The Hopper kernel takes the 128-row tiles (every tile when forced); the split below then
  // sizes chunks against its wave.
  const bool force_hopper = input.kernel == PrefillKernel::kHopper;
  if (force_hopper && (input.ctas_per_wave.hopper_tile128 <= 0 || input.head_dim == 256)) {
    return absl::FailedPreconditionError(
        "kernel: the Hopper prefill kernel needs an sm_90 device, q and KV of one 16-bit type and head_dim 64 or "
        "128 (ctas_per_wave.hopper_tile128 is " + std::to_string(input.ctas_per_wave.hopper_tile128) +
        ", head_dim " + std::to_string(input.head_dim) + ")");
  }
  const bool hopper = force_hopper || (input.kernel == PrefillKernel::kAuto && input.ctas_per_wave.hopper_tile128 > 0);
  const PrefillKernel tile128_kernel = hopper ? PrefillKernel::kHopper : PrefillKernel::kMmaSync;
  PrefillWaveSizes waves = input.ctas_per_wave;
  if (hopper) waves.tile128 = waves.hopper_tile128;

  PrefillPlan plan;
  plan.batch_size = static_cast<int32_t>(batch_size);
  plan.num_qo_heads = input.num_qo_heads;
  plan.num_kv_heads = input.num_kv_heads;
  plan.head_dim = input.head_dim;
  plan.num_qo_rows = input.qo_indptr[batch_size];
  plan.request_chunk_tokens.assign(batch_size, 0);

  // Tile size and tile count of every request, grouped by tile size (one launch each).
  std::array<std::vector<RequestShape>, kTileRows.size()> by_tile;
  for (int64_t b = 0; b < batch_size; ++b) {
    const int32_t q_len = input.qo_indptr[b + 1] - input.qo_indptr[b];
    const int32_t kv_len = input.kv_lengths[b];
    if (q_len < 0) return absl::InvalidArgumentError("qo_indptr must not decrease (request " + std::to_string(b) + ")");
    if (kv_len < 0) return absl::InvalidArgumentError("kv_lengths[" + std::to_string(b) + "] is negative");
    if (q_len == 0) continue;
    const int64_t packed_rows = int64_t{q_len} * group;
    if (packed_rows > INT32_MAX) return absl::InvalidArgumentError("q_len * group_size exceeds 2^31");
    const int32_t tile_rows = force_hopper ? 128 : PrefillQueryTileRows(packed_rows, input.head_dim);
    const size_t slot = std::find(kTileRows.begin(), kTileRows.end(), tile_rows) - kTileRows.begin();
    by_tile[slot].push_back({static_cast<int32_t>(b), q_len, kv_len, CeilDiv(packed_rows, tile_rows)});
  }

  // Chunk sizes: pinned, per request (deterministic), or per launch.
  const int32_t floor_tokens = std::max(input.min_chunk_tokens, kChunkGranularityTokens);
  // The largest tile above 16 rows that has requests shares its wave with num_colocated_ctas.
  size_t colocated_slot = kTileRows.size();
  for (size_t slot = 1; slot < kTileRows.size(); ++slot) {
    if (!by_tile[slot].empty()) colocated_slot = slot;
  }
  for (size_t slot = 0; slot < kTileRows.size(); ++slot) {
    const int32_t wave = waves.ForTile(kTileRows[slot]);
    const int32_t shared_wave =
        slot == colocated_slot ? std::max(0, wave - input.num_colocated_ctas) : wave;
    std::vector<RequestShape>& requests = by_tile[slot];
    if (input.disable_split_kv) continue;
    if (input.fixed_split_tokens > 0) {
      const int32_t chunk = static_cast<int32_t>(CeilDiv(input.fixed_split_tokens, kChunkGranularityTokens) *
                                                 kChunkGranularityTokens);
      for (const RequestShape& r : requests) plan.request_chunk_tokens[r.request] = r.kv_len > chunk ? chunk : 0;
    } else if (input.deterministic) {
      for (const RequestShape& r : requests) {
        plan.request_chunk_tokens[r.request] =
            PickChunkTokens({&r, 1}, input.num_kv_heads, wave, waves.num_sms, floor_tokens);
      }
    } else {
      const int32_t chunk =
          PickChunkTokens(requests, input.num_kv_heads, shared_wave, waves.num_sms, floor_tokens);
      for (const RequestShape& r : requests) plan.request_chunk_tokens[r.request] = r.kv_len > chunk ? chunk : 0;
    }
  }

  // Items, partial slots and merge rows.
  std::array<std::vector<std::pair<int64_t, PrefillWorkItem>>, kTileRows.size()> items_by_tile;
  int64_t num_partials = 0;
  for (size_t slot = 0; slot < kTileRows.size(); ++slot) {
    const int32_t tile_rows = kTileRows[slot];
    for (const RequestShape& r : by_tile[slot]) {
      const int32_t chunk = plan.request_chunk_tokens[r.request];
      const int32_t num_chunks = chunk > 0 ? static_cast<int32_t>(CeilDiv(r.kv_len, chunk)) : 1;
      const int64_t partial_base = num_partials;
      if (num_chunks > 1) {
        num_partials += int64_t{r.q_len} * num_chunks;
        if (num_partials > INT32_MAX) return absl::InvalidArgumentError("prefill split needs more than 2^31 partials");
        const int32_t qo_start = input.qo_indptr[r.request];
        for (int32_t t = 0; t < r.q_len; ++t) {
          plan.merge_out_rows.push_back(qo_start + t);
          plan.merge_indptr.push_back(static_cast<int32_t>(partial_base + int64_t{t + 1} * num_chunks));
        }
      } else {
        plan.request_chunk_tokens[r.request] = 0;
      }
      for (int64_t tile = 0; tile < r.num_tiles; ++tile) {
        for (int32_t c = 0; c < num_chunks; ++c) {
          PrefillWorkItem item;
          item.request = r.request;
          item.packed_row_start = static_cast<int32_t>(tile * tile_rows);
          item.kv_chunk_start = num_chunks > 1 ? c * chunk : 0;
          item.kv_chunk_end = num_chunks > 1 ? std::min(r.kv_len, (c + 1) * chunk) : r.kv_len;
          if (num_chunks > 1) {
            item.partial_first = static_cast<int32_t>(partial_base + c);
            item.partial_stride = num_chunks;
          }
          items_by_tile[slot].emplace_back(ItemWork(item, tile_rows, group, r.q_len, r.kv_len, input.causal), item);
        }
      }
    }
  }
  plan.num_partials = static_cast<int32_t>(num_partials);

  // Largest tiles first: they run longest, so they should not start in the last wave.
  for (int slot = static_cast<int>(kTileRows.size()) - 1; slot >= 0; --slot) {
    auto& items = items_by_tile[slot];
    if (items.empty()) continue;
    std::stable_sort(items.begin(), items.end(),
                     [](const auto& a, const auto& b) { return a.first > b.first; });
    PrefillLaunch launch;
    launch.kernel = kTileRows[slot] == 128 ? tile128_kernel : PrefillKernel::kMmaSync;
    if (launch.kernel == PrefillKernel::kHopper) launch.grid_ctas = input.ctas_per_wave.hopper_tile128;
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
