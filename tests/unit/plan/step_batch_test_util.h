// Steps built the way the engine builds them, for the planner tests (tests/unit/plan) and the
// GPU tests (tests/kernels/: the CUDA backend's and the prefill launcher's). Plain C++.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <memory>
#include <numeric>
#include <ostream>
#include <random>
#include <stdexcept>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "attnd/kernels/cache_geometry.h"
#include "attnd/kernels/step_batch.h"
#include "plan/prefill_plan.h"

namespace attnd::testing {

// The engine's managed-page bookkeeping and StepBatch construction (server/engine/plan.cc),
// with pages handed out in a shuffled order so requests' pages are scattered. SEPARATE_KV tables
// draw V pages from their own shuffled list, as an external block manager would.
class SequenceBook {
 public:
  SequenceBook(const CacheGeometry& geometry, bool separate_kv, uint32_t seed)
      : page_size_(geometry.page_size), separate_kv_(separate_kv) {
    std::mt19937 rng(seed);
    for (auto* free : {&k_free_, &v_free_}) {
      free->resize(geometry.num_pages);
      std::iota(free->begin(), free->end(), 0);
      std::shuffle(free->begin(), free->end(), rng);
    }
  }

  // entries: {sequence id, new tokens}; 0 tokens is a padding slot.
  std::shared_ptr<StepBatch> Plan(const std::vector<std::pair<int, int32_t>>& entries,
                                  const StepOptions& options) {
    auto batch = std::make_shared<StepBatch>();
    batch->batch_size = static_cast<int32_t>(entries.size());
    batch->options = options;
    batch->qo_indptr.push_back(0);
    batch->page_indptr.push_back(0);
    bool decode = false;
    bool prefill = false;
    for (size_t i = 0; i < entries.size(); ++i) {
      const auto [id, new_tokens] = entries[i];
      int64_t kv_len = 0;
      if (new_tokens > 0) {
        Sequence& sequence = sequences_[id];
        const int64_t start = sequence.length;
        sequence.length += new_tokens;
        kv_len = sequence.length;
        while (static_cast<int64_t>(sequence.k_pages.size()) * page_size_ < kv_len) {
          sequence.k_pages.push_back(Take(k_free_));
          sequence.v_pages.push_back(separate_kv_ ? Take(v_free_) : sequence.k_pages.back());
        }
        batch->k_page_indices.insert(batch->k_page_indices.end(), sequence.k_pages.begin(),
                                     sequence.k_pages.end());
        batch->v_page_indices.insert(batch->v_page_indices.end(), sequence.v_pages.begin(),
                                     sequence.v_pages.end());
        for (int32_t t = 0; t < new_tokens; ++t) {
          batch->token_batch_indices.push_back(static_cast<int32_t>(i));
          batch->token_positions.push_back(static_cast<int32_t>(start + t));
        }
        decode |= new_tokens == 1;
        prefill |= new_tokens > 1;
      }
      batch->num_tokens += new_tokens;
      batch->qo_indptr.push_back(batch->qo_indptr.back() + new_tokens);
      batch->page_indptr.push_back(static_cast<int32_t>(batch->k_page_indices.size()));
      const int64_t pages = (kv_len + page_size_ - 1) / page_size_;
      batch->last_page_len.push_back(
          pages == 0 ? 0 : static_cast<int32_t>(kv_len - (pages - 1) * page_size_));
    }
    batch->phase = decode && prefill ? StepPhase::kMixed
                   : prefill         ? StepPhase::kPrefill
                   : decode          ? StepPhase::kDecode
                                     : StepPhase::kEmpty;
    return batch;
  }

 private:
  struct Sequence {
    std::vector<int32_t> k_pages;
    std::vector<int32_t> v_pages;
    int64_t length = 0;
  };
  static int32_t Take(std::vector<int32_t>& free) {
    if (free.empty()) throw std::length_error("SequenceBook: the geometry's pages ran out");
    const int32_t page = free.back();
    free.pop_back();
    return page;
  }

  int32_t page_size_;
  bool separate_kv_;
  std::vector<int32_t> k_free_;
  std::vector<int32_t> v_free_;
  std::map<int, Sequence> sequences_;
};

struct MlaCacheConfig {
  std::string name;
  DType q_dtype = DType::kBFloat16;
  DType kv_dtype = DType::kBFloat16;
  int32_t kv_lora_rank = 512;
  int32_t num_heads = 16;
  int32_t page_size = 64;
  RopeStyle rope = RopeStyle::kNeox;
  int32_t rotary_dim = 0;  // 0: rope_dim
  bool separate_kv = false;
  float k_scale = 1.0f;  // ckv
  float v_scale = 1.0f;  // kpe
  int32_t num_layers = 3;
};

// gtest prints a parameter in test listings and failures; without this, as raw bytes
// (padding included), which change from build to build. Beside the type, for ADL.
inline void PrintTo(const MlaCacheConfig& c, std::ostream* os) { *os << c.name; }

inline CacheGeometry MlaGeometryOf(const MlaCacheConfig& config) {
  CacheGeometry g;
  g.mla = true;
  g.num_layers = config.num_layers;
  g.num_qo_heads = config.num_heads;
  g.num_kv_heads = 1;
  g.k_head_dim = config.kv_lora_rank;
  g.v_head_dim = 64;
  g.page_size = config.page_size;
  g.num_pages = 1024 / config.page_size + 16;
  g.kv_dtype = config.kv_dtype;
  g.q_dtype = config.q_dtype;
  g.k_scale = config.k_scale;
  g.v_scale = config.v_scale;
  g.rope.style = config.rope;
  g.rope.theta = 10000.0;
  g.rope.rotary_dim =
      config.rope == RopeStyle::kNone ? 0 : (config.rotary_dim > 0 ? config.rotary_dim : 64);
  return g;
}

inline StepOptions MlaOptions(const CacheGeometry& g) {
  StepOptions options;
  options.params.sm_scale = 1.0f / std::sqrt(192.0f);
  options.params.k_scale = g.k_scale;
  options.params.v_scale = g.v_scale;
  options.return_lse = true;
  return options;
}

// The prefill planner's input over these arrays (which must outlive it), no wave sizes.
inline plan::PrefillPlanInput Input(std::span<const int32_t> qo_indptr, std::span<const int32_t> kv_lengths,
                             int32_t num_qo_heads, int32_t num_kv_heads, int32_t head_dim) {
  plan::PrefillPlanInput input;
  input.qo_indptr = qo_indptr;
  input.kv_lengths = kv_lengths;
  input.num_qo_heads = num_qo_heads;
  input.num_kv_heads = num_kv_heads;
  input.head_dim = head_dim;
  return input;
}

}  // namespace attnd::testing
