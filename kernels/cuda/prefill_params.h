// What one launch of the batch prefill kernel reads: plain device pointers and resolved scalars,
// passed by value. Built by the launcher (prefill.cc) from the public views; the kernel
// templates (prefill_kernel.cuh) and the per-head-dim instantiation files share it.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "attnd/kernels/dtype.h"

namespace attnd::cuda::prefill {

// One CTA's work. mma.sync kernels: times num_kv_heads (CTA x works on item x / num_kv_heads,
// kv head x % num_kv_heads); the Hopper kernel: one item per KV head (kv_head). Rows are packed
// (token, head-in-group): packed row r of a request is token r / group_size, query head
// kv_head * group_size + r % group_size.
struct WorkItem {
  int32_t request;
  int32_t packed_row_start;  // first packed row of the query tile
  int32_t kv_chunk_start;    // keys [kv_chunk_start, kv_chunk_end) of the request
  int32_t kv_chunk_end;
  int32_t partial_first;     // -1: write o and lse; else token t -> slot first + t * stride
  int32_t partial_stride;
  int32_t kv_head;  // Hopper kernel: the item's KV head (one item per head); mma.sync: unused
  int32_t reserved;
};
static_assert(sizeof(WorkItem) == 32, "WorkItem is two 16-byte loads");

struct KernelParams {
  const void* q;         // [T_q][num_qo_heads][head_dim], q dtype
  void* o;               // [T_q][num_qo_heads][head_dim], q dtype
  float* lse;            // [T_q][num_qo_heads] natural log; may be null
  const void* k_pool;    // [num_pages][page_size][num_kv_heads][head_dim] (NHD) or
  const void* v_pool;    // [num_pages][num_kv_heads][page_size][head_dim] (HND), kv dtype
  const int32_t* qo_indptr;      // [batch + 1]
  const int32_t* page_indptr;    // [batch + 1]
  const int32_t* k_page_ids;     // [page_indptr[batch]]
  const int32_t* v_page_ids;     // == k_page_ids for a SHARED table
  const int32_t* last_page_len;  // [batch]
  const WorkItem* items;         // this launch's items (see PrefillPlan::items)
  float* partial_o;              // [num_partials][num_qo_heads][head_dim] fp32, split items only
  float* partial_lse;            // [num_partials][num_qo_heads] natural log
  int32_t kv_page_stride;   // elements between pages
  int32_t kv_entry_stride;  // elements between tokens of a page
  int32_t kv_head_stride;   // elements between heads of a token
  int32_t num_qo_heads;
  int32_t num_kv_heads;
  int32_t group_size;       // num_qo_heads / num_kv_heads
  // FastDivider::MultiplierOf(group_size) (the Hopper kernel divides by it without holding a
  // register for it).
  uint32_t group_multiplier;
  int32_t page_size_log2;   // page sizes are powers of two
  // score_log2 = log2(e) * f(sm_scale * k_scale * q.k) with f the soft cap (or identity).
  float score_scale;        // sm_scale * k_scale
  float soft_cap;           // 0: none
  float v_scale;
  int32_t window_left;      // -1: none
  bool causal;
  int32_t num_work;         // Hopper kernel (persistent): CTAs' worth of work, one item each
  // Hopper kernel: the grid the items' order was balanced for (item r * balanced_grid + b is CTA
  // b's r-th work); on any other grid the CTAs snake through the items.
  int32_t balanced_grid;
  // Hopper kernel: null, or works handed out on demand. The main grid's CTA b takes work b
  // first (counter_base = that grid's size); every later work, and a tail grid's first ones
  // (first_from_counter), is counter_base + the next value of work_counter[0] (zero before the
  // launch), taken as a CTA gets there instead of from the layout's fixed place. Every grid
  // that shares the counter (counter_ctas CTAs in all) counts its CTAs' ends in
  // work_counter[1]; the last to end zeroes both words for the next launch.
  int32_t* work_counter;
  int32_t counter_ctas;
  int32_t counter_base;
  bool first_from_counter;
};

// Launches the kernel of one (head_dim, query tile, q dtype, kv dtype) on `num_ctas` CTAs, or,
// when `ctas_per_sm` is set, only reports how many of its CTAs one SM holds. Each of the three
// files prefill_d{64,128,256}.cu instantiates one head_dim, so builds compile them in parallel.
cudaError_t LaunchPrefillD64(const KernelParams& params, int32_t tile_rows, DType q_dtype,
                             DType kv_dtype, int32_t num_ctas, cudaStream_t stream, int* ctas_per_sm);
cudaError_t LaunchPrefillD128(const KernelParams& params, int32_t tile_rows, DType q_dtype,
                              DType kv_dtype, int32_t num_ctas, cudaStream_t stream, int* ctas_per_sm);
cudaError_t LaunchPrefillD256(const KernelParams& params, int32_t tile_rows, DType q_dtype,
                              DType kv_dtype, int32_t num_ctas, cudaStream_t stream, int* ctas_per_sm);

// The Hopper kernel (prefill_hopper.cu, sm_90a only): 128 packed query rows per CTA, q, o and
// the cache of one 16-bit type, head_dim 64, 128 or 256, any page size and layout.
constexpr bool HopperPrefillSupports(int32_t head_dim, DType q_dtype, DType kv_dtype) {
  return (head_dim == 64 || head_dim == 128 || head_dim == 256) && q_dtype == kv_dtype &&
         (q_dtype == DType::kBFloat16 || q_dtype == DType::kFloat16);
}
inline constexpr int32_t kHopperTileRows = 128;

// Launches the Hopper kernel over `num_ctas` CTAs' worth of work (items x KV heads) on
// min(num_ctas, grid_ctas) persistent CTAs (grid_ctas 0: one CTA each), or reports its resident
// CTAs per SM (as LaunchPrefillD*). Defined only when the build includes sm_90a code
// (ATTND_PREFILL_HOPPER); runs only on compute capability 9.0. short_works (the launch's,
// plan::PrefillLaunch::short_works): the head_dim 128 kernel pipelines its tile loop across works
// (hopper::ConsumeWorks's kAcrossWorks); ignored on demand and at other head dims.
cudaError_t LaunchPrefillHopper(const KernelParams& params, int32_t head_dim, DType dtype, int32_t num_ctas,
                                int32_t grid_ctas, cudaStream_t stream, int* ctas_per_sm,
                                bool short_works = false);

}  // namespace attnd::cuda::prefill
