#include "attnd/kernels/step_batch.h"

namespace attnd {

std::string_view StepPhaseName(StepPhase phase) {
  switch (phase) {
    case StepPhase::kEmpty:
      return "none";
    case StepPhase::kDecode:
      return "decode";
    case StepPhase::kPrefill:
      return "prefill";
    case StepPhase::kMixed:
      return "mixed";
  }
  return "none";
}

StepPhase StepPhaseOf(std::span<const int32_t> qo_indptr) {
  bool decode = false;
  bool prefill = false;
  for (size_t b = 0; b + 1 < qo_indptr.size(); ++b) {
    const int32_t rows = qo_indptr[b + 1] - qo_indptr[b];
    decode |= rows == 1;
    prefill |= rows > 1;
  }
  if (decode && prefill) return StepPhase::kMixed;
  if (prefill) return StepPhase::kPrefill;
  return decode ? StepPhase::kDecode : StepPhase::kEmpty;
}

PageTableView StepBatch::PageTable(int32_t page_size) const {
  PageTableView view;
  view.batch_size = batch_size;
  view.page_size = page_size;
  view.indptr = page_indptr.data();
  view.k_indices = k_page_indices.data();
  view.v_indices = v_page_indices.empty() ? k_page_indices.data() : v_page_indices.data();
  view.last_page_len = last_page_len.data();
  return view;
}

AppendIndexView StepBatch::AppendIndex() const {
  AppendIndexView view;
  view.num_tokens = num_tokens;
  view.batch_indices = token_batch_indices.data();
  view.positions = token_positions.data();
  return view;
}

}  // namespace attnd
