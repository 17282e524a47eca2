#include "plan/mla_plan.h"

#include <algorithm>
#include <functional>
#include <limits>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace attnd::plan {
namespace {

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }
int64_t RoundUp(int64_t value, int64_t multiple) { return CeilDiv(value, multiple) * multiple; }

// The batch's active requests (at least one query token).
struct Active {
  std::vector<int32_t> request;
  std::vector<int64_t> length;
  std::vector<int32_t> q_len;
  std::vector<int64_t> row_tiles;
  int64_t max_length = 0;
};

Active ActiveRequests(std::span<const int32_t> qo_indptr, std::span<const int64_t> kv_lengths,
                      int32_t num_heads) {
  Active active;
  for (size_t b = 0; b < kv_lengths.size(); ++b) {
    const int32_t q_len = qo_indptr[b + 1] - qo_indptr[b];
    if (q_len <= 0) continue;
    active.request.push_back(static_cast<int32_t>(b));
    active.length.push_back(kv_lengths[b]);
    active.q_len.push_back(q_len);
    active.row_tiles.push_back(CeilDiv(int64_t{q_len} * num_heads, kMlaRowsPerCta));
    active.max_length = std::max(active.max_length, kv_lengths[b]);
  }
  return active;
}

int64_t Chunks(int64_t length, int64_t chunk_tokens) {
  return std::max<int64_t>(1, CeilDiv(length, chunk_tokens));
}

int64_t CountCtas(const Active& active, int64_t chunk_tokens) {
  int64_t ctas = 0;
  for (size_t i = 0; i < active.length.size(); ++i)
    ctas += Chunks(active.length[i], chunk_tokens) * active.row_tiles[i];
  return ctas;
}

// The smallest multiple of kMlaChunkTokens in [low, high] whose CTAs fit in max_ctas; `high`
// when none does. CountCtas is non-increasing in the chunk: binary search.
int64_t SmallestChunkWithin(const Active& active, int64_t low, int64_t high, int64_t max_ctas) {
  int64_t lo = CeilDiv(low, kMlaChunkTokens);
  int64_t hi = CeilDiv(high, kMlaChunkTokens);
  if (lo >= hi || CountCtas(active, hi * kMlaChunkTokens) > max_ctas) return high;
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (CountCtas(active, mid * kMlaChunkTokens) <= max_ctas) {
      hi = mid;
    } else {
      lo = mid + 1;
    }
  }
  return std::min(lo * kMlaChunkTokens, high);
}

int64_t NoSplitChunk(const Active& active) { return std::max<int64_t>(active.max_length, 1); }

int64_t OneWaveChunk(const Active& active, const MlaPlanOptions& options) {
  const int64_t longest = NoSplitChunk(active);
  const int64_t floor = RoundUp(std::max(options.min_chunk_tokens, 1), kMlaChunkTokens);
  return SmallestChunkWithin(active, floor, longest, options.ctas_per_wave);
}

int64_t OversubscribeChunk(const Active& active, const MlaPlanOptions& options) {
  const int64_t longest = NoSplitChunk(active);
  const int64_t splits = std::clamp<int64_t>(
      CeilDiv(longest, std::max(options.min_tokens_per_cta, 1)), 1, std::max(options.max_splits, 1));
  const int64_t chunk = RoundUp(CeilDiv(longest, splits), kMlaChunkTokens);
  if (chunk >= longest) return longest;
  const int64_t max_ctas = int64_t{std::max(options.max_waves, 1)} * options.ctas_per_wave;
  return SmallestChunkWithin(active, chunk, longest, max_ctas);
}

// Makespan of the units over ctas_per_wave slots when each unit starts on the slot that frees
// first, longest units first (the kernel launches them in that order): full chunks (all of
// cost C + overhead) fill the slots round-robin, then each request's shorter last chunk goes to
// the least loaded slot. Plus the merge.
int64_t Cost(const Active& active, int64_t chunk_tokens, const MlaPlanOptions& options) {
  const int64_t overhead = options.cta_overhead_tokens;
  const int64_t slots = std::max(options.ctas_per_wave, 1);
  int64_t full_units = 0, partial_rows = 0;
  std::vector<int64_t> tails;
  for (size_t i = 0; i < active.length.size(); ++i) {
    const int64_t length = active.length[i];
    const int64_t chunks = Chunks(length, chunk_tokens);
    const int64_t tail = length - (chunks - 1) * chunk_tokens;  // the last chunk's keys
    if (tail == chunk_tokens) {
      full_units += chunks * active.row_tiles[i];
    } else {
      full_units += (chunks - 1) * active.row_tiles[i];
      tails.insert(tails.end(), active.row_tiles[i], tail + overhead);
    }
    if (chunks > 1) partial_rows += chunks * int64_t{active.q_len[i]} * options.num_heads;
  }
  const int64_t unit = chunk_tokens + overhead;
  const int64_t rounds = full_units / slots;
  const int64_t loaded = full_units % slots;  // slots with one more full unit
  int64_t makespan = (rounds + (loaded > 0 ? 1 : 0)) * unit;
  if (!tails.empty()) {
    std::sort(tails.begin(), tails.end(), std::greater<>());
    // Min-heap of slot loads.
    std::vector<int64_t> heap(slots, rounds * unit);
    std::fill(heap.begin() + (slots - loaded), heap.end(), (rounds + 1) * unit);
    std::make_heap(heap.begin(), heap.end(), std::greater<>());
    for (int64_t tail : tails) {
      std::pop_heap(heap.begin(), heap.end(), std::greater<>());
      heap.back() += tail;
      makespan = std::max(makespan, heap.back());
      std::push_heap(heap.begin(), heap.end(), std::greater<>());
    }
  }
  return makespan + CeilDiv(partial_rows * options.merge_tokens_per_partial_row, slots);
}

// Oversubscription's chunk: the rule's (OversubscribeChunk) for min_tokens_per_cta times
// 1, 2, 4, ... (oversubscribe_candidates of them); the cheapest by Cost.
int64_t BestOversubscribeChunk(const Active& active, const MlaPlanOptions& options, int64_t* cost) {
  int64_t best_chunk = 0;
  *cost = std::numeric_limits<int64_t>::max();
  MlaPlanOptions candidate = options;
  for (int32_t k = 0; k < std::max(options.oversubscribe_candidates, 1); ++k) {
    candidate.min_tokens_per_cta = static_cast<int32_t>(
        std::min<int64_t>(int64_t{std::max(options.min_tokens_per_cta, 1)} << k,
                          std::numeric_limits<int32_t>::max()));
    const int64_t chunk = OversubscribeChunk(active, candidate);
    if (chunk == best_chunk) continue;
    const int64_t chunk_cost = Cost(active, chunk, options);
    if (chunk_cost < *cost) {
      *cost = chunk_cost;
      best_chunk = chunk;
    }
  }
  return best_chunk;
}

absl::Status Validate(std::span<const int32_t> qo_indptr, std::span<const int64_t> kv_lengths,
                      const MlaPlanOptions& options) {
  const size_t batch_size = kv_lengths.size();
  if (qo_indptr.size() != batch_size + 1) {
    return absl::InvalidArgumentError(absl::StrCat("qo_indptr: expected ", batch_size + 1,
                                                   " entries, got ", qo_indptr.size()));
  }
  if (options.num_heads <= 0 || options.num_heads > 1024) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_heads: expected 1..1024, got ", options.num_heads));
  }
  if (options.min_tokens_per_cta < 0 || options.max_splits < 0 || options.max_waves < 0 ||
      options.min_chunk_tokens < 0 || options.cta_overhead_tokens < 0 ||
      options.merge_tokens_per_partial_row < 0 || options.fixed_split_tokens < 0 ||
      options.oversubscribe_candidates < 0) {
    return absl::InvalidArgumentError("MLA plan options must be >= 0");
  }
  const bool pinned = options.fixed_split_tokens > 0 || options.deterministic ||
                      options.split_mode == MlaSplitMode::kNone;
  if (!pinned && options.ctas_per_wave <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ctas_per_wave: expected > 0 (measured occupancy x SMs), got ", options.ctas_per_wave));
  }
  if (options.split_mode == MlaSplitMode::kFixed) {
    return absl::InvalidArgumentError("split_mode kFixed: pin the chunk with fixed_split_tokens");
  }
  if (qo_indptr.empty() || qo_indptr[0] != 0) {
    return absl::InvalidArgumentError("qo_indptr: must start at 0");
  }
  for (size_t b = 0; b < batch_size; ++b) {
    const int64_t q_len = int64_t{qo_indptr[b + 1]} - qo_indptr[b];
    if (q_len < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("qo_indptr: decreasing at request ", b, " (", q_len, " rows)"));
    }
    if (q_len * options.num_heads > std::numeric_limits<int32_t>::max()) {
      return absl::InvalidArgumentError(absl::StrCat("request ", b, ": too many query rows"));
    }
    if (kv_lengths[b] < 0 || kv_lengths[b] > std::numeric_limits<int32_t>::max()) {
      return absl::InvalidArgumentError(
          absl::StrCat("kv_lengths[", b, "]: expected 0..2^31-1, got ", kv_lengths[b]));
    }
  }
  return absl::OkStatus();
}

}  // namespace

const char* MlaSplitModeName(MlaSplitMode mode) {
  switch (mode) {
    case MlaSplitMode::kAuto:
      return "auto";
    case MlaSplitMode::kOversubscribe:
      return "oversubscribe";
    case MlaSplitMode::kOneWave:
      return "one_wave";
    case MlaSplitMode::kNone:
      return "none";
    case MlaSplitMode::kFixed:
      return "fixed";
  }
  return "?";
}

int64_t EstimatedCost(std::span<const int32_t> qo_indptr, std::span<const int64_t> kv_lengths,
                      int64_t chunk_tokens, const MlaPlanOptions& options) {
  if (qo_indptr.size() != kv_lengths.size() + 1 || chunk_tokens <= 0) return 0;
  return Cost(ActiveRequests(qo_indptr, kv_lengths, options.num_heads), chunk_tokens, options);
}

absl::StatusOr<MlaPlan> PlanMlaDecode(std::span<const int32_t> qo_indptr,
                                      std::span<const int64_t> kv_lengths,
                                      const MlaPlanOptions& options) {
  if (absl::Status status = Validate(qo_indptr, kv_lengths, options); !status.ok()) return status;
  const Active active = ActiveRequests(qo_indptr, kv_lengths, options.num_heads);
  MlaPlan plan;
  if (active.request.empty()) return plan;

  int64_t chunk = 0;
  if (options.fixed_split_tokens > 0 || options.deterministic) {
    plan.mode = MlaSplitMode::kFixed;
    chunk = options.fixed_split_tokens > 0 ? options.fixed_split_tokens : kMlaDeterministicChunkTokens;
  } else {
    switch (options.split_mode) {
      case MlaSplitMode::kNone:
        plan.mode = MlaSplitMode::kNone;
        chunk = NoSplitChunk(active);
        break;
      case MlaSplitMode::kOneWave:
        plan.mode = MlaSplitMode::kOneWave;
        chunk = OneWaveChunk(active, options);
        break;
      case MlaSplitMode::kOversubscribe:
        plan.mode = MlaSplitMode::kOversubscribe;
        chunk = BestOversubscribeChunk(active, options, &plan.oversubscribe_cost);
        break;
      case MlaSplitMode::kAuto:
      case MlaSplitMode::kFixed: {
        const int64_t one_wave = OneWaveChunk(active, options);
        const int64_t oversubscribe = BestOversubscribeChunk(active, options, &plan.oversubscribe_cost);
        plan.one_wave_cost = Cost(active, one_wave, options);
        // Ties go to one wave: fewer CTAs and partials for the same estimate.
        const bool over = plan.oversubscribe_cost < plan.one_wave_cost;
        plan.mode = over ? MlaSplitMode::kOversubscribe : MlaSplitMode::kOneWave;
        chunk = over ? oversubscribe : one_wave;
        break;
      }
    }
  }
  chunk = std::max<int64_t>(chunk, 1);
  plan.estimated_cost = Cost(active, chunk, options);
  plan.kv_chunk_tokens = static_cast<int32_t>(std::min(chunk, NoSplitChunk(active)));

  int64_t total_units = 0;
  for (size_t i = 0; i < active.length.size(); ++i)
    total_units += Chunks(active.length[i], chunk) * active.row_tiles[i];
  plan.units.reserve(total_units);
  for (size_t i = 0; i < active.request.size(); ++i) {
    const int32_t b = active.request[i];
    const int64_t length = active.length[i];
    const int32_t q_len = active.q_len[i];
    const int64_t chunks = Chunks(length, chunk);
    plan.max_chunks = std::max<int32_t>(plan.max_chunks, static_cast<int32_t>(chunks));
    const int32_t base = plan.num_partials;
    for (int64_t c = 0; c < chunks; ++c) {
      for (int64_t tile = 0; tile < active.row_tiles[i]; ++tile) {
        MlaWorkUnit unit;
        unit.request = b;
        unit.q_row = qo_indptr[b];
        unit.q_len = q_len;
        unit.kv_len = static_cast<int32_t>(length);
        unit.row_begin = static_cast<int32_t>(tile * kMlaRowsPerCta);
        unit.kv_begin = static_cast<int32_t>(c * chunk);
        unit.kv_end = static_cast<int32_t>(std::min(length, (c + 1) * chunk));
        unit.partial_first = chunks == 1 ? -1 : static_cast<int32_t>(base + c);
        unit.partial_stride = chunks == 1 ? 0 : static_cast<int32_t>(chunks);
        plan.units.push_back(unit);
      }
    }
    if (chunks > 1) {
      // Token t's partials are slots [base + t * chunks, base + (t + 1) * chunks), chunk order.
      plan.num_partials += static_cast<int32_t>(chunks * q_len);
      for (int32_t t = 0; t < q_len; ++t) {
        plan.merge_q_row.push_back(qo_indptr[b] + t);
        plan.merge_indptr.push_back(static_cast<int32_t>(base + (t + 1) * chunks));
      }
    }
  }
  if (options.longest_first) {
    // Stable: the row tiles of a chunk stay adjacent (they read the same keys, so the second
    // finds them in L2), and equal chunks keep request order.
    std::stable_sort(plan.units.begin(), plan.units.end(),
                     [](const MlaWorkUnit& a, const MlaWorkUnit& b) {
                       return a.kv_end - a.kv_begin > b.kv_end - b.kv_begin;
                     });
  }
  return plan;
}

std::vector<int32_t> MlaPlan::Pack() const {
  constexpr size_t kUnitInts = sizeof(MlaWorkUnit) / sizeof(int32_t);
  std::vector<int32_t> packed(units.size() * kUnitInts);
  for (size_t i = 0; i < units.size(); ++i) {
    const MlaWorkUnit& u = units[i];
    const int32_t fields[kUnitInts] = {u.request,  u.q_row,    u.q_len,         u.kv_len,
                                       u.row_begin, u.kv_begin, u.kv_end,        u.partial_first,
                                       u.partial_stride, 0,     0,               0};
    std::copy(fields, fields + kUnitInts, packed.begin() + i * kUnitInts);
  }
  packed.insert(packed.end(), merge_indptr.begin(), merge_indptr.end());
  packed.insert(packed.end(), merge_q_row.begin(), merge_q_row.end());
  return packed;
}

MlaWorkView MlaPlan::View(const int32_t* packed) const {
  constexpr size_t kUnitInts = sizeof(MlaWorkUnit) / sizeof(int32_t);
  MlaWorkView view;
  view.num_units = num_units();
  view.units = reinterpret_cast<const MlaWorkUnit*>(packed);
  view.num_merge_rows = num_merge_rows();
  view.merge_indptr = packed + units.size() * kUnitInts;
  view.merge_q_row = view.merge_indptr + merge_indptr.size();
  view.num_partials = num_partials;
  return view;
}

std::string MlaPlan::DebugString() const {
  std::string out = absl::StrCat(
      "MlaPlan{mode=", MlaSplitModeName(mode), ", chunk=", kv_chunk_tokens,
      " tokens, max_chunks=", max_chunks, ", units=", num_units(), ", partials=", num_partials,
      ", merge_rows=", num_merge_rows(), ", cost=", estimated_cost,
      " (oversubscribe ", oversubscribe_cost, ", one wave ", one_wave_cost, ")");
  for (int32_t i = 0; i < num_units(); ++i) {
    const MlaWorkUnit& u = units[i];
    absl::StrAppend(&out, "\n  unit ", i, ": request ", u.request, " rows [", u.row_begin, ", +",
                    kMlaRowsPerCta, ") keys [", u.kv_begin, ", ", u.kv_end, ") -> ",
                    u.partial_first < 0
                        ? std::string("o")
                        : absl::StrCat("partials ", u.partial_first, " + t*", u.partial_stride));
  }
  absl::StrAppend(&out, "}");
  return out;
}

}  // namespace attnd::plan
