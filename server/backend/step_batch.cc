#include "backend/backend.h"

#include <algorithm>
#include <cstring>

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

namespace attnd {

void InputBytes::CopyTo(void* destination, int64_t bytes) const {
  auto* out = static_cast<uint8_t*>(destination);
  if (pieces.empty()) {
    if (bytes > 0) std::memcpy(out, data, static_cast<size_t>(bytes));
    return;
  }
  for (const std::string_view piece : pieces) {
    const int64_t n = std::min<int64_t>(bytes, static_cast<int64_t>(piece.size()));
    if (n <= 0) break;
    std::memcpy(out, piece.data(), static_cast<size_t>(n));
    out += n;
    bytes -= n;
  }
}

const void* InputBytes::Contiguous(int64_t bytes, std::vector<uint8_t>& scratch) const {
  if (pieces.empty()) return data;
  if (pieces.size() == 1) return pieces.front().data();
  scratch.resize(static_cast<size_t>(bytes));
  CopyTo(scratch.data(), bytes);
  return scratch.data();
}

}  // namespace attnd
