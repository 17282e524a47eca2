// Fused RoPE + quantise + paged append (DESIGN 4.1): one launch takes a step's new tokens of one
// layer (a COO list of batch index and position), rotates q and k (neox halves or interleaved
// pairs over the first rotary_dim dims), stores k and v into their pages (value / scale, FP8
// saturating to +-448 with round to nearest even), and writes the rotated q for attention.
// Padding tokens (batch index -1) touch no byte, q_out rows included. Accesses are 16 bytes.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "absl/status/status.h"
#include "attnd/kernels/rope.h"
#include "attnd/kernels/views.h"

namespace attnd::cuda {

// All pointers are device memory. Tensors are 16-byte aligned; head dims are 8 times a power of
// two, at least 16 (64, 128, 256, 512, ...).
struct AppendKvArgs {
  AppendIndexView tokens;  // [T] batch index (-1 = padding) and position of each row
  PageTableView pages;     // indptr, k_indices, v_indices read (SEPARATE_KV: distinct arrays)
  RopeStyle rope_style = RopeStyle::kNone;
  const float* rope_inv_freq = nullptr;  // [rotary_dim / 2], from RopeInverseFrequencies
  int32_t rotary_dim = 0;                // even, <= head_dim, <= 256
  TokenHeadsView q_in;   // [T][num_qo_heads][head_dim] fp16/bf16; data may be null (no q)
  TokenHeadsView q_out;  // [T][num_qo_heads][head_dim], q_in's dtype
  TokenHeadsView k_in;   // [T][num_kv_heads][head_dim], q_in's dtype
  TokenHeadsView v_in;   // [T][num_kv_heads][head_dim]
  PagedKvView k_cache;   // fp16/bf16/fp8_e4m3, NHD or HND
  PagedKvView v_cache;   // same dtype and geometry
  float k_scale = 1.0f;
  float v_scale = 1.0f;
};

// Launches on `stream`; allocates nothing. The caller has validated every index and position.
absl::Status AppendKv(const AppendKvArgs& args, cudaStream_t stream);

// MLA: ckv rows are stored as they come (K pool, k_indices), kpe rows and q_pe rotate over their
// first rotary_dim dims (all rope_dim by default; V pool, v_indices).
struct AppendMlaArgs {
  AppendIndexView tokens;
  PageTableView pages;
  RopeStyle rope_style = RopeStyle::kNone;
  const float* rope_inv_freq = nullptr;  // [rotary_dim / 2]
  int32_t rotary_dim = 0;                // even, <= rope_dim; 0: rope_dim
  TokenHeadsView q_pe_in;   // [T][num_heads][rope_dim]; data may be null
  TokenHeadsView q_pe_out;  // [T][num_heads][rope_dim]
  TokenHeadsView ckv_in;    // [T][1][kv_lora_rank]
  TokenHeadsView kpe_in;    // [T][1][rope_dim]
  PagedKvView ckv_cache;    // num_heads 1, head_dim kv_lora_rank
  PagedKvView kpe_cache;    // num_heads 1, head_dim rope_dim
  float ckv_scale = 1.0f;
  float kpe_scale = 1.0f;
};

absl::Status AppendMla(const AppendMlaArgs& args, cudaStream_t stream);

}  // namespace attnd::cuda
