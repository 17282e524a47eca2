// The core of CPU attention (reference internals): a chunk of query rows against one stream of
// keys, tile by tile, with an online softmax. BatchAttention and MlaAttention differ only in
// where their rows and keys come from, which they pass in as loaders.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "attnd/kernels/attention_params.h"
#include "reference/tile_kernels.h"

namespace attnd::reference {

// Keys [begin, end) that one query row sees; empty when begin >= end.
struct KeyRange {
  int64_t begin = 0;
  int64_t end = 0;
  bool empty() const { return begin >= end; }
};

// Query i (0-based) of a request with q_len rows over kv_len keys (DESIGN 2): causal is
// bottom-right aligned, the window counts back from the query's absolute position.
inline KeyRange VisibleKeys(const AttentionParams& params, int64_t q_len, int64_t kv_len,
                            int64_t query) {
  const int64_t position = kv_len - q_len + query;
  KeyRange range{0, kv_len};
  if (params.causal) range.end = std::min(kv_len, position + 1);
  if (params.window_left >= 0) range.begin = std::max<int64_t>(0, position - params.window_left);
  return range;
}

inline int64_t RoundUp(int64_t value, int64_t multiple) {
  return (value + multiple - 1) / multiple * multiple;
}

// Keys per tile: a tile of K (transposed) and V stays in a core's L2 cache.
inline int64_t TileKeysFor(int32_t qk_dim) { return qk_dim <= 256 ? 128 : 64; }

// True when every one of values[0, count) is finite: v - v is 0 for a finite v and NaN for
// NaN and +-inf. Four independent integer ANDs, no branch per element (a few percent of a
// prefill's time at -O2, where the loop is not vectorised).
template <typename T>
inline bool AllFinite(const T* values, int64_t count) {
  int finite[4] = {1, 1, 1, 1};
  int64_t i = 0;
  for (; i + 4 <= count; i += 4) {
    for (int lane = 0; lane < 4; ++lane) {
      finite[lane] &= static_cast<int>(values[i + lane] - values[i + lane] == T{0});
    }
  }
  for (; i < count; ++i) finite[0] &= static_cast<int>(values[i] - values[i] == T{0});
  return (finite[0] & finite[1] & finite[2] & finite[3]) != 0;
}

// Scratch of one thread, reused across tasks so steady-state calls do not allocate.
template <typename T>
struct AttendWorkspace {
  std::vector<T> k_rows;  // [tile_keys][qk_dim]: the tile's keys as loaded
  std::vector<T> kt;      // [qk_dim][kt_stride]: the same keys, transposed
  std::vector<T> v;       // [tile_keys][v_dim_padded]
  std::vector<T> q;       // [num_rows][qk_dim]
  std::vector<T> o;       // [num_rows][v_dim_padded]: unnormalised output
  std::vector<T> max_score;
  std::vector<T> denominator;
  std::vector<T> scores;  // [kBlockRows][tile_keys]
  std::vector<T> probs;   // [kBlockRows][tile_keys]
  std::vector<KeyRange> ranges;
  std::vector<uint8_t> poisoned;  // [num_rows]: a score the row sees is not finite

  static AttendWorkspace& ForThisThread() {
    thread_local AttendWorkspace workspace;
    return workspace;
  }
};

// One chunk of rows. The loaders are called as:
//   load_q(row, T* out)                   // qk_dim values of the row's query
//   load_kv(first_key, num_keys, T* k, int64_t k_stride, T* v, int64_t v_stride)
//       // key k (of num_keys from first_key) into k[k * k_stride + d] and v[k * v_stride + d]
//   write_row(row, const T* o, T lse)     // v_dim normalised outputs (zeros, lse -inf when
//                                         // the row sees no key; NaN, lse NaN when an input
//                                         // it reads is not finite)
// Rows' ranges must be filled into workspace.ranges[0, num_rows) before the call.
//
// Non-finite inputs (DESIGN 4, both backends): NaN in, NaN out for the rows it touches. A row
// that sees at least one key and whose q, or the k or v of a key it sees, holds a NaN or an
// infinity gets o = NaN in every dim and lse = NaN; other rows are unaffected. Without this
// rule a NaN score would be skipped by the running max and the row would read as masked.
template <typename T, typename LoadQ, typename LoadKv, typename WriteRow>
void AttendChunk(AttendWorkspace<T>& ws, int64_t num_rows, int32_t qk_dim, int32_t v_dim,
                 const AttentionParams& params, LoadQ&& load_q, LoadKv&& load_kv,
                 WriteRow&& write_row) {
  const TileKernels<T>& kernels = GetTileKernels<T>();
  const int64_t tile_keys = TileKeysFor(qk_dim);
  // A row stride of a power of two bytes would map every kt row to the same few L1 sets.
  const int64_t kt_stride = tile_keys + kTileKeyQuantum;
  const int32_t v_dim_padded = static_cast<int32_t>(RoundUp(v_dim, kTileDimQuantum));
  const T sm_scale = static_cast<T>(params.sm_scale);
  const T soft_cap = static_cast<T>(params.logits_soft_cap);
  constexpr T kNegInf = -std::numeric_limits<T>::infinity();

  ws.k_rows.resize(static_cast<size_t>(tile_keys) * qk_dim);
  ws.kt.resize(static_cast<size_t>(qk_dim) * kt_stride);
  // Padding dims of V must be finite: they are multiplied into discarded output dims.
  ws.v.assign(static_cast<size_t>(tile_keys) * v_dim_padded, T{0});
  ws.q.resize(static_cast<size_t>(num_rows) * qk_dim);
  ws.o.assign(static_cast<size_t>(num_rows) * v_dim_padded, T{0});
  ws.max_score.assign(num_rows, kNegInf);
  ws.denominator.assign(num_rows, T{0});
  ws.poisoned.assign(num_rows, 0);
  ws.scores.resize(static_cast<size_t>(kBlockRows) * tile_keys);
  ws.probs.resize(static_cast<size_t>(kBlockRows) * tile_keys);

  int64_t first_key = std::numeric_limits<int64_t>::max();
  int64_t end_key = 0;
  for (int64_t row = 0; row < num_rows; ++row) {
    load_q(row, ws.q.data() + row * qk_dim);
    const KeyRange& range = ws.ranges[row];
    if (range.empty()) continue;
    first_key = std::min(first_key, range.begin);
    end_key = std::max(end_key, range.end);
  }

  // Tiles sit at multiples of tile_keys from key 0, so a row's reduction order depends only on
  // its own request, never on how rows were chunked.
  for (int64_t tile_begin = first_key < end_key ? first_key / tile_keys * tile_keys : end_key;
       tile_begin < end_key; tile_begin += tile_keys) {
    const int64_t tile_end = tile_begin + tile_keys;
    const int64_t load_begin = std::max(first_key, tile_begin);
    const int64_t load_end = std::min(end_key, tile_end);
    load_kv(load_begin, load_end - load_begin, ws.k_rows.data(), int64_t{qk_dim},
            ws.v.data() + (load_begin - tile_begin) * v_dim_padded, int64_t{v_dim_padded});
    kernels.transpose_keys(ws.k_rows.data(), qk_dim, load_end - load_begin, qk_dim,
                           ws.kt.data() + (load_begin - tile_begin), kt_stride);

    for (int64_t block = 0; block < num_rows; block += kBlockRows) {
      const int block_rows = static_cast<int>(std::min<int64_t>(kBlockRows, num_rows - block));
      // Each row's visible keys in this tile, relative to tile_begin.
      KeyRange local[kBlockRows];
      KeyRange block_union{tile_keys, 0};
      for (int r = 0; r < block_rows; ++r) {
        const KeyRange& range = ws.ranges[block + r];
        local[r] = {std::max(range.begin, tile_begin) - tile_begin,
                    std::min(range.end, tile_end) - tile_begin};
        if (ws.poisoned[block + r]) local[r] = {};  // NaN already: nothing more to add
        if (local[r].empty()) continue;
        block_union.begin = std::min(block_union.begin, local[r].begin);
        block_union.end = std::max(block_union.end, local[r].end);
      }
      if (block_union.empty()) continue;

      const T* q_rows[kBlockRows];
      T* score_rows[kBlockRows];
      T* prob_rows[kBlockRows];
      T* o_rows[kBlockRows];
      for (int r = 0; r < kBlockRows; ++r) {
        // Rows past the chunk's end repeat its first row into their own unused score slot.
        const int64_t row = block + (r < block_rows ? r : 0);
        q_rows[r] = ws.q.data() + row * qk_dim;
        score_rows[r] = ws.scores.data() + r * tile_keys;
        prob_rows[r] = ws.probs.data() + r * tile_keys;
        o_rows[r] = ws.o.data() + row * v_dim_padded;
      }
      kernels.score_block(q_rows, qk_dim, ws.kt.data(), kt_stride,
                          block_union.begin / kTileKeyQuantum * kTileKeyQuantum,
                          RoundUp(block_union.end, kTileKeyQuantum), score_rows);

      for (int r = 0; r < block_rows; ++r) {
        if (local[r].empty()) continue;
        T* scores = score_rows[r];
        // Checked before the soft cap, which would map an infinite score to a finite one. A
        // non-finite q or k makes the score non-finite (NaN times anything, inf times a
        // non-zero, inf times zero); such a row adds nothing more and is written as NaN.
        if (!AllFinite(scores + local[r].begin, local[r].end - local[r].begin)) {
          ws.poisoned[block + r] = 1;
          local[r] = {};
          continue;
        }
        const T tile_max =
            kernels.scale_scores(scores, local[r].begin, local[r].end, sm_scale, soft_cap);
        T& running_max = ws.max_score[block + r];
        if (!(tile_max > kNegInf)) {
          local[r] = {};  // every score -inf (infinite inputs): nothing to add
          continue;
        }
        if (tile_max > running_max) {
          if (running_max > kNegInf) {
            const T rescale = std::exp(running_max - tile_max);
            ws.denominator[block + r] *= rescale;
            T* o = o_rows[r];
            for (int32_t d = 0; d < v_dim_padded; ++d) o[d] *= rescale;
          }
          running_max = tile_max;
        }
        const T sum = kernels.exponentiate(scores, local[r].begin, local[r].end, running_max,
                                           prob_rows[r]);
        ws.denominator[block + r] += sum;
      }

      // One pass over V serves the whole block when its rows see the same keys (GQA heads of
      // one token); otherwise each row reads exactly its own keys, so a masked key's value
      // (even an infinite one) never meets a zero probability.
      bool same_keys = block_rows == kBlockRows;
      for (int r = 1; r < block_rows && same_keys; ++r)
        same_keys = local[r].begin == local[0].begin && local[r].end == local[0].end;
      if (same_keys && !local[0].empty()) {
        kernels.accumulate_block(kBlockRows, prob_rows, ws.v.data(), v_dim_padded, local[0].begin,
                                 local[0].end, v_dim_padded, o_rows);
      } else {
        for (int r = 0; r < block_rows; ++r) {
          if (local[r].empty()) continue;
          kernels.accumulate_block(1, prob_rows + r, ws.v.data(), v_dim_padded, local[r].begin,
                                   local[r].end, v_dim_padded, o_rows + r);
        }
      }
    }
  }

  for (int64_t row = 0; row < num_rows; ++row) {
    T* o = ws.o.data() + row * v_dim_padded;
    const T denominator = ws.denominator[row];
    // A non-finite v of a seen key leaves a NaN or inf in o (even times a zero probability).
    if (ws.poisoned[row] || (denominator > 0 && !AllFinite(o, v_dim))) {
      constexpr T kNaN = std::numeric_limits<T>::quiet_NaN();
      std::fill(o, o + v_dim, kNaN);
      write_row(row, static_cast<const T*>(o), kNaN);
    } else if (denominator > 0) {
      for (int32_t d = 0; d < v_dim; ++d) o[d] /= denominator;
      write_row(row, static_cast<const T*>(o), ws.max_score[row] + std::log(denominator));
    } else {
      write_row(row, static_cast<const T*>(o), kNegInf);  // o is still all zeros
    }
  }
}

}  // namespace attnd::reference
