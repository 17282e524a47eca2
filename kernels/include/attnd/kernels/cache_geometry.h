// Geometry of one cache's pools, fully resolved (no defaults left), and the one rule that maps
// it to memory. Shared by the CPU backend (the oracle) and the CUDA backend, so their pools
// cannot drift apart.
#pragma once

#include <cstdint>

#include "attnd/kernels/dtype.h"
#include "attnd/kernels/rope.h"
#include "attnd/kernels/views.h"

namespace attnd {

// Storage is one region per layer and pool: layer l holds its K pool then its V pool, each
// num_pages pages. MLA caches keep ckv in the K pool (k_head_dim = kv_lora_rank) and kpe in the
// V pool (v_head_dim = rope_dim), one "head".
struct CacheGeometry {
  bool mla = false;
  int32_t num_layers = 0;
  int32_t num_qo_heads = 0;
  int32_t num_kv_heads = 0;  // 1 for MLA
  int32_t k_head_dim = 0;    // MHA: head_dim; MLA: kv_lora_rank
  int32_t v_head_dim = 0;    // MHA: head_dim; MLA: rope_dim
  int32_t page_size = 0;
  int64_t num_pages = 0;
  DType kv_dtype = DType::kBFloat16;
  DType q_dtype = DType::kBFloat16;
  KvLayout layout = KvLayout::kNHD;
  float k_scale = 1.0f;
  float v_scale = 1.0f;
  RopeConfig rope;  // rotary_dim resolved

  int64_t KPageBytes() const {
    return int64_t{page_size} * num_kv_heads * k_head_dim * DTypeBytes(kv_dtype);
  }
  int64_t VPageBytes() const {
    return int64_t{page_size} * num_kv_heads * v_head_dim * DTypeBytes(kv_dtype);
  }
  // One page id across every layer, K and V.
  int64_t BytesPerPage() const { return (KPageBytes() + VPageBytes()) * num_layers; }
  int64_t PoolBytes() const { return BytesPerPage() * num_pages; }
  // Bytes of one layer's region (its K pool and its V pool).
  int64_t LayerBytes() const { return num_pages * (KPageBytes() + VPageBytes()); }

  // The view of `layer`'s K pool (V pool when `v_pool`) inside `storage`, the cache's
  // PoolBytes() bytes (host or device memory; the view does not own it).
  PagedKvView Pool(void* storage, int32_t layer, bool v_pool) const {
    uint8_t* base = static_cast<uint8_t*>(storage) + layer * LayerBytes();
    if (v_pool) base += num_pages * KPageBytes();
    PagedKvView view;
    view.data = base;
    view.dtype = kv_dtype;
    view.layout = layout;
    view.num_pages = num_pages;
    view.page_size = page_size;
    view.num_heads = num_kv_heads;
    view.head_dim = v_pool ? v_head_dim : k_head_dim;
    return view;
  }
};

}  // namespace attnd
