// A step's batch in the form the kernels and the planners take: built once by the engine at
// Plan and shared, immutable, by every layer and by the backend's step plan.
#pragma once

#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "attnd/kernels/attention_params.h"
#include "attnd/kernels/views.h"

namespace attnd {

// Kernel-level options of a step beyond AttentionParams.
struct StepOptions {
  AttentionParams params;  // sm_scale resolved; k/v scales from the cache
  bool return_lse = false;
  bool deterministic = false;
  int32_t fixed_split_tokens = 0;  // 0: planner's choice
  bool disable_split_kv = false;
};

enum class StepPhase { kEmpty, kDecode, kPrefill, kMixed };
std::string_view StepPhaseName(StepPhase phase);  // "none", "decode", "prefill", "mixed"
// The phase of a step from its qo_indptr ([batch_size + 1]): entries of one row are decode,
// longer ones prefill, padding (no rows) neither. The rule every kernel choice starts from.
StepPhase StepPhaseOf(std::span<const int32_t> qo_indptr);

// Copy-on-write of one page (managed mode, ForkSequence): before a step's first write into a
// partial last page that other sequences share, the page's bytes (K and V, per layer) are copied
// to a fresh page, which takes the shared page's place in the writer's page table.
struct PageCopy {
  int32_t source = 0;
  int32_t destination = 0;
};

// Padding entries keep their slot with no rows and no pages.
struct StepBatch {
  int32_t batch_size = 0;               // plan entries, padding included
  int64_t num_tokens = 0;               // rows of q/k/v/o per layer
  std::vector<int32_t> qo_indptr;       // [batch_size + 1] rows of each entry
  std::vector<int32_t> page_indptr;     // [batch_size + 1] into the page index arrays
  std::vector<int32_t> k_page_indices;  // page ids, K pool (and V pool when SHARED)
  // Page ids of the V pool; empty when the page table is SHARED (V pages are the K pages), so a
  // step does not copy (nor upload) the same ids twice.
  std::vector<int32_t> v_page_indices;
  std::vector<int32_t> last_page_len;   // [batch_size]
  std::vector<int32_t> token_batch_indices;  // [num_tokens] entry of each row
  std::vector<int32_t> token_positions;      // [num_tokens] position in its sequence
  // Pages to copy before this step's append, in every layer the step runs (each layer copies
  // its own K and V regions on the cache's stream before its append kernel). The destination
  // pages are fresh and already in the page table above.
  std::vector<PageCopy> page_copies;
  StepOptions options;
  StepPhase phase = StepPhase::kEmpty;

  // Views of the vectors above (host memory; valid while this StepBatch lives).
  PageTableView PageTable(int32_t page_size) const;
  AppendIndexView AppendIndex() const;
  int64_t KvLength(int32_t b, int32_t page_size) const { return PageTable(page_size).KvLength(b); }
  // Query rows of entry b.
  int32_t Rows(int32_t b) const { return qo_indptr[b + 1] - qo_indptr[b]; }
};

}  // namespace attnd
