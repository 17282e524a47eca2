#include "nccl_wire.h"

#include "absl/strings/str_cat.h"

namespace attnd::client::internal {

absl::StatusOr<NcclLayerBuffers> NcclLayerBuffersOf(const attnd::v1::ChannelInfo& info,
                                                    int64_t rows, bool return_lse,
                                                    const ChannelSlot& tensors) {
  if (rows < 0 || rows > info.max_tokens()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "rows: ", rows, " is outside [0, ", info.max_tokens(), "] (the channel's max_tokens)"));
  }
  const attnd::v1::ChannelLayout& layout = info.layout();
  if (return_lse && layout.lse_row_bytes() <= 0) {
    return absl::InvalidArgumentError(
        "return_lse: the channel was opened without lse (ChannelOptions::with_lse)");
  }
  NcclLayerBuffers buffers;
  if (rows == 0) return buffers;
  absl::Status missing;
  auto add = [&](std::vector<NcclBuffer>& list, const char* name, const void* data,
                 int64_t row_bytes) {
    if (data == nullptr) {
      if (missing.ok()) {
        missing = absl::InvalidArgumentError(absl::StrCat(
            name, ": null, but this channel's layers carry it (", row_bytes, " bytes a row)"));
      }
      return;
    }
    list.push_back({const_cast<void*>(data), rows * row_bytes});
  };
  // MLA layouts have ckv rows and no k rows (ChannelSlotLayout).
  if (layout.ckv_row_bytes() > 0) {
    add(buffers.sends, "q", tensors.q, layout.q_row_bytes());
    add(buffers.sends, "q_pe", tensors.q_pe, layout.q_pe_row_bytes());
    add(buffers.sends, "ckv", tensors.ckv, layout.ckv_row_bytes());
    add(buffers.sends, "kpe", tensors.kpe, layout.kpe_row_bytes());
  } else {
    add(buffers.sends, "q", tensors.q, layout.q_row_bytes());
    add(buffers.sends, "k", tensors.k, layout.k_row_bytes());
    add(buffers.sends, "v", tensors.v, layout.v_row_bytes());
  }
  add(buffers.receives, "o", tensors.o, layout.o_row_bytes());
  if (return_lse) add(buffers.receives, "lse", tensors.lse, layout.lse_row_bytes());
  if (!missing.ok()) return missing;
  return buffers;
}

}  // namespace attnd::client::internal
