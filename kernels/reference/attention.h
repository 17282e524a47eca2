// CPU reference of batched attention over the paged cache (DESIGN 4.2-4.4, 4.6): the oracle
// for every GPU kernel, and the CPU backend's implementation.
#pragma once

#include <cstdint>

#include "attnd/kernels/attention_params.h"
#include "attnd/kernels/views.h"

namespace attnd::reference {

// Precision of the softmax state and dot products. kFloat64 is the oracle for GPU tests.
enum class Accumulation { kFloat32, kFloat64 };

// A mixed prefill/decode batch of MHA/GQA attention. Request b owns q rows
// [qo_indptr[b], qo_indptr[b+1]) and keys [0, pages.KvLength(b)); a request with no rows is a
// padding slot and writes nothing.
struct BatchAttentionArgs {
  TokenHeadsView q;                   // [T_q][num_qo_heads][head_dim], already rotated
  const int32_t* qo_indptr = nullptr; // [pages.batch_size + 1]
  PageTableView pages;
  PagedKvView k_cache;
  PagedKvView v_cache;
  AttentionParams params;
  TokenHeadsView o;       // [T_q][num_qo_heads][head_dim]; fully masked rows get 0
  float* lse = nullptr;   // [T_q][num_qo_heads] natural log, -inf when fully masked; optional
  Accumulation accumulation = Accumulation::kFloat32;
};

// Query head h reads kv head h / (num_qo_heads / num_kv_heads). Work is spread over the
// machine's cores (parallel.h); calls may come from several threads at once. A request's o and
// lse depend only on its own rows and keys, never on the rest of the batch (bitwise, for a
// given accumulation and CPU).
void BatchAttention(const BatchAttentionArgs& args);

// MLA, absorbed form: score = sm_scale * (q_nope . ckv * ckv_scale + q_pe . kpe * kpe_scale),
// o = sum p * ckv * ckv_scale, in latent space (kv_lora_rank wide).
struct MlaAttentionArgs {
  TokenHeadsView q_nope;              // [T_q][num_heads][kv_lora_rank]
  TokenHeadsView q_pe;                // [T_q][num_heads][rope_dim], already rotated
  const int32_t* qo_indptr = nullptr; // [pages.batch_size + 1]
  PageTableView pages;                // k_indices: ckv pages; v_indices: kpe pages
  PagedKvView ckv_cache;
  PagedKvView kpe_cache;
  AttentionParams params;             // k_scale applies to ckv, v_scale to kpe
  TokenHeadsView o;                   // [T_q][num_heads][kv_lora_rank]
  float* lse = nullptr;               // [T_q][num_heads], optional
  Accumulation accumulation = Accumulation::kFloat32;
};

void MlaAttention(const MlaAttentionArgs& args);

}  // namespace attnd::reference
