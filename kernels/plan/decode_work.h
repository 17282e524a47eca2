// The device-side view of an uploaded decode plan: what BatchDecode reads. Kept apart from
// decode_plan.h so CUDA translation units (compiled as C++17) can include it.
#pragma once

#include <cstdint>

namespace attnd::plan {

// The kernel that runs a decode plan (DecodePlan::kernel, chosen per batch by the planner).
enum class DecodeKernel : int32_t {
  // CUDA cores: each thread holds a slice of up to two query heads' rows in fp32 (groups 1..8,
  // fp16/bf16/fp8 caches, any q/KV type pair).
  kCudaCore = 0,
  // Tensor cores: the group's query heads, padded to 16, are the M of mma.sync m16n8k16
  // (groups 1..16; q and cache of one 16-bit type, or an fp8 cache). kernels/cuda/decode_tc.cuh.
  kTensorCore = 1,
};

// Device-side view of an uploaded plan (pointers into one Pack()ed buffer). Owns nothing.
struct DecodeWorkView {
  int32_t num_items = 0;
  const int32_t* item_request = nullptr;   // [num_items] batch index (page-table row)
  const int32_t* item_q_row = nullptr;     // [num_items] row of q, o and lse
  const int32_t* item_kv_begin = nullptr;  // [num_items] first token read
  const int32_t* item_kv_end = nullptr;    // [num_items] one past the last token read
  const int32_t* item_partial = nullptr;   // [num_items] partial slot, -1: writes o directly
  int32_t num_merge_rows = 0;
  const int32_t* merge_indptr = nullptr;   // [num_merge_rows + 1] into partial slots
  const int32_t* merge_q_row = nullptr;    // [num_merge_rows] row of o and lse
  int32_t num_partials = 0;
  int32_t window_left = -1;                // the window the plan was cut for
  DecodeKernel kernel = DecodeKernel::kCudaCore;  // which kernel BatchDecode launches
  int32_t kv_chunk_tokens = 0;             // the plan's chunk: no item reads more keys
};

// Items [item_begin, item_end) and merge rows [merge_begin, merge_end) of `view`: a launch of
// the slice runs exactly those items and merges, with the whole plan's partial slots (so
// num_partials, and with it the workspace, stays the whole plan's).
inline DecodeWorkView SliceDecodeWork(const DecodeWorkView& view, int32_t item_begin,
                                      int32_t item_end, int32_t merge_begin, int32_t merge_end) {
  DecodeWorkView slice = view;
  slice.num_items = item_end - item_begin;
  slice.item_request = view.item_request + item_begin;
  slice.item_q_row = view.item_q_row + item_begin;
  slice.item_kv_begin = view.item_kv_begin + item_begin;
  slice.item_kv_end = view.item_kv_end + item_begin;
  slice.item_partial = view.item_partial + item_begin;
  slice.num_merge_rows = merge_end - merge_begin;
  slice.merge_indptr = view.merge_indptr + merge_begin;
  slice.merge_q_row = view.merge_q_row + merge_begin;
  return slice;
}

}  // namespace attnd::plan
