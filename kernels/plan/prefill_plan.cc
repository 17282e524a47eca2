#include "plan/prefill_plan.h"

#include <algorithm>
#include <array>
#include <cinttypes>
#include <cstdio>
#include <map>
#include <span>
#include <utility>
#include <vector>

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

// The Hopper kernel's persistent CTAs take their work by position: CTA b's r-th is r * grid + b.
// Appends `items` (heaviest first, with their key-row products) once per KV head in that layout.
//
// Order: a work reads the first `tiles` KV tiles of its (request, chunk, KV head). Heaviest first
// over the whole launch, every weight class sweeps the KV of every head again, and at causal
// 8 x 2048 (64 heads' KV, 64 MB) L2 keeps little of it: ncu measured 1.1 GB of DRAM traffic a
// launch (Q and O are 0.27 GB) on an H200, whose clock the 700 W cap holds at ~1.45 GHz under this
// load. So works longer than `light_tiles` run head by head (each head's heaviest first), the
// concurrent CTAs sharing a few heads' KV, and the light ones last, heaviest first, to even out
// the CTAs' ends: their KV (the first light_tiles tiles of every head) fits kLightKvBytes. When
// all the launch's KV fits that, heaviest first throughout.
//
// Balance: the works are cut into rounds of `grid`; within a round the heavier a work the less
// work its CTA has so far (longest processing time first, one work per CTA and round). A work's
// time is estimated as its 128-key tiles plus ~1.5 at its boundaries (Q, the first Q K^T and the
// last P V without overlap, the epilogue: 2.8 against 1.9 us a tile at 8 x 2048, H200). The last
// round, short of `grid` works, goes to CTAs 0.. by position: the CTAs are renumbered so those are
// the least loaded. Returns the grid balanced for: min(grid, works); 0 keeps one CTA per work.
constexpr int64_t kLightKvBytes = int64_t{16} << 20;

int32_t BalancePersistentWork(std::span<const std::pair<int64_t, PrefillWorkItem>> items, int32_t tile_rows,
                              int32_t num_kv_heads, int32_t head_dim, int32_t grid,
                              std::vector<PrefillWorkItem>& out) {
  // Work w is item w / num_kv_heads on KV head w % num_kv_heads; its group (the works that read
  // the same KV) is its item's (request, chunk) number, by first appearance, times the heads plus
  // its head. Indices, not copies, are what gets ordered.
  const int64_t num_items = static_cast<int64_t>(items.size());
  const int64_t num_works = num_items * num_kv_heads;
  std::vector<int32_t> item_tiles(num_items);
  std::vector<int32_t> item_group(num_items);
  std::map<std::pair<int32_t, int32_t>, int32_t> group_of;
  int32_t max_tiles = 0;
  for (int64_t i = 0; i < num_items; ++i) {
    const auto& [key_rows, item] = items[i];
    item_tiles[i] = static_cast<int32_t>(CeilDiv(key_rows / tile_rows, 128));
    max_tiles = std::max(max_tiles, item_tiles[i]);
    item_group[i] = group_of.try_emplace({item.request, item.kv_chunk_start}, static_cast<int32_t>(group_of.size()))
                        .first->second;
  }
  const int64_t num_groups = static_cast<int64_t>(group_of.size()) * num_kv_heads;
  // Per work, without a division in the loops below.
  std::vector<int32_t> work_tiles(num_works);
  std::vector<int32_t> work_group(num_works);
  for (int64_t i = 0, w = 0; i < num_items; ++i) {
    for (int32_t head = 0; head < num_kv_heads; ++head, ++w) {
      work_tiles[w] = item_tiles[i];
      work_group[w] = item_group[i] * num_kv_heads + head;
    }
  }
  auto emit = [&](int64_t position, int64_t w) {
    PrefillWorkItem& item = out[position];
    item = items[w / num_kv_heads].second;
    item.kv_head = static_cast<int32_t>(w % num_kv_heads);
  };
  const size_t base = out.size();
  out.resize(base + num_works);
  if (grid <= 0 || num_works <= grid) {
    for (int64_t w = 0; w < num_works; ++w) emit(base + w, w);
    return grid <= 0 ? 0 : static_cast<int32_t>(num_works);
  }

  // The order: heavy works by group (each group's heaviest first, as `items` are), then the light
  // ones (at most light_tiles tiles, K and V in 16 bits, whose KV over every group fits), or
  // heaviest first throughout when everything is light. A counting sort by group.
  const int64_t tile_bytes = int64_t{2} * 128 * head_dim * 2;
  const int64_t light_tiles = kLightKvBytes / (num_groups * tile_bytes);
  std::vector<int32_t> order(num_works);
  if (light_tiles < max_tiles) {
    std::vector<int32_t> start(num_groups + 1, 0);
    int64_t num_heavy = 0;
    for (int64_t w = 0; w < num_works; ++w) {
      if (work_tiles[w] > light_tiles) {
        ++start[work_group[w] + 1];
        ++num_heavy;
      }
    }
    for (int64_t g = 0; g < num_groups; ++g) start[g + 1] += start[g];
    int64_t next_light = num_heavy;
    for (int64_t w = 0; w < num_works; ++w) {
      order[work_tiles[w] > light_tiles ? start[work_group[w]]++ : next_light++] = static_cast<int32_t>(w);
    }
  } else {
    for (int64_t w = 0; w < num_works; ++w) order[w] = static_cast<int32_t>(w);
  }

  // Virtual CTA v takes a work per round; `cta_of[k]` is the k-th work's. Sorted as packed
  // 64-bit keys (no comparator calls, no allocation per round): a round's works by tiles, heaviest
  // first, then position; the CTAs by load, then number. Ties go to the lower number, so the plan
  // is a function of its input.
  std::vector<int64_t> load(grid, 0);
  std::vector<int64_t> cta_keys(grid);
  std::vector<int64_t> work_keys(grid);
  std::vector<int32_t> cta_of(num_works);
  for (int64_t round_start = 0; round_start < num_works; round_start += grid) {
    for (int32_t v = 0; v < grid; ++v) cta_keys[v] = load[v] << 20 | v;  // grid < 2^20, load < 2^43
    std::sort(cta_keys.begin(), cta_keys.end());
    const int32_t count = static_cast<int32_t>(std::min<int64_t>(grid, num_works - round_start));
    for (int32_t j = 0; j < count; ++j) {
      work_keys[j] = int64_t{max_tiles - work_tiles[order[round_start + j]]} << 32 | j;
    }
    std::sort(work_keys.begin(), work_keys.begin() + count);
    for (int32_t j = 0; j < count; ++j) {
      const int64_t k = round_start + (work_keys[j] & 0xffffffff);
      const int32_t v = static_cast<int32_t>(cta_keys[j] & 0xfffff);
      cta_of[k] = v;
      load[v] += 2 * work_tiles[order[k]] + 3;
    }
  }
  // Physical numbers: the last round's CTAs first, in the order of its works.
  const int64_t last_start = (num_works - 1) / grid * grid;
  std::vector<int32_t> physical(grid, -1);
  int32_t next = 0;
  for (int64_t k = last_start; k < num_works; ++k) physical[cta_of[k]] = next++;
  for (int32_t v = 0; v < grid; ++v) {
    if (physical[v] < 0) physical[v] = next++;
  }
  for (int64_t k = 0; k < num_works; ++k) emit(base + k / grid * grid + physical[cta_of[k]], order[k]);
  return grid;
}

}  // namespace

int32_t PrefillQueryTileRows(int64_t packed_rows, int32_t head_dim, bool hopper) {
  if (packed_rows > 64 && (head_dim < 256 || hopper)) return 128;
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

int64_t PrefillPlan::NumCtas() const {
  int64_t ctas = 0;
  for (const PrefillLaunch& launch : launches) ctas += launch.NumCtas(num_kv_heads);
  return ctas;
}

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
  if (force_hopper && input.ctas_per_wave.hopper_tile128 <= 0) {
    return absl::FailedPreconditionError(
        "kernel: the Hopper prefill kernel needs an sm_90 device and q and KV of one 16-bit type "
        "(ctas_per_wave.hopper_tile128 is " + std::to_string(input.ctas_per_wave.hopper_tile128) + ")");
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
    const int32_t tile_rows = force_hopper ? 128 : PrefillQueryTileRows(packed_rows, input.head_dim, hopper);
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
    launch.tile_rows = kTileRows[slot];
    launch.first_item = static_cast<int32_t>(plan.items.size());
    if (launch.kernel == PrefillKernel::kHopper) {
      launch.grid_ctas = input.ctas_per_wave.hopper_tile128;
      launch.per_head = true;
      if (int64_t{launch.first_item} + static_cast<int64_t>(items.size()) * input.num_kv_heads > INT32_MAX) {
        return absl::InvalidArgumentError("prefill batch needs more than 2^31 CTAs");
      }
      launch.balanced_grid = BalancePersistentWork(items, launch.tile_rows, input.num_kv_heads, input.head_dim,
                                                   launch.grid_ctas, plan.items);
      launch.short_works = std::all_of(items.begin(), items.end(), [](const auto& entry) {
        return entry.second.kv_chunk_end - entry.second.kv_chunk_start <= kHopperShortWorkKeys;
      });
    } else {
      for (const auto& [work, item] : items) plan.items.push_back(item);
    }
    launch.num_items = static_cast<int32_t>(plan.items.size()) - launch.first_item;
    plan.launches.push_back(launch);
  }
  if (plan.NumCtas() > INT32_MAX) return absl::InvalidArgumentError("prefill batch needs more than 2^31 CTAs");
  return plan;
}

}  // namespace attnd::plan
