// Views of the tensors the kernels read and write. A view owns nothing: the caller keeps the
// memory alive while a view of it is in use. The same structs describe host memory (reference
// kernels) and device memory (CUDA kernels); which one is the caller's contract.
#pragma once

#include <cstdint>

#include "attnd/kernels/dtype.h"

namespace attnd {

enum class KvLayout : int32_t {
  kNHD = 1,  // [page][token][head][dim]
  kHND = 2,  // [page][head][token][dim]
};

// A dense [num_tokens][num_heads][head_dim] tensor, row-major, no padding. MLA's per-token
// latent rows (ckv [T][512], kpe [T][64]) are views with num_heads = 1.
struct TokenHeadsView {
  void* data = nullptr;
  DType dtype = DType::kBFloat16;
  int64_t num_tokens = 0;
  int32_t num_heads = 0;
  int32_t head_dim = 0;

  int64_t Offset(int64_t token, int32_t head) const {
    return (token * num_heads + head) * static_cast<int64_t>(head_dim);
  }
  int64_t NumElements() const { return num_tokens * num_heads * static_cast<int64_t>(head_dim); }
};

// The view of `num_tokens` rows of `num_heads` x `head_dim` elements of `dtype` at `data`
// (a step's q/k/v/o buffers, which the view does not own).
inline TokenHeadsView RowsOf(const void* data, DType dtype, int64_t num_tokens, int32_t num_heads,
                             int32_t head_dim) {
  TokenHeadsView view;
  view.data = const_cast<void*>(data);
  view.dtype = dtype;
  view.num_tokens = num_tokens;
  view.num_heads = num_heads;
  view.head_dim = head_dim;
  return view;
}

// One layer's K (or V) pool. For MLA caches the K pool holds ckv (num_heads 1, head_dim
// kv_lora_rank) and the V pool holds kpe (num_heads 1, head_dim rope_dim).
struct PagedKvView {
  void* data = nullptr;  // [num_pages][page_size][num_heads][head_dim] (NHD) or
                         // [num_pages][num_heads][page_size][head_dim] (HND)
  DType dtype = DType::kBFloat16;
  KvLayout layout = KvLayout::kNHD;
  int64_t num_pages = 0;
  int32_t page_size = 0;
  int32_t num_heads = 0;
  int32_t head_dim = 0;

  int64_t PageElements() const {
    return static_cast<int64_t>(page_size) * num_heads * head_dim;
  }
  // Element offset of (page, entry in page, head), dim 0.
  int64_t Offset(int64_t page, int32_t entry, int32_t head) const {
    return layout == KvLayout::kNHD
               ? ((page * page_size + entry) * num_heads + head) * static_cast<int64_t>(head_dim)
               : ((page * num_heads + head) * page_size + entry) * static_cast<int64_t>(head_dim);
  }
};

// The batch's page table in CSR form. Token t of request b lives in page
// k_indices[indptr[b] + t / page_size] (V: v_indices[...]), entry t % page_size.
struct PageTableView {
  int32_t batch_size = 0;
  int32_t page_size = 0;
  const int32_t* indptr = nullptr;         // [batch_size + 1] into the index arrays
  const int32_t* k_indices = nullptr;      // [indptr[batch_size]] page ids in the K pool
  const int32_t* v_indices = nullptr;      // [indptr[batch_size]]; == k_indices for SHARED
  const int32_t* last_page_len = nullptr;  // [batch_size] tokens in the last page (0 if none)

  int32_t NumPages(int32_t b) const { return indptr[b + 1] - indptr[b]; }
  int64_t KvLength(int32_t b) const {
    const int32_t pages = NumPages(b);
    return pages == 0 ? 0 : static_cast<int64_t>(pages - 1) * page_size + last_page_len[b];
  }
};

// New tokens in COO form: one entry per row of the step's q/k/v tensors.
struct AppendIndexView {
  int64_t num_tokens = 0;
  const int32_t* batch_indices = nullptr;  // [num_tokens] request of each row; -1 = padding
  const int32_t* positions = nullptr;      // [num_tokens] position of each row in its sequence
};

}  // namespace attnd
