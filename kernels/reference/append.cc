#include "reference/append.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "reference/convert.h"
#include "reference/parallel.h"

namespace attnd::reference {
namespace {

constexpr int64_t kRowsPerTask = 16;

// cos/sin of one position's rotary pairs, computed in float32 as the GPU does.
struct RopeAngles {
  std::vector<float> cos;
  std::vector<float> sin;

  void Compute(std::span<const float> inv_freq, int32_t position) {
    cos.resize(inv_freq.size());
    sin.resize(inv_freq.size());
    for (size_t i = 0; i < inv_freq.size(); ++i) {
      const float angle = static_cast<float>(position) * inv_freq[i];
      cos[i] = std::cos(angle);
      sin[i] = std::sin(angle);
    }
  }
};

void Rotate(RopeStyle style, const RopeAngles& angles, std::span<float> head) {
  if (style == RopeStyle::kNone) return;
  // Pairs that do not fit the head are ignored rather than read out of bounds.
  const size_t pairs = std::min(angles.cos.size(), head.size() / 2);
  for (size_t i = 0; i < pairs; ++i) {
    const size_t first = style == RopeStyle::kNeox ? i : 2 * i;
    const size_t second = style == RopeStyle::kNeox ? i + angles.cos.size() : 2 * i + 1;
    if (second >= head.size()) break;
    const float x = head[first];
    const float y = head[second];
    head[first] = x * angles.cos[i] - y * angles.sin[i];
    head[second] = x * angles.sin[i] + y * angles.cos[i];
  }
}

const void* TensorRow(const TokenHeadsView& view, int64_t token, int32_t head) {
  return static_cast<const uint8_t*>(view.data) + view.Offset(token, head) * DTypeBytes(view.dtype);
}

// Loads one head of `in`, rotates it when `style` says so, and stores it with `store`.
template <typename Store>
void TransformHead(const TokenHeadsView& in, int64_t token, int32_t head, RopeStyle style,
                   const RopeAngles& angles, std::vector<float>& scratch, Store&& store) {
  scratch.resize(in.head_dim);
  ConvertRow<float>(in.dtype, TensorRow(in, token, head), in.head_dim, 1.0f, scratch.data());
  Rotate(style, angles, scratch);
  store(scratch);
}

// Writes one head into its slot of a pool, storing value / scale (FP8 saturates in the
// conversion).
void StoreToPool(const PagedKvView& pool, int64_t page, int32_t entry, int32_t head,
                 std::span<const float> values, float scale) {
  const int64_t base = pool.Offset(page, entry, head);
  for (size_t d = 0; d < values.size(); ++d)
    StoreFromFloat(pool.dtype, pool.data, base + static_cast<int64_t>(d), values[d] / scale);
}

void StoreToTensor(const TokenHeadsView& out, int64_t token, int32_t head,
                   std::span<const float> values) {
  const int64_t base = out.Offset(token, head);
  for (size_t d = 0; d < values.size(); ++d)
    StoreFromFloat(out.dtype, out.data, base + static_cast<int64_t>(d), values[d]);
}

struct Slot {
  int64_t k_page;
  int64_t v_page;
  int32_t entry;
};

Slot SlotOf(const PageTableView& pages, int32_t request, int32_t position) {
  const int64_t index = pages.indptr[request] + position / pages.page_size;
  return {pages.k_indices[index], pages.v_indices[index], position % pages.page_size};
}

// Runs `row_fn(row, angles, scratch)` for every non-padding row, spread over the pool.
template <typename RowFn>
void ForEachTokenRow(const AppendIndexView& tokens, RopeStyle style,
                     std::span<const float> inv_freq, RowFn&& row_fn) {
  const int64_t num_tasks = (tokens.num_tokens + kRowsPerTask - 1) / kRowsPerTask;
  ParallelFor(num_tasks, [&](int64_t task) {
    RopeAngles angles;
    std::vector<float> scratch;
    const int64_t end = std::min(tokens.num_tokens, (task + 1) * kRowsPerTask);
    for (int64_t row = task * kRowsPerTask; row < end; ++row) {
      if (tokens.batch_indices[row] < 0) continue;  // padding: touch nothing
      if (style != RopeStyle::kNone) angles.Compute(inv_freq, tokens.positions[row]);
      row_fn(row, angles, scratch);
    }
  });
}

}  // namespace

void RotateHead(RopeStyle style, std::span<const float> inv_freq, int32_t position,
                std::span<float> head) {
  if (style == RopeStyle::kNone) return;
  RopeAngles angles;
  angles.Compute(inv_freq, position);
  Rotate(style, angles, head);
}

void AppendKv(const AppendArgs& args) {
  ForEachTokenRow(args.tokens, args.rope_style, args.rope_inv_freq,
                  [&](int64_t row, const RopeAngles& angles, std::vector<float>& scratch) {
    const Slot slot = SlotOf(args.pages, args.tokens.batch_indices[row], args.tokens.positions[row]);
    if (args.q_in.data != nullptr) {
      for (int32_t head = 0; head < args.q_in.num_heads; ++head) {
        TransformHead(args.q_in, row, head, args.rope_style, angles, scratch,
                      [&](std::span<const float> q) { StoreToTensor(args.q_out, row, head, q); });
      }
    }
    for (int32_t head = 0; head < args.k_in.num_heads; ++head) {
      TransformHead(args.k_in, row, head, args.rope_style, angles, scratch,
                    [&](std::span<const float> k) {
                      StoreToPool(args.k_cache, slot.k_page, slot.entry, head, k, args.k_scale);
                    });
      TransformHead(args.v_in, row, head, RopeStyle::kNone, angles, scratch,
                    [&](std::span<const float> v) {
                      StoreToPool(args.v_cache, slot.v_page, slot.entry, head, v, args.v_scale);
                    });
    }
  });
}

void AppendMla(const MlaAppendArgs& args) {
  ForEachTokenRow(args.tokens, args.rope_style, args.rope_inv_freq,
                  [&](int64_t row, const RopeAngles& angles, std::vector<float>& scratch) {
    const Slot slot = SlotOf(args.pages, args.tokens.batch_indices[row], args.tokens.positions[row]);
    if (args.q_pe_in.data != nullptr) {
      for (int32_t head = 0; head < args.q_pe_in.num_heads; ++head) {
        TransformHead(args.q_pe_in, row, head, args.rope_style, angles, scratch,
                      [&](std::span<const float> q) { StoreToTensor(args.q_pe_out, row, head, q); });
      }
    }
    TransformHead(args.ckv_in, row, 0, RopeStyle::kNone, angles, scratch,
                  [&](std::span<const float> ckv) {
                    StoreToPool(args.ckv_cache, slot.k_page, slot.entry, 0, ckv, args.ckv_scale);
                  });
    TransformHead(args.kpe_in, row, 0, args.rope_style, angles, scratch,
                  [&](std::span<const float> kpe) {
                    StoreToPool(args.kpe_cache, slot.v_page, slot.entry, 0, kpe, args.kpe_scale);
                  });
  });
}

}  // namespace attnd::reference
