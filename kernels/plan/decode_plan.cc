#include "plan/decode_plan.h"

#include <algorithm>
#include <cstring>
#include <limits>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "attnd/status_macros.h"

namespace attnd::plan {
namespace {

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }


// Keys a decode query of a request with `length` keys may see: the last window_left + 1, or all.
int64_t WindowBegin(int64_t length, int32_t window_left) {
  return window_left >= 0 ? std::max<int64_t>(0, length - 1 - window_left) : 0;
}

// CTAs that chunking by `chunk_tokens` launches (every active request gets at least one item).
// Lengths fit in 31 bits (checked by the caller) and chunks in 32 here, so 32-bit division (the
// cheaper) is exact; quotient and remainder come from one division.
int64_t CountCtas(std::span<const int64_t> active_lengths, int64_t chunk_tokens,
                  int32_t num_kv_heads) {
  const uint32_t chunk = static_cast<uint32_t>(
      std::min<int64_t>(chunk_tokens, std::numeric_limits<uint32_t>::max()));
  int64_t items = 0;
  for (int64_t length : active_lengths) {
    const uint32_t keys = static_cast<uint32_t>(length);
    const uint32_t chunks = keys / chunk + (keys % chunk != 0 ? 1 : 0);
    items += chunks == 0 ? 1 : chunks;
  }
  return items * num_kv_heads;
}

// The smallest chunk (a multiple of kChunkGranularityTokens in [low, high] granules) whose CTAs
// fit in `max_ctas`; 0 when even the largest does not.
int64_t SmallestChunkWithin(std::span<const int64_t> active_lengths, int64_t low, int64_t high,
                            int64_t max_ctas, int32_t num_kv_heads) {
  const int64_t granularity = kChunkGranularityTokens;
  if (CountCtas(active_lengths, high * granularity, num_kv_heads) > max_ctas) return 0;
  // CountCtas is non-increasing in the chunk size: binary search for the first that fits.
  while (low < high) {
    const int64_t mid = low + (high - low) / 2;
    if (CountCtas(active_lengths, mid * granularity, num_kv_heads) <= max_ctas) {
      high = mid;
    } else {
      low = mid + 1;
    }
  }
  return low * granularity;
}

// DESIGN 4.2's rule: the smallest chunk (at least the floor) whose CTAs fit in the grid the
// device runs at once; no split when the batch fills it alone. Then capped at
// max_chunk_tokens, measured on an H100 (docs/benchmarks.md): with whole requests as items a
// mixed-length batch waits on its longest requests (64 requests of 1..8192 keys: 65% of the
// copy bandwidth uncapped, 93% at 1024-token chunks), and long requests stream 5-9% faster cut
// into 1024-token chunks even when the batch fills a wave (64 x 8192 and 64 x 32768 keys).
int64_t ChooseChunkTokens(std::span<const int64_t> active_lengths, const DecodePlanOptions& options) {
  int64_t max_length = 1;
  for (int64_t length : active_lengths) max_length = std::max(max_length, length);
  const int64_t granularity = kChunkGranularityTokens;
  const int64_t low = CeilDiv(std::max(options.min_chunk_tokens, 1), granularity);
  int64_t high = CeilDiv(max_length, granularity);
  if (low >= high) return max_length;
  if (options.max_chunk_tokens > 0) {
    // The answer is min(smallest fitting chunk, cap): only chunks up to the cap need searching.
    // When none of them fits, the smallest fitting chunk is above the cap (or none fits at all,
    // which answers max_length), so the answer is the cap either way.
    const int64_t cap = std::max(options.max_chunk_tokens, options.min_chunk_tokens);
    const int64_t cap_granules = std::min(high, cap / granularity);
    if (cap_granules < low || CountCtas(active_lengths, cap_granules * granularity,
                                        options.num_kv_heads) > options.ctas_per_wave) {
      return std::min(cap, max_length);
    }
    high = cap_granules;
  }
  int64_t chunk = SmallestChunkWithin(active_lengths, low, high, options.ctas_per_wave,
                                      options.num_kv_heads);
  if (chunk == 0) chunk = max_length;
  if (options.max_chunk_tokens > 0) {
    chunk = std::min<int64_t>(chunk, std::max(options.max_chunk_tokens, options.min_chunk_tokens));
  }
  return std::min(chunk, max_length);
}

// Equal lengths: the chunk of 1, 2, 4, ... `max_pieces` pieces per request (at most `cap` keys,
// at least `min_chunk` when split) that a wave model says finishes first: ceil(CTAs / wave) waves,
// each as long as a chunk plus a CTA's fixed cost, plus the merge when split; a finer split is
// taken only where the model says it is 3% faster. The CTAs of a memory-bound decode run in waves
// closely enough for this: on an H200 (2026-12-02, docs/benchmarks.md) unsplit 48 x 4096 keys
// (1.45 waves of the bf16 kernel) took 212 us against 190 in chunks of 2048, and 64 x 4096 over
// fp8 (1.29 waves) 169 us against 145, while 64 x 4096 bf16 (1.94 waves) was fastest unsplit.
int64_t UniformChunkTokens(std::span<const int64_t> active_lengths, int32_t num_kv_heads,
                           int32_t wave, int64_t cap, int64_t min_chunk, int64_t max_pieces) {
  constexpr int64_t kCtaCostTokens = 64;     // a CTA's fixed cost (Q, pipeline fill, epilogue)
  constexpr int64_t kMergeCostTokens = 128;  // the partials' write and the merge launch
  const int64_t longest = *std::max_element(active_lengths.begin(), active_lengths.end());
  const int64_t granularity = kChunkGranularityTokens;
  const int64_t first = cap > 0 ? std::max<int64_t>(1, CeilDiv(longest, cap)) : 1;
  int64_t best_chunk = 0;
  int64_t best_cost = 0;
  for (int64_t pieces = first; pieces <= max_pieces * first; pieces *= 2) {
    const int64_t chunk = CeilDiv(CeilDiv(longest, pieces), granularity) * granularity;
    if (best_chunk > 0 && chunk < min_chunk) break;
    const int64_t waves = CeilDiv(CountCtas(active_lengths, chunk, num_kv_heads), wave);
    const int64_t cost =
        waves * (std::min(chunk, longest) + kCtaCostTokens) + (pieces > 1 ? kMergeCostTokens : 0);
    if (best_chunk == 0 || cost * 100 < best_cost * 97) {
      best_chunk = chunk;
      best_cost = cost;
    }
  }
  return std::min(best_chunk, longest);
}

// The chunk search's inputs for the tensor-core kernel (DecodePlanOptions::tensor_core_*): its
// wave divided by tensor_core_wave_divisor, and its own cap. For equal lengths (within 25% of
// each other), the chunk UniformChunkTokens picks instead: where the unsplit CTAs fill more than
// half the wave, any of 1-8 pieces per request, at most tensor_core_uniform_max_chunk_tokens; where
// they fill 1/16 to 1/2 of it, pieces of at least 1024 keys (up to 16 per request), taken only
// when split. A CTA of this kernel alone on an SM (4 warps) is bound by its own latency, so half
// a wave of long chunks leaves HBM idle: 8 x 4096 keys (Hq 32 / Hkv 8) took 53.0 us in 128 CTAs of
// 2048 keys against 36.3 in 256 of 1024 on an H200, Hq 28 / Hkv 4 at 16 x 4096 43.1 against
// 38.0; shorter pieces were no faster where the unsplit CTAs already stream well (16 x 1024:
// 19.9 us whole, 21.7 in halves).
DecodePlanOptions TensorCoreSizing(const DecodePlanOptions& options,
                                   std::span<const int64_t> active_lengths) {
  DecodePlanOptions sized = options;
  const int32_t wave = options.tensor_core_ctas_per_wave;
  sized.ctas_per_wave = wave > 0 ? std::max(1, wave / std::max(1, options.tensor_core_wave_divisor))
                                 : wave;
  sized.max_chunk_tokens = options.tensor_core_max_chunk_tokens;
  if (!active_lengths.empty() && wave > 0) {
    const auto [shortest, longest] =
        std::minmax_element(active_lengths.begin(), active_lengths.end());
    const bool uniform = *longest * 4 <= *shortest * 5;
    const int64_t unsplit_ctas =
        static_cast<int64_t>(active_lengths.size()) * options.num_kv_heads;
    // As a cap: the chunk search below takes it (the CTAs of any chunk up to it exceed half the
    // wave, or the smallest chunk within half the wave is this one).
    if (uniform && unsplit_ctas * 2 > wave) {
      sized.max_chunk_tokens = static_cast<int32_t>(UniformChunkTokens(
          active_lengths, options.num_kv_heads, wave, options.tensor_core_uniform_max_chunk_tokens,
          std::max<int64_t>(options.min_chunk_tokens, 1), 8));
    } else if (uniform && unsplit_ctas * 16 >= wave) {
      constexpr int64_t kSmallBatchMinChunk = 1024;
      const int64_t chunk = UniformChunkTokens(active_lengths, options.num_kv_heads, wave,
                                               options.tensor_core_uniform_max_chunk_tokens,
                                               kSmallBatchMinChunk, 16);
      if (chunk < *longest) sized.max_chunk_tokens = static_cast<int32_t>(chunk);
    }
  }
  return sized;
}

// The kernel of a batch of `num_requests` active requests reading `total_tokens` keys.
absl::StatusOr<DecodeKernel> ChooseKernel(int64_t num_requests, int64_t total_tokens,
                                          const DecodePlanOptions& options) {
  switch (options.kernel_choice) {
    case DecodeKernelChoice::kCudaCore:
      if (!options.cuda_core_supported) {
        return absl::InvalidArgumentError("kernel_choice: no CUDA-core decode kernel for the cache");
      }
      return DecodeKernel::kCudaCore;
    case DecodeKernelChoice::kTensorCore:
      if (!options.tensor_core_supported) {
        return absl::InvalidArgumentError("kernel_choice: no tensor-core decode kernel for the cache");
      }
      return DecodeKernel::kTensorCore;
    case DecodeKernelChoice::kAuto:
      break;
  }
  if (!options.cuda_core_supported && !options.tensor_core_supported) {
    return absl::InvalidArgumentError("no decode kernel for the cache");
  }
  if (!options.tensor_core_supported) return DecodeKernel::kCudaCore;
  if (!options.cuda_core_supported) return DecodeKernel::kTensorCore;
  if (options.deterministic) return DecodeKernel::kCudaCore;
  return num_requests >= options.tensor_core_min_requests &&
                 total_tokens >= options.tensor_core_min_total_kv_tokens
             ? DecodeKernel::kTensorCore
             : DecodeKernel::kCudaCore;
}

}  // namespace

absl::StatusOr<DecodePlan> PlanBatchDecode(std::span<const int32_t> qo_indptr,
                                           std::span<const int64_t> kv_lengths,
                                           const DecodePlanOptions& options) {
  const size_t batch_size = kv_lengths.size();
  if (qo_indptr.size() != batch_size + 1) {
    return absl::InvalidArgumentError(absl::StrCat("qo_indptr: expected ", batch_size + 1,
                                                   " entries, got ", qo_indptr.size()));
  }
  if (options.num_kv_heads <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_kv_heads: expected > 0, got ", options.num_kv_heads));
  }
  if (options.max_chunk_tokens < 0 || options.min_chunk_tokens < 0 ||
      options.tensor_core_max_chunk_tokens < 0 ||
      options.tensor_core_uniform_max_chunk_tokens < 0) {
    return absl::InvalidArgumentError(
        "max_chunk_tokens, tensor_core_max_chunk_tokens, tensor_core_uniform_max_chunk_tokens "
        "and min_chunk_tokens must be >= 0");
  }
  if (options.fixed_split_tokens < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("fixed_split_tokens: expected >= 0, got ", options.fixed_split_tokens));
  }

  // Active requests and the key range each reads.
  std::vector<int32_t> requests;
  std::vector<int64_t> begins, lengths;
  for (size_t b = 0; b < batch_size; ++b) {
    const int32_t rows = qo_indptr[b + 1] - qo_indptr[b];
    if (rows < 0 || rows > 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "qo_indptr: decode takes 0 or 1 query rows per request; request ", b, " has ", rows));
    }
    if (kv_lengths[b] < 0 || kv_lengths[b] > std::numeric_limits<int32_t>::max()) {
      return absl::InvalidArgumentError(
          absl::StrCat("kv_lengths[", b, "]: expected 0..2^31-1, got ", kv_lengths[b]));
    }
    if (rows == 0) continue;
    const int64_t begin = WindowBegin(kv_lengths[b], options.window_left);
    requests.push_back(static_cast<int32_t>(b));
    begins.push_back(begin);
    lengths.push_back(kv_lengths[b] - begin);
  }

  int64_t total_tokens = 0;
  for (int64_t length : lengths) total_tokens += length;
  ASSIGN_OR_RETURN(const DecodeKernel kernel,
                   ChooseKernel(static_cast<int64_t>(requests.size()), total_tokens, options));
  // The chunk search below sizes the grid by the chosen kernel's wave.
  const DecodePlanOptions sized =
      kernel == DecodeKernel::kTensorCore ? TensorCoreSizing(options, lengths) : options;
  const bool chunk_pinned =
      options.disable_split_kv || options.fixed_split_tokens > 0 || options.deterministic;
  if (!chunk_pinned && sized.ctas_per_wave <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        kernel == DecodeKernel::kTensorCore ? "tensor_core_ctas_per_wave" : "ctas_per_wave",
        ": expected > 0 (measured occupancy x SMs), got ", sized.ctas_per_wave));
  }

  DecodePlan plan;
  plan.kernel = kernel;
  plan.window_left = options.window_left;
  if (requests.empty()) return plan;

  int64_t chunk_tokens;
  if (options.disable_split_kv) {
    chunk_tokens = std::numeric_limits<int32_t>::max();
  } else if (options.fixed_split_tokens > 0) {
    chunk_tokens = options.fixed_split_tokens;
  } else if (options.deterministic) {
    chunk_tokens = kDeterministicChunkTokens;
  } else {
    chunk_tokens = ChooseChunkTokens(lengths, sized);
  }

  int64_t total_items = 0;
  for (int64_t length : lengths) total_items += std::max<int64_t>(1, CeilDiv(length, chunk_tokens));
  // Sized once and written by index: the arrays run to thousands of items for long requests.
  for (auto* array : {&plan.item_request, &plan.item_q_row, &plan.item_kv_begin, &plan.item_kv_end,
                      &plan.item_partial}) {
    array->resize(total_items);
  }
  plan.merge_q_row.reserve(requests.size());
  plan.merge_indptr.reserve(requests.size() + 1);
  int32_t* const item_request = plan.item_request.data();
  int32_t* const item_q_row = plan.item_q_row.data();
  int32_t* const item_kv_begin = plan.item_kv_begin.data();
  int32_t* const item_kv_end = plan.item_kv_end.data();
  int32_t* const item_partial = plan.item_partial.data();
  int64_t item = 0;
  int64_t max_length = 0;
  for (size_t i = 0; i < requests.size(); ++i) {
    const int32_t b = requests[i];
    const int32_t q_row = qo_indptr[b];
    const int64_t num_chunks = std::max<int64_t>(1, CeilDiv(lengths[i], chunk_tokens));
    max_length = std::max(max_length, lengths[i]);
    const int64_t end_of_request = begins[i] + lengths[i];
    for (int64_t c = 0; c < num_chunks; ++c, ++item) {
      const int64_t begin = begins[i] + c * chunk_tokens;
      item_request[item] = b;
      item_q_row[item] = q_row;
      item_kv_begin[item] = static_cast<int32_t>(begin);
      item_kv_end[item] = static_cast<int32_t>(std::min(end_of_request, begin + chunk_tokens));
      item_partial[item] = num_chunks == 1 ? -1 : plan.num_partials++;
    }
    if (num_chunks > 1) {
      plan.split_kv = true;
      plan.merge_q_row.push_back(q_row);
      plan.merge_indptr.push_back(plan.num_partials);
    }
  }
  plan.kv_chunk_tokens = static_cast<int32_t>(std::min(chunk_tokens, std::max<int64_t>(max_length, 1)));
  return plan;
}

int64_t DecodePlan::PackedWords() const {
  return 5 * static_cast<int64_t>(item_request.size()) +
         static_cast<int64_t>(merge_indptr.size() + merge_q_row.size());
}

void DecodePlan::PackInto(int32_t* out) const {
  for (const auto* array : {&item_request, &item_q_row, &item_kv_begin, &item_kv_end,
                            &item_partial, &merge_indptr, &merge_q_row}) {
    if (!array->empty()) std::memcpy(out, array->data(), array->size() * sizeof(int32_t));
    out += array->size();
  }
}

std::vector<int32_t> DecodePlan::Pack() const {
  std::vector<int32_t> packed(static_cast<size_t>(PackedWords()));
  PackInto(packed.data());
  return packed;
}

DecodeWorkView DecodePlan::View(const int32_t* packed) const {
  const int32_t items = num_items();
  DecodeWorkView view;
  view.num_items = items;
  view.item_request = packed;
  view.item_q_row = packed + items;
  view.item_kv_begin = packed + 2 * items;
  view.item_kv_end = packed + 3 * items;
  view.item_partial = packed + 4 * items;
  view.num_merge_rows = num_merge_rows();
  view.merge_indptr = packed + 5 * items;
  view.merge_q_row = view.merge_indptr + merge_indptr.size();
  view.num_partials = num_partials;
  view.window_left = window_left;
  view.kernel = kernel;
  view.kv_chunk_tokens = kv_chunk_tokens;
  return view;
}

std::vector<DecodePlanPart> SplitDecodePlanByRows(const DecodePlan& plan, int64_t num_rows,
                                                  int32_t parts) {
  const DecodePlanPart whole{0, num_rows, 0, plan.num_items(), 0, plan.num_merge_rows()};
  const int64_t count = std::min<int64_t>(std::max<int32_t>(parts, 1), std::max<int64_t>(num_rows, 1));
  if (count <= 1) return {whole};
  // Items and merge rows must come in row order for a row range to be one slice of each.
  if (!std::is_sorted(plan.item_q_row.begin(), plan.item_q_row.end()) ||
      !std::is_sorted(plan.merge_q_row.begin(), plan.merge_q_row.end())) {
    return {whole};
  }
  std::vector<DecodePlanPart> out;
  out.reserve(count);
  for (int64_t p = 0; p < count; ++p) {
    DecodePlanPart part;
    part.row_begin = num_rows * p / count;
    part.row_end = num_rows * (p + 1) / count;
    auto first_at_or_after = [](const std::vector<int32_t>& rows, int64_t row) {
      return static_cast<int32_t>(std::lower_bound(rows.begin(), rows.end(), row) - rows.begin());
    };
    part.item_begin = first_at_or_after(plan.item_q_row, part.row_begin);
    part.item_end = first_at_or_after(plan.item_q_row, part.row_end);
    part.merge_begin = first_at_or_after(plan.merge_q_row, part.row_begin);
    part.merge_end = first_at_or_after(plan.merge_q_row, part.row_end);
    out.push_back(part);
  }
  return out;
}

std::string DecodePlan::DebugString() const {
  std::string out = absl::StrCat("DecodePlan{kernel=",
                                 kernel == DecodeKernel::kTensorCore ? "tensor_core" : "cuda_core",
                                 ", chunk=", kv_chunk_tokens, " tokens, split=", split_kv,
                                 ", items=", num_items(), ", partials=", num_partials,
                                 ", merge_rows=", num_merge_rows(), ", window_left=", window_left);
  for (int32_t i = 0; i < num_items(); ++i) {
    absl::StrAppend(&out, "\n  item ", i, ": request ", item_request[i], " row ", item_q_row[i],
                    " keys [", item_kv_begin[i], ", ", item_kv_end[i], ") -> ",
                    item_partial[i] < 0 ? std::string("o") : absl::StrCat("partial ", item_partial[i]));
  }
  absl::StrAppend(&out, "}");
  return out;
}

}  // namespace attnd::plan
