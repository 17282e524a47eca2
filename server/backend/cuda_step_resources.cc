#include "backend/cuda_step_resources.h"

#include "attnd/status_macros.h"

namespace attnd::cuda_backend {

LayerSizes LayerSizes::Of(const CacheGeometry& geometry, int64_t num_tokens, bool return_lse) {
  const int64_t element_bytes = DTypeBytes(geometry.q_dtype);
  LayerSizes sizes;
  sizes.q_bytes = num_tokens * geometry.num_qo_heads * geometry.k_head_dim * element_bytes;
  sizes.k_bytes = num_tokens * geometry.num_kv_heads * geometry.k_head_dim * element_bytes;
  sizes.v_bytes = num_tokens * geometry.num_kv_heads * geometry.v_head_dim * element_bytes;
  sizes.k_offset = AlignUp(sizes.q_bytes, kBufferAlignment);
  sizes.v_offset = sizes.k_offset + AlignUp(sizes.k_bytes, kBufferAlignment);
  sizes.in_bytes = sizes.v_offset + sizes.v_bytes;
  if (geometry.mla) {
    sizes.q_pe_bytes = num_tokens * geometry.num_qo_heads * geometry.v_head_dim * element_bytes;
    sizes.q_pe_offset = sizes.v_offset + AlignUp(sizes.v_bytes, kBufferAlignment);
    sizes.in_bytes = sizes.q_pe_offset + sizes.q_pe_bytes;
  }
  // MLA's output is latent: kv_lora_rank (k_head_dim) wide.
  const int32_t o_dim = geometry.mla ? geometry.k_head_dim : geometry.v_head_dim;
  sizes.o_bytes = num_tokens * geometry.num_qo_heads * o_dim * element_bytes;
  sizes.lse_bytes = return_lse ? num_tokens * geometry.num_qo_heads * 4 : 0;
  sizes.lse_offset = AlignUp(sizes.o_bytes, kBufferAlignment);
  sizes.out_bytes = return_lse ? sizes.lse_offset + sizes.lse_bytes : sizes.o_bytes;
  return sizes;
}

absl::Status StepResources::Init(bool blocking_sync) {
  RETURN_IF_ERROR(arrays_uploaded.Create(/*timing=*/false));
  for (LayerSlot& slot : slots) {
    RETURN_IF_ERROR(slot.inputs_copied.Create(false));
    RETURN_IF_ERROR(slot.LayerEvents::Create(blocking_sync));
  }
  return absl::OkStatus();
}

absl::Status PartEvents::Create() {
  RETURN_IF_ERROR(copied.Create(false));
  RETURN_IF_ERROR(started.Create(true));
  RETURN_IF_ERROR(appended.Create(true));
  return attended.Create(true);
}

absl::Status LayerEvents::Create(bool blocking_sync) {
  RETURN_IF_ERROR(started.Create(true));
  RETURN_IF_ERROR(appended.Create(true));
  RETURN_IF_ERROR(attended_first.Create(true));
  RETURN_IF_ERROR(attended_second.Create(true));
  RETURN_IF_ERROR(fork.Create(false));
  RETURN_IF_ERROR(join.Create(false));
  RETURN_IF_ERROR(attended.Create(false));
  return finished.Create(false, blocking_sync);
}

absl::Status StepResources::Reserve(const LayerSizes& sizes, int64_t array_bytes,
                                    std::vector<uint8_t*>* retired_device,
                                    std::vector<uint8_t*>* retired_pinned) {
  RETURN_IF_ERROR(host_arrays.Reserve(array_bytes, retired_pinned));
  RETURN_IF_ERROR(device_arrays.Reserve(array_bytes, retired_device));
  for (LayerSlot& slot : slots) {
    RETURN_IF_ERROR(slot.host_in.Reserve(sizes.in_bytes));
    RETURN_IF_ERROR(slot.device_in.Reserve(sizes.in_bytes));
    RETURN_IF_ERROR(slot.device_out.Reserve(sizes.out_bytes));
  }
  return absl::OkStatus();
}

}  // namespace attnd::cuda_backend
