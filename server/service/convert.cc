#include "service/convert.h"

#include <cmath>
#include <limits>
#include <type_traits>

#include "absl/strings/str_cat.h"
#include "attnd/status_macros.h"
#include "backend/peer_access.h"

namespace attnd {
namespace {

constexpr int32_t kMaxLayers = 1024;
constexpr int32_t kMaxQoHeads = 256;
constexpr int32_t kMaxGqaGroup = 8;
constexpr int32_t kMaxMlaHeads = 128;
constexpr int64_t kMaxTensorElements = int64_t{1} << 36;

template <typename T>
absl::Status Invalid(absl::string_view field, absl::string_view expected, const T& got) {
  if constexpr (std::is_enum_v<T>) {
    return Invalid(field, expected, static_cast<int>(got));
  } else {
    return absl::InvalidArgumentError(absl::StrCat(field, ": expected ", expected, ", got ", got));
  }
}

// An enum's name for messages; a value the proto does not define has no name, so say which.
template <typename Enum>
std::string EnumText(const std::string& name, Enum value) {
  if (!name.empty()) return name;
  return absl::StrCat(static_cast<int>(value), " (not a defined value)");
}

std::string DTypeText(v1::DType dtype) { return EnumText(v1::DType_Name(dtype), dtype); }

bool ValidName(const std::string& name) {
  if (name.empty() || name.size() > 128) return false;
  for (const char c : name) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '.' || c == '_' || c == '-';
    if (!ok) return false;
  }
  return true;
}

absl::StatusOr<RopeConfig> RopeFromProto(const v1::RopeConfig& rope, int32_t rotated_width) {
  RopeConfig config;
  switch (rope.style()) {
    case v1::ROPE_STYLE_UNSPECIFIED:
    case v1::ROPE_STYLE_NONE:
      config.style = RopeStyle::kNone;
      return config;
    case v1::ROPE_STYLE_NEOX:
      config.style = RopeStyle::kNeox;
      break;
    case v1::ROPE_STYLE_INTERLEAVED:
      config.style = RopeStyle::kInterleaved;
      break;
    default:
      return Invalid("config.rope.style", "NONE, NEOX or INTERLEAVED", rope.style());
  }
  config.theta = rope.theta() == 0 ? 10000.0 : rope.theta();
  if (!std::isfinite(config.theta) || config.theta <= 1.0) {
    return Invalid("config.rope.theta", "a finite value > 1 (default 10000)", config.theta);
  }
  config.rotary_dim = rope.rotary_dim() == 0 ? rotated_width : rope.rotary_dim();
  if (config.rotary_dim < 2 || config.rotary_dim > rotated_width || config.rotary_dim % 2 != 0) {
    return Invalid("config.rope.rotary_dim",
                   absl::StrCat("an even value in [2, ", rotated_width, "] (0 = all)"),
                   rope.rotary_dim());
  }
  switch (rope.scaling()) {
    case v1::ROPE_SCALING_UNSPECIFIED:
    case v1::ROPE_SCALING_NONE:
      config.scaling = RopeScaling::kNone;
      break;
    case v1::ROPE_SCALING_LINEAR:
      config.scaling = RopeScaling::kLinear;
      break;
    case v1::ROPE_SCALING_LLAMA3:
      config.scaling = RopeScaling::kLlama3;
      break;
    default:
      return Invalid("config.rope.scaling", "NONE, LINEAR or LLAMA3", rope.scaling());
  }
  config.factor = rope.factor() == 0 ? 1.0 : rope.factor();
  if (!std::isfinite(config.factor) || config.factor < 1.0) {
    return Invalid("config.rope.factor", "a finite value >= 1 (default 1)", config.factor);
  }
  config.low_freq_factor = rope.low_freq_factor() == 0 ? 1.0 : rope.low_freq_factor();
  config.high_freq_factor = rope.high_freq_factor() == 0 ? 4.0 : rope.high_freq_factor();
  if (!std::isfinite(config.low_freq_factor) || config.low_freq_factor <= 0) {
    return Invalid("config.rope.low_freq_factor", "a finite value > 0 (default 1)",
                   config.low_freq_factor);
  }
  if (!std::isfinite(config.high_freq_factor) ||
      config.high_freq_factor <= config.low_freq_factor) {
    return Invalid("config.rope.high_freq_factor",
                   absl::StrCat("a finite value > low_freq_factor (", config.low_freq_factor,
                                "; default 4)"),
                   config.high_freq_factor);
  }
  config.original_max_position =
      rope.original_max_position() == 0 ? 8192 : rope.original_max_position();
  if (config.original_max_position <= 0) {
    return Invalid("config.rope.original_max_position", "> 0 (default 8192)",
                   rope.original_max_position());
  }
  return config;
}

absl::StatusOr<DType> KvDTypeFromProto(v1::DType dtype, DType q_dtype) {
  if (dtype == v1::DTYPE_UNSPECIFIED) return q_dtype;
  if (dtype == v1::DTYPE_FLOAT16) return DType::kFloat16;
  if (dtype == v1::DTYPE_BFLOAT16) return DType::kBFloat16;
  if (dtype == v1::DTYPE_FLOAT8_E4M3) return DType::kFloat8E4M3;
  return Invalid("config.kv_dtype", "FLOAT16, BFLOAT16 or FLOAT8_E4M3", DTypeText(dtype));
}

absl::StatusOr<float> ScaleFromProto(float scale, absl::string_view field) {
  if (scale == 0.0f) return 1.0f;
  if (!std::isfinite(scale) || scale < 0.0f) {
    return Invalid(field, "a finite value > 0 (default 1)", scale);
  }
  return scale;
}

absl::Status GeometryFromProto(const v1::CacheConfig& config, CacheGeometry& g) {
  switch (config.kind()) {
    case v1::ATTENTION_KIND_UNSPECIFIED:
    case v1::ATTENTION_KIND_MHA:
      g.mla = false;
      break;
    case v1::ATTENTION_KIND_MLA:
      g.mla = true;
      break;
    default:
      return Invalid("config.kind", "MHA or MLA", config.kind());
  }
  g.num_layers = config.num_layers();
  if (g.num_layers < 1 || g.num_layers > kMaxLayers) {
    return Invalid("config.num_layers", absl::StrCat("1..", kMaxLayers), g.num_layers);
  }
  g.num_qo_heads = config.num_qo_heads();
  if (g.mla) {
    if (g.num_qo_heads < 1 || g.num_qo_heads > kMaxMlaHeads) {
      return Invalid("config.num_qo_heads", absl::StrCat("1..", kMaxMlaHeads, " for MLA"),
                     g.num_qo_heads);
    }
    g.num_kv_heads = 1;
    g.k_head_dim = config.kv_lora_rank() == 0 ? 512 : config.kv_lora_rank();
    if (g.k_head_dim != 512 && g.k_head_dim != 256) {
      return Invalid("config.kv_lora_rank", "512 or 256 (default 512)", config.kv_lora_rank());
    }
    g.v_head_dim = config.rope_dim() == 0 ? 64 : config.rope_dim();
    if (g.v_head_dim != 64) return Invalid("config.rope_dim", "64 (default)", config.rope_dim());
  } else {
    if (g.num_qo_heads < 1 || g.num_qo_heads > kMaxQoHeads) {
      return Invalid("config.num_qo_heads", absl::StrCat("1..", kMaxQoHeads), g.num_qo_heads);
    }
    g.num_kv_heads = config.num_kv_heads();
    if (g.num_kv_heads < 1 || g.num_kv_heads > g.num_qo_heads ||
        g.num_qo_heads % g.num_kv_heads != 0 ||
        g.num_qo_heads / g.num_kv_heads > kMaxGqaGroup) {
      return Invalid("config.num_kv_heads",
                     absl::StrCat("a divisor of num_qo_heads (", g.num_qo_heads,
                                  ") with num_qo_heads / num_kv_heads in 1..", kMaxGqaGroup),
                     g.num_kv_heads);
    }
    g.k_head_dim = g.v_head_dim = config.head_dim();
    if (g.k_head_dim != 64 && g.k_head_dim != 128 && g.k_head_dim != 256) {
      return Invalid("config.head_dim", "64, 128 or 256", config.head_dim());
    }
  }
  g.page_size = config.page_size() == 0 ? 16 : config.page_size();
  if (g.page_size < 1 || g.page_size > 128 || (g.page_size & (g.page_size - 1)) != 0) {
    return Invalid("config.page_size", "a power of two in [1, 128] (default 16)",
                   config.page_size());
  }
  switch (config.q_dtype()) {
    case v1::DTYPE_UNSPECIFIED:
    case v1::DTYPE_BFLOAT16:
      g.q_dtype = DType::kBFloat16;
      break;
    case v1::DTYPE_FLOAT16:
      g.q_dtype = DType::kFloat16;
      break;
    default:
      return Invalid("config.q_dtype", "FLOAT16 or BFLOAT16 (default BFLOAT16)",
                     DTypeText(config.q_dtype()));
  }
  ASSIGN_OR_RETURN(g.kv_dtype, KvDTypeFromProto(config.kv_dtype(), g.q_dtype));
  ASSIGN_OR_RETURN(g.k_scale, ScaleFromProto(config.k_scale(), "config.k_scale"));
  ASSIGN_OR_RETURN(g.v_scale, ScaleFromProto(config.v_scale(), "config.v_scale"));
  switch (config.layout()) {
    case v1::KV_LAYOUT_UNSPECIFIED:
    case v1::KV_LAYOUT_NHD:
      g.layout = KvLayout::kNHD;
      break;
    case v1::KV_LAYOUT_HND:
      g.layout = KvLayout::kHND;
      break;
    default:
      return Invalid("config.layout", "NHD or HND", config.layout());
  }
  ASSIGN_OR_RETURN(g.rope, RopeFromProto(config.rope(), g.mla ? g.v_head_dim : g.k_head_dim));
  switch (config.capacity_case()) {
    case v1::CacheConfig::kNumPages:
      g.num_pages = config.num_pages();
      break;
    case v1::CacheConfig::kMemoryBytes:
      if (config.memory_bytes() <= 0) {
        return Invalid("config.memory_bytes", "> 0", config.memory_bytes());
      }
      g.num_pages = config.memory_bytes() / g.BytesPerPage();
      if (g.num_pages < 1 || g.num_pages > std::numeric_limits<int32_t>::max()) {
        return Invalid("config.memory_bytes",
                       absl::StrCat("one page (", g.BytesPerPage(), " bytes) to ",
                                    std::numeric_limits<int32_t>::max(), " pages (",
                                    std::numeric_limits<int32_t>::max() * g.BytesPerPage(),
                                    " bytes)"),
                       config.memory_bytes());
      }
      break;
    default:
      return absl::InvalidArgumentError("config.capacity: set num_pages or memory_bytes");
  }
  if (g.num_pages < 1 || g.num_pages > std::numeric_limits<int32_t>::max()) {
    return Invalid("config.num_pages", "1..2147483647", g.num_pages);
  }
  return absl::OkStatus();
}

// Checks a tensor's dtype and dimensions and copies them into `arg`; returns the element count.
template <typename Dims>
absl::StatusOr<int64_t> DecodeHeader(int32_t dtype, const Dims& shape, absl::string_view field,
                                     TensorArg& arg) {
  arg.present = true;
  if (!v1::DType_IsValid(dtype) || dtype == v1::DTYPE_UNSPECIFIED) {
    // The error names the field; only failures build strings.
    ASSIGN_OR_RETURN(arg.dtype, DTypeFromProto(static_cast<v1::DType>(dtype),
                                               absl::StrCat(field, ".dtype")));
  }
  arg.dtype = static_cast<DType>(dtype);
  int64_t elements = 1;
  arg.shape.clear();
  int i = 0;
  for (const int64_t dim : shape) {
    // elements <= kMaxTensorElements: compared by division, as the product could overflow.
    if (dim < 0 || dim > kMaxTensorElements ||
        (elements > 0 && std::max<int64_t>(dim, 1) > kMaxTensorElements / elements)) {
      return Invalid(absl::StrCat(field, ".shape[", i, "]"), "a dimension in [0, 2^36)", dim);
    }
    elements *= dim;
    arg.shape.push_back(dim);
    ++i;
  }
  return elements;
}

// Checks a tensor of a protobuf-parsed request; one sent as `values` is converted into a new
// string of `scratch` and `view` (its codec form) takes that as its one piece.
absl::Status ConvertTensor(const v1::Tensor& tensor, absl::string_view field, wire::Tensor& view,
                           std::vector<std::string>& scratch) {
  TensorArg header;
  ASSIGN_OR_RETURN(const int64_t elements,
                   DecodeHeader(tensor.dtype(), tensor.shape(), field, header));
  if (tensor.values_size() == 0) return absl::OkStatus();
  if (!tensor.data().empty()) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": set data or values, not both"));
  }
  if (tensor.values_size() != elements) {
    return Invalid(absl::StrCat(field, ".values"),
                   absl::StrCat(elements, " values for its shape"), tensor.values_size());
  }
  std::string& bytes = scratch.emplace_back(elements * DTypeBytes(header.dtype), '\0');
  for (int64_t i = 0; i < elements; ++i) {
    StoreFromFloat(header.dtype, bytes.data(), i, tensor.values(i));
  }
  view.pieces.assign(1, bytes);
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<DType> DTypeFromProto(v1::DType dtype, absl::string_view field) {
  switch (dtype) {
    case v1::DTYPE_FLOAT16:
      return DType::kFloat16;
    case v1::DTYPE_BFLOAT16:
      return DType::kBFloat16;
    case v1::DTYPE_FLOAT8_E4M3:
      return DType::kFloat8E4M3;
    case v1::DTYPE_FLOAT32:
      return DType::kFloat32;
    default:
      return Invalid(field, "FLOAT16, BFLOAT16, FLOAT8_E4M3 or FLOAT32", DTypeText(dtype));
  }
}

v1::DType DTypeToProto(DType dtype) { return static_cast<v1::DType>(static_cast<int>(dtype)); }

absl::StatusOr<CacheSpec> CacheSpecFromProto(const v1::CreateCacheRequest& request) {
  CacheSpec spec;
  spec.name = request.name();
  if (!ValidName(spec.name)) {
    return Invalid("name", "1..128 characters of [A-Za-z0-9._-]",
                   absl::StrCat("'", spec.name.substr(0, 160), "'"));
  }
  if (request.has_device()) {
    if (request.device() < 0) {
      return Invalid("device", "a device ordinal >= 0 (unset: the least used device)",
                     absl::StrCat(request.device()));
    }
    spec.device = request.device();
  }
  const v1::CacheConfig& config = request.config();
  RETURN_IF_ERROR(GeometryFromProto(config, spec.geometry));
  switch (config.page_table_mode()) {
    case v1::PAGE_TABLE_MODE_UNSPECIFIED:
    case v1::PAGE_TABLE_MODE_MANAGED:
      spec.external_pages = false;
      break;
    case v1::PAGE_TABLE_MODE_EXTERNAL:
      spec.external_pages = true;
      break;
    default:
      return Invalid("config.page_table_mode", "MANAGED or EXTERNAL", config.page_table_mode());
  }
  switch (config.page_table_form()) {
    case v1::PAGE_TABLE_FORM_UNSPECIFIED:
    case v1::PAGE_TABLE_FORM_SHARED:
      spec.separate_kv = false;
      break;
    case v1::PAGE_TABLE_FORM_SEPARATE_KV:
      if (!spec.external_pages) {
        return Invalid("config.page_table_form", "SHARED for MANAGED caches (SEPARATE_KV needs "
                       "page_table_mode EXTERNAL)", "SEPARATE_KV");
      }
      spec.separate_kv = true;
      break;
    default:
      return Invalid("config.page_table_form", "SHARED or SEPARATE_KV", config.page_table_form());
  }
  return spec;
}

void CacheStatusToProto(const CacheStatus& status, v1::CacheInfo* info) {
  const CacheGeometry& g = status.spec.geometry;
  info->set_name(status.spec.name);
  v1::CacheConfig* config = info->mutable_config();
  config->set_kind(g.mla ? v1::ATTENTION_KIND_MLA : v1::ATTENTION_KIND_MHA);
  config->set_num_layers(g.num_layers);
  config->set_num_qo_heads(g.num_qo_heads);
  if (g.mla) {
    config->set_kv_lora_rank(g.k_head_dim);
    config->set_rope_dim(g.v_head_dim);
  } else {
    config->set_num_kv_heads(g.num_kv_heads);
    config->set_head_dim(g.k_head_dim);
  }
  config->set_page_size(g.page_size);
  config->set_kv_dtype(DTypeToProto(g.kv_dtype));
  config->set_q_dtype(DTypeToProto(g.q_dtype));
  config->set_k_scale(g.k_scale);
  config->set_v_scale(g.v_scale);
  config->set_layout(g.layout == KvLayout::kNHD ? v1::KV_LAYOUT_NHD : v1::KV_LAYOUT_HND);
  config->set_num_pages(g.num_pages);
  v1::RopeConfig* rope = config->mutable_rope();
  rope->set_style(static_cast<v1::RopeStyle>(static_cast<int>(g.rope.style)));
  if (g.rope.style != RopeStyle::kNone) {
    rope->set_theta(g.rope.theta);
    rope->set_rotary_dim(g.rope.rotary_dim);
    rope->set_scaling(static_cast<v1::RopeScaling>(static_cast<int>(g.rope.scaling)));
    rope->set_factor(g.rope.factor);
    rope->set_low_freq_factor(g.rope.low_freq_factor);
    rope->set_high_freq_factor(g.rope.high_freq_factor);
    rope->set_original_max_position(g.rope.original_max_position);
  }
  config->set_page_table_mode(status.spec.external_pages ? v1::PAGE_TABLE_MODE_EXTERNAL
                                                         : v1::PAGE_TABLE_MODE_MANAGED);
  config->set_page_table_form(status.spec.separate_kv ? v1::PAGE_TABLE_FORM_SEPARATE_KV
                                                      : v1::PAGE_TABLE_FORM_SHARED);
  info->set_state(status.failed ? v1::CACHE_STATE_FAILED : v1::CACHE_STATE_READY);
  info->set_failure(status.failure);
  info->set_pool_bytes(status.pool_bytes);
  info->set_num_pages(g.num_pages);
  info->set_used_pages(status.used_pages);
  info->set_shared_pages(status.shared_pages);
  info->set_device(status.spec.device);
  info->set_num_sequences(status.num_sequences);
  info->set_open_steps(status.open_steps);
  for (const ChannelStatus& channel : status.channels) {
    ChannelStatusToProto(channel, info->add_channels());
    info->mutable_channels()->rbegin()->set_cache(status.spec.name);
  }
}

absl::StatusOr<PlanSpec> PlanSpecFromProto(const v1::PlanRequest& request) {
  PlanSpec spec;
  spec.cache = request.cache();
  spec.channel_id = request.channel_id();
  spec.entries.reserve(request.entries_size());
  for (const v1::PlanEntry& entry : request.entries()) {
    PlanEntrySpec& out = spec.entries.emplace_back();
    out.sequence_id = entry.sequence_id();
    out.num_new_tokens = entry.num_new_tokens();
    out.has_pages = entry.has_pages();
    if (out.has_pages) {
      out.page_ids.assign(entry.pages().page_ids().begin(), entry.pages().page_ids().end());
      out.v_page_ids.assign(entry.pages().v_page_ids().begin(), entry.pages().v_page_ids().end());
      out.kv_len = entry.pages().kv_len();
    }
  }
  const v1::AttentionOptions& options = request.options();
  if (options.has_causal()) spec.options.causal = options.causal();
  if (options.has_sm_scale()) spec.options.sm_scale = options.sm_scale();
  spec.options.logits_soft_cap = options.logits_soft_cap();
  if (options.has_window_left()) spec.options.window_left = options.window_left();
  spec.options.return_lse = options.return_lse();
  spec.options.deterministic = options.deterministic();
  spec.options.fixed_split_size = options.fixed_split_size();
  spec.options.disable_split_kv = options.disable_split_kv();
  return spec;
}

void PlanResultToProto(const PlanResult& result, v1::PlanResponse* response) {
  response->set_step_id(result.step_id);
  for (const PlanEntryResult& entry : result.entries) {
    v1::PlanEntryResult* out = response->add_entries();
    out->set_start_position(entry.start_position);
    out->set_row_offset(entry.row_offset);
  }
  response->set_num_tokens(result.num_tokens);
  response->set_kernel(result.kernel);
  response->set_channel_sequence(result.channel_sequence);
}

absl::StatusOr<ChannelOpenSpec> ChannelOpenSpecFromProto(const v1::OpenChannelRequest& request) {
  ChannelOpenSpec spec;
  spec.cache = request.cache();
  spec.max_tokens = request.max_tokens();
  spec.num_slots = request.slots();
  spec.with_lse = request.with_lse();
  switch (request.kind()) {
    case v1::CHANNEL_KIND_HOST_SHM:
      spec.kind = ChannelKind::kHostShm;
      break;
    case v1::CHANNEL_KIND_CUDA_IPC:
      spec.kind = ChannelKind::kCudaIpc;
      break;
    case v1::CHANNEL_KIND_NCCL:
      spec.kind = ChannelKind::kNccl;
      break;
    default:
      return absl::InvalidArgumentError(absl::StrCat(
          "kind: expected CHANNEL_KIND_HOST_SHM, CHANNEL_KIND_CUDA_IPC or CHANNEL_KIND_NCCL, got ",
          v1::ChannelKind_Name(request.kind()).empty()
              ? absl::StrCat(static_cast<int>(request.kind()), " (not a defined value)")
              : v1::ChannelKind_Name(request.kind())));
  }
  // Checked whatever the kind (it is wire input); only CUDA_IPC uses it.
  if (!request.client_pci_bus_id().empty()) {
    ASSIGN_OR_RETURN(spec.client_pci_bus_id,
                     NormalizePciBusId(request.client_pci_bus_id(), "client_pci_bus_id"));
  }
  return spec;
}

v1::ChannelKind ChannelKindToProto(ChannelKind kind) {
  switch (kind) {
    case ChannelKind::kCudaIpc:
      return v1::CHANNEL_KIND_CUDA_IPC;
    case ChannelKind::kNccl:
      return v1::CHANNEL_KIND_NCCL;
    case ChannelKind::kHostShm:
      break;
  }
  return v1::CHANNEL_KIND_HOST_SHM;
}

void ChannelStatusToProto(const ChannelStatus& status, v1::ChannelInfo* info) {
  info->set_channel_id(status.id);
  info->set_cache(status.cache);
  info->set_kind(ChannelKindToProto(status.kind));
  info->set_max_tokens(status.max_tokens);
  info->set_slots(status.num_slots);
  info->set_shm_name(status.shm_name);
  info->set_cuda_ipc_handle(status.cuda_ipc_handle);
  info->set_pci_bus_id(status.pci_bus_id);
  info->set_device(status.device);
  info->set_open_steps(status.open_steps);
  info->set_last_sequence(status.last_sequence);
  info->set_bytes_in(status.bytes_in);
  info->set_bytes_out(status.bytes_out);
  info->set_peer_access(status.peer_access);
  info->set_nccl_unique_id(status.nccl_unique_id);
  info->set_transferring(status.transferring);
  if (status.layout == nullptr) return;
  const ChannelLayout& layout = *status.layout;
  v1::ChannelLayout* out = info->mutable_layout();
  out->set_ring_bytes(layout.ring_bytes);
  for (const int64_t offset : layout.ready) out->add_ready_offsets(offset);
  for (const int64_t offset : layout.done) out->add_done_offsets(offset);
  out->set_aborted_offset(layout.aborted);
  for (int32_t slot = 0; slot < layout.num_slots; ++slot) {
    out->add_transfer_flag_offsets(layout.transfer[slot]);
    out->add_transfer_region_offsets(layout.TransferRegion(slot));
  }
  out->set_transfer_region_bytes(layout.slot_bytes);
  out->set_transfer_end_offset(layout.transfer_end);
  for (const ChannelSlotLayout& slot : layout.slots) {
    v1::ChannelSlotLayout* s = out->add_slots();
    s->set_q_offset(slot.q);
    s->set_k_offset(slot.k);
    s->set_v_offset(slot.v);
    s->set_q_pe_offset(slot.q_pe);
    s->set_ckv_offset(slot.ckv);
    s->set_kpe_offset(slot.kpe);
    s->set_o_offset(slot.o);
    s->set_lse_offset(slot.lse);
  }
  out->set_q_row_bytes(layout.q_row);
  out->set_k_row_bytes(layout.k_row);
  out->set_v_row_bytes(layout.v_row);
  out->set_q_pe_row_bytes(layout.q_pe_row);
  out->set_ckv_row_bytes(layout.ckv_row);
  out->set_kpe_row_bytes(layout.kpe_row);
  out->set_o_row_bytes(layout.o_row);
  out->set_lse_row_bytes(layout.lse_row);
}

absl::Status WireForwardFromProto(const v1::ForwardRequest& request, wire::ForwardRequest& wire,
                                  std::vector<std::string>& scratch) {
  wire::ViewOf(request, wire);
  // Reserve so that converted tensors never move while pieces point at them.
  scratch.reserve(6);
  const struct {
    bool present;
    const v1::Tensor& tensor;
    absl::string_view field;
    wire::Tensor& view;
  } tensors[] = {
      {request.has_q(), request.q(), "q", wire.q},
      {request.has_k(), request.k(), "k", wire.k},
      {request.has_v(), request.v(), "v", wire.v},
      {request.has_q_pe(), request.q_pe(), "q_pe", wire.q_pe},
      {request.has_ckv(), request.ckv(), "ckv", wire.ckv},
      {request.has_kpe(), request.kpe(), "kpe", wire.kpe},
  };
  for (const auto& t : tensors) {
    if (t.present) RETURN_IF_ERROR(ConvertTensor(t.tensor, t.field, t.view, scratch));
  }
  return absl::OkStatus();
}

absl::Status ForwardArgsFromWire(const wire::ForwardRequest& wire, ForwardArgs& args) {
  args.step_id = wire.step_id;
  args.layer = wire.layer;
  const struct {
    const wire::Tensor& tensor;
    absl::string_view field;
    TensorArg& arg;
  } tensors[] = {
      {wire.q, "q", args.q},          {wire.k, "k", args.k},     {wire.v, "v", args.v},
      {wire.q_pe, "q_pe", args.q_pe}, {wire.ckv, "ckv", args.ckv}, {wire.kpe, "kpe", args.kpe},
  };
  for (const auto& t : tensors) {
    t.arg.present = false;
    t.arg.shape.clear();
    t.arg.pieces = {};
    if (!t.tensor.present) continue;
    RETURN_IF_ERROR(DecodeHeader(t.tensor.dtype, t.tensor.shape, t.field, t.arg).status());
    t.arg.pieces = t.tensor.pieces;
  }
  return absl::OkStatus();
}

void ForwardOutputsToProto(ForwardOutputs& outputs, std::string&& lse_bytes,
                           v1::ForwardResponse* response) {
  if (outputs.in_channel) {  // use_channel: the outputs are in the channel slot
    response->clear_o();
    response->clear_lse();
    response->set_step_committed(outputs.step_committed);
    return;
  }
  v1::Tensor* o = response->mutable_o();
  o->set_dtype(DTypeToProto(outputs.o_dtype));
  for (const int64_t dim : outputs.o_shape) o->add_shape(dim);
  if (!outputs.lse_shape.empty()) {
    v1::Tensor* lse = response->mutable_lse();
    lse->set_dtype(v1::DTYPE_FLOAT32);
    for (const int64_t dim : outputs.lse_shape) lse->add_shape(dim);
    lse->set_data(std::move(lse_bytes));
  }
  response->set_step_committed(outputs.step_committed);
}

void EndStepResultToProto(const EndStepResult& result, v1::EndStepResponse* response) {
  response->set_outcome(result.outcome == StepOutcome::kCommitted ? v1::STEP_OUTCOME_COMMITTED
                                                                   : v1::STEP_OUTCOME_ABORTED);
  response->set_layers_run(result.layers_run);
}

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  // absl and gRPC share the canonical code numbering.
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::string(status.message()));
}

}  // namespace attnd
