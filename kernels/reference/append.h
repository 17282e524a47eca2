// CPU reference of the fused RoPE + quantise + paged append (DESIGN 4.1).
#pragma once

#include <span>

#include "attnd/kernels/rope.h"
#include "attnd/kernels/views.h"

namespace attnd::reference {

// One step's new tokens of one layer (MHA/GQA).
struct AppendArgs {
  AppendIndexView tokens;  // row r of the inputs is token tokens.positions[r] of request
                           // tokens.batch_indices[r]; -1 rows are skipped entirely
  PageTableView pages;     // the batch's table, lengths including this step's tokens
  RopeStyle rope_style = RopeStyle::kNone;
  std::span<const float> rope_inv_freq;  // [rotary_dim / 2], from RopeInverseFrequencies
  TokenHeadsView q_in;   // [T][num_qo_heads][head_dim]; data may be null (no q to rotate)
  TokenHeadsView q_out;  // [T][num_qo_heads][head_dim], q dtype: q rotated for attention
  TokenHeadsView k_in;   // [T][num_kv_heads][head_dim]
  TokenHeadsView v_in;   // [T][num_kv_heads][head_dim]
  PagedKvView k_cache;   // the layer's K pool
  PagedKvView v_cache;   // the layer's V pool
  float k_scale = 1.0f;  // FP8 caches store value / scale, saturated to +-448. The division
  float v_scale = 1.0f;  // happens whatever the dtype, as attention's multiply does: pass 1
                         // for fp16/bf16 caches.
};

// Rotates the first rotary_dim dims of q and k by angle float(position) * inv_freq[i]
// (computed in float32, as the GPU does), stores k and v into their pages (quantising for FP8
// caches) and writes the rotated q. Padding rows (batch index -1) touch nothing, q_out rows
// included. The caller has validated every index.
void AppendKv(const AppendArgs& args);

// MLA: ckv rows are stored as they come; kpe and q_pe rotate.
struct MlaAppendArgs {
  AppendIndexView tokens;
  PageTableView pages;  // k_indices name ckv pages, v_indices kpe pages
  RopeStyle rope_style = RopeStyle::kNone;
  std::span<const float> rope_inv_freq;
  TokenHeadsView q_pe_in;   // [T][num_heads][rope_dim]; data may be null
  TokenHeadsView q_pe_out;  // [T][num_heads][rope_dim]
  TokenHeadsView ckv_in;    // [T][1][kv_lora_rank]
  TokenHeadsView kpe_in;    // [T][1][rope_dim]
  PagedKvView ckv_cache;    // num_heads 1, head_dim kv_lora_rank
  PagedKvView kpe_cache;    // num_heads 1, head_dim rope_dim
  float ckv_scale = 1.0f;
  float kpe_scale = 1.0f;
};

void AppendMla(const MlaAppendArgs& args);

// Rotates one head vector in place (float32 math, as AppendKv does). Exposed for tests.
void RotateHead(RopeStyle style, std::span<const float> inv_freq, int32_t position,
                std::span<float> head);

}  // namespace attnd::reference
