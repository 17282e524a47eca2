// The device-side view of an uploaded MLA decode plan: what MlaDecode reads. Kept apart from
// mla_plan.h so CUDA translation units (compiled as C++17) can include it.
#pragma once

#include <cstdint>

namespace attnd::plan {

// Rows (query token, head) one MLA decode CTA computes: the MMA M dimension of the kernel. The
// planner cuts each request's rows (q_len * num_heads) into tiles of this many.
inline constexpr int32_t kMlaRowsPerCta = 64;
// Keys the mma.sync kernel streams per shared-memory tile.
inline constexpr int32_t kMlaTileTokens = 32;
// Planner-chosen chunks are multiples of this: the wide-tile Hopper kernel's 64-key tile (and
// MLA's usual page), so that no chunk ends in a part-filled tile and, with pages of 64+ keys,
// every whole tile of a chunk lies in one page (the kernel's TMA loads).
inline constexpr int32_t kMlaChunkTokens = 64;
static_assert(kMlaChunkTokens % kMlaTileTokens == 0, "chunks of whole tiles of either kernel");

// One CTA's work: rows [row_begin, row_begin + kMlaRowsPerCta) of one request against keys
// [kv_begin, kv_end). A request's rows are token-major: row r is query token r / num_heads,
// head r % num_heads. request < 0 marks a unit that does nothing (exits at once).
struct alignas(16) MlaWorkUnit {
  int32_t request = -1;        // page-table row
  int32_t q_row = 0;           // q/o row of the request's first query token
  int32_t q_len = 0;           // the request's query tokens
  int32_t kv_len = 0;          // the request's keys (causal frame: token i sits at kv_len - q_len + i)
  int32_t row_begin = 0;       // first (token, head) row of this CTA
  int32_t kv_begin = 0;        // keys of the chunk
  int32_t kv_end = 0;
  int32_t partial_first = -1;  // -1: writes o and lse; else token t -> slot first + t * stride
  int32_t partial_stride = 0;
  int32_t reserved[3] = {0, 0, 0};
};
static_assert(sizeof(MlaWorkUnit) == 48, "three 16-byte loads; Pack() relies on 12 int32s");

// Pointers into one Pack()ed buffer (16-byte aligned, typically device memory). Owns nothing.
struct MlaWorkView {
  int32_t num_units = 0;
  const MlaWorkUnit* units = nullptr;      // [num_units], launch order
  int32_t num_merge_rows = 0;
  const int32_t* merge_indptr = nullptr;   // [num_merge_rows + 1] into partial slots
  const int32_t* merge_q_row = nullptr;    // [num_merge_rows] row of o and lse
  int32_t num_partials = 0;                // slots of [num_heads][kv_lora_rank] fp32
};

}  // namespace attnd::plan
