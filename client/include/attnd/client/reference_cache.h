// A host-side mirror of an MHA/GQA cache that replays a client's steps through the CPU
// reference (kernels/reference) to predict what the server must return.
//
// Feed it the same PlanRequest and ForwardRequests sent to the server: it keeps its own pages
// (MANAGED: allocated here in the same all-or-nothing way; EXTERNAL: at the ids the plan names),
// appends k/v with reference::AppendKv (same RoPE tables, same rounding to kv_dtype) and runs
// reference::BatchAttention with float64 accumulation. Page ids need not match the server's:
// only the logical contents of every sequence matter.
//
// Not thread-safe. MLA caches are not mirrored (Create returns UNIMPLEMENTED).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "attnd/kernels/attention_params.h"
#include "attnd/kernels/dtype.h"
#include "attnd/kernels/rope.h"
#include "attnd/kernels/views.h"
#include "attnd/v1/attnd.pb.h"

namespace attnd::client {

struct ReferenceOutput {
  std::vector<float> o;    // [num_tokens, num_qo_heads, head_dim]
  std::vector<float> lse;  // [num_tokens, num_qo_heads]; empty unless the plan asked for it
};

class ReferenceCache {
 public:
  // `config` as the server reports it in CacheInfo (defaults resolved; num_pages set).
  static absl::StatusOr<std::unique_ptr<ReferenceCache>> Create(
      const attnd::v1::CacheConfig& config);

  // Opens a step like Plan does (one step at a time). MANAGED: allocates the new tokens' pages.
  absl::Status BeginStep(const attnd::v1::PlanRequest& plan);
  // One layer of the open step: appends its k/v and returns the expected o (and lse).
  absl::StatusOr<ReferenceOutput> Forward(const attnd::v1::ForwardRequest& request);
  // Commits (lengths advance) or, with abort, rolls back (lengths restored, fresh pages freed).
  void EndStep(bool abort);
  // MANAGED: drops the sequences and their pages.
  void FreeSequences(const std::vector<uint64_t>& sequence_ids);

  // MANAGED: tokens committed for `sequence_id` (0 when unknown).
  int64_t SequenceLength(uint64_t sequence_id) const;
  bool step_open() const { return step_open_; }
  DType q_dtype() const { return q_dtype_; }

 private:
  struct Sequence {
    std::vector<int32_t> pages;
    int64_t length = 0;
  };
  // The open step's batch, in the reference's CSR form.
  struct StepBatch {
    std::vector<int32_t> qo_indptr;
    std::vector<int32_t> page_indptr;
    std::vector<int32_t> k_pages;
    std::vector<int32_t> v_pages;
    std::vector<int32_t> last_page_len;
    std::vector<int32_t> token_batch;     // [num_tokens] entry of each row
    std::vector<int32_t> token_position;  // [num_tokens] position of each row
    std::vector<bool> layer_done;
    bool return_lse = false;
    AttentionParams params;
    // MANAGED rollback: lengths before the step and the pages it allocated.
    std::map<uint64_t, int64_t> old_lengths;
    std::map<uint64_t, size_t> old_page_counts;
  };

  ReferenceCache() = default;
  absl::Status PlanManaged(const attnd::v1::PlanRequest& plan);
  absl::Status PlanExternal(const attnd::v1::PlanRequest& plan);
  int32_t AllocatePage();
  PagedKvView Pool(int32_t layer, bool v) const;

  attnd::v1::CacheConfig config_;
  DType q_dtype_ = DType::kBFloat16;
  DType kv_dtype_ = DType::kBFloat16;
  KvLayout layout_ = KvLayout::kNHD;
  bool external_ = false;
  RopeStyle rope_style_ = RopeStyle::kNone;
  std::vector<float> rope_inv_freq_;

  int64_t num_pages_ = 0;                        // pages in each pool
  std::vector<int32_t> free_pages_;              // MANAGED: returned pages
  std::vector<std::vector<uint8_t>> k_pools_;    // [layer] -> pages (layout_), kv_dtype_
  std::vector<std::vector<uint8_t>> v_pools_;
  std::map<uint64_t, Sequence> sequences_;

  bool step_open_ = false;
  StepBatch step_;
};

}  // namespace attnd::client
