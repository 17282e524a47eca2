#include "attnd/client/reference_cache.h"

#include <cmath>
#include <set>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "attnd/client/tensor.h"
#include "attnd/status_macros.h"
#include "reference/append.h"
#include "reference/attention.h"

namespace attnd::client {
namespace {

template <typename T>
T OrDefault(T value, T fallback) {
  return value == T{} ? fallback : value;
}

RopeConfig ResolveRope(const attnd::v1::RopeConfig& rope, int32_t head_dim) {
  RopeConfig resolved;
  resolved.style = rope.style() == attnd::v1::ROPE_STYLE_UNSPECIFIED
                       ? RopeStyle::kNone
                       : static_cast<RopeStyle>(rope.style());
  resolved.theta = OrDefault(rope.theta(), 10000.0);
  resolved.rotary_dim = OrDefault(rope.rotary_dim(), head_dim);
  resolved.scaling = rope.scaling() == attnd::v1::ROPE_SCALING_UNSPECIFIED
                         ? RopeScaling::kNone
                         : static_cast<RopeScaling>(rope.scaling());
  resolved.factor = OrDefault(rope.factor(), 1.0);
  resolved.low_freq_factor = OrDefault(rope.low_freq_factor(), 1.0);
  resolved.high_freq_factor = OrDefault(rope.high_freq_factor(), 4.0);
  resolved.original_max_position = OrDefault<int64_t>(rope.original_max_position(), 8192);
  return resolved;
}

// Reads a [num_tokens, num_heads, head_dim] tensor of `dtype` as floats, checking its shape.
absl::StatusOr<std::vector<float>> ReadRows(const attnd::v1::Tensor& tensor, const char* field,
                                            DType dtype, int64_t num_tokens, int32_t num_heads,
                                            int32_t head_dim) {
  const std::vector<int64_t> expected = {num_tokens, num_heads, head_dim};
  if (tensor.dtype() != ToProto(dtype) ||
      !std::equal(tensor.shape().begin(), tensor.shape().end(), expected.begin(),
                  expected.end())) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ": reference expected ", std::string(DTypeName(dtype)), " [", num_tokens, ", ",
        num_heads, ", ", head_dim, "]"));
  }
  absl::StatusOr<std::vector<float>> values = TensorToFloats(tensor);
  if (!values.ok()) {
    return absl::Status(values.status().code(),
                        absl::StrCat(field, ": ", values.status().message()));
  }
  return values;
}

}  // namespace

absl::StatusOr<std::unique_ptr<ReferenceCache>> ReferenceCache::Create(
    const attnd::v1::CacheConfig& config) {
  if (config.kind() == attnd::v1::ATTENTION_KIND_MLA) {
    return absl::UnimplementedError("ReferenceCache mirrors MHA/GQA caches only");
  }
  if (config.num_layers() <= 0 || config.num_qo_heads() <= 0 || config.num_kv_heads() <= 0 ||
      config.head_dim() <= 0 || config.num_qo_heads() % config.num_kv_heads() != 0) {
    return absl::InvalidArgumentError("config: layers, heads and head_dim must be resolved");
  }
  auto cache = std::unique_ptr<ReferenceCache>(new ReferenceCache());
  cache->config_ = config;
  cache->config_.set_page_size(OrDefault(config.page_size(), 16));
  ASSIGN_OR_RETURN(cache->q_dtype_,
                   FromProto(OrDefault(config.q_dtype(), attnd::v1::DTYPE_BFLOAT16)));
  ASSIGN_OR_RETURN(cache->kv_dtype_,
                   FromProto(OrDefault(config.kv_dtype(), ToProto(cache->q_dtype_))));
  cache->layout_ = config.layout() == attnd::v1::KV_LAYOUT_HND ? KvLayout::kHND : KvLayout::kNHD;
  cache->external_ = config.page_table_mode() == attnd::v1::PAGE_TABLE_MODE_EXTERNAL;
  const RopeConfig rope = ResolveRope(config.rope(), config.head_dim());
  cache->rope_style_ = rope.style;
  cache->rope_inv_freq_ = RopeInverseFrequencies(rope);
  cache->k_pools_.resize(config.num_layers());
  cache->v_pools_.resize(config.num_layers());
  if (cache->external_) {
    if (config.num_pages() <= 0) {
      return absl::InvalidArgumentError("config.num_pages: EXTERNAL mirrors need the pool size");
    }
    cache->num_pages_ = config.num_pages();
    const size_t pool_bytes =
        static_cast<size_t>(cache->num_pages_) * cache->Pool(0, false).PageElements() *
        DTypeBytes(cache->kv_dtype_);
    for (int32_t layer = 0; layer < config.num_layers(); ++layer) {
      cache->k_pools_[layer].assign(pool_bytes, 0);
      cache->v_pools_[layer].assign(pool_bytes, 0);
    }
  }
  return cache;
}

PagedKvView ReferenceCache::Pool(int32_t layer, bool v) const {
  PagedKvView view;
  auto& pools = v ? v_pools_ : k_pools_;
  view.data = const_cast<uint8_t*>(pools[layer].data());
  view.dtype = kv_dtype_;
  view.layout = layout_;
  view.num_pages = num_pages_;
  view.page_size = config_.page_size();
  view.num_heads = config_.num_kv_heads();
  view.head_dim = config_.head_dim();
  return view;
}

int32_t ReferenceCache::AllocatePage() {
  if (!free_pages_.empty()) {
    const int32_t page = free_pages_.back();
    free_pages_.pop_back();
    return page;
  }
  const int32_t page = static_cast<int32_t>(num_pages_++);
  const size_t pool_bytes =
      static_cast<size_t>(num_pages_) * Pool(0, false).PageElements() * DTypeBytes(kv_dtype_);
  for (size_t layer = 0; layer < k_pools_.size(); ++layer) {
    k_pools_[layer].resize(pool_bytes, 0);
    v_pools_[layer].resize(pool_bytes, 0);
  }
  return page;
}

absl::Status ReferenceCache::BeginStep(const attnd::v1::PlanRequest& plan) {
  if (step_open_) return absl::FailedPreconditionError("reference: a step is already open");
  step_ = StepBatch{};
  step_.qo_indptr.push_back(0);
  step_.page_indptr.push_back(0);
  RETURN_IF_ERROR(external_ ? PlanExternal(plan) : PlanManaged(plan));
  const attnd::v1::AttentionOptions& options = plan.options();
  step_.params.causal = options.has_causal() ? options.causal() : true;
  step_.params.sm_scale = options.has_sm_scale()
                              ? options.sm_scale()
                              : 1.0f / std::sqrt(static_cast<float>(config_.head_dim()));
  step_.params.logits_soft_cap = options.logits_soft_cap();
  step_.params.window_left = options.has_window_left() ? options.window_left() : -1;
  if (kv_dtype_ == DType::kFloat8E4M3) {
    step_.params.k_scale = OrDefault(config_.k_scale(), 1.0f);
    step_.params.v_scale = OrDefault(config_.v_scale(), 1.0f);
  }
  step_.return_lse = options.return_lse();
  step_.layer_done.assign(config_.num_layers(), false);
  step_open_ = true;
  return absl::OkStatus();
}

absl::Status ReferenceCache::PlanManaged(const attnd::v1::PlanRequest& plan) {
  std::set<uint64_t> seen;
  for (const attnd::v1::PlanEntry& entry : plan.entries()) {
    if (entry.num_new_tokens() < 0) {
      return absl::InvalidArgumentError("reference: num_new_tokens < 0");
    }
    if (entry.num_new_tokens() > 0 && !seen.insert(entry.sequence_id()).second) {
      return absl::InvalidArgumentError("reference: a sequence id twice in one plan");
    }
  }
  const int32_t page_size = config_.page_size();
  for (int32_t b = 0; b < plan.entries_size(); ++b) {
    const attnd::v1::PlanEntry& entry = plan.entries(b);
    const int32_t new_tokens = entry.num_new_tokens();
    if (new_tokens > 0) {
      Sequence& sequence = sequences_[entry.sequence_id()];
      step_.old_lengths[entry.sequence_id()] = sequence.length;
      step_.old_page_counts[entry.sequence_id()] = sequence.pages.size();
      const int64_t start = sequence.length;
      sequence.length += new_tokens;
      while (static_cast<int64_t>(sequence.pages.size()) * page_size < sequence.length) {
        sequence.pages.push_back(AllocatePage());
      }
      for (int32_t i = 0; i < new_tokens; ++i) {
        step_.token_batch.push_back(b);
        step_.token_position.push_back(static_cast<int32_t>(start + i));
      }
      step_.k_pages.insert(step_.k_pages.end(), sequence.pages.begin(), sequence.pages.end());
      step_.last_page_len.push_back(
          static_cast<int32_t>(sequence.length - (sequence.pages.size() - 1) * page_size));
    } else {
      step_.last_page_len.push_back(0);  // padding: no pages, no rows
    }
    step_.qo_indptr.push_back(step_.qo_indptr.back() + new_tokens);
    step_.page_indptr.push_back(static_cast<int32_t>(step_.k_pages.size()));
  }
  step_.v_pages = step_.k_pages;
  return absl::OkStatus();
}

absl::Status ReferenceCache::PlanExternal(const attnd::v1::PlanRequest& plan) {
  const int32_t page_size = config_.page_size();
  const bool separate = config_.page_table_form() == attnd::v1::PAGE_TABLE_FORM_SEPARATE_KV;
  for (int32_t b = 0; b < plan.entries_size(); ++b) {
    const attnd::v1::PlanEntry& entry = plan.entries(b);
    const int32_t new_tokens = entry.num_new_tokens();
    const attnd::v1::ExternalPages& pages = entry.pages();
    if (new_tokens > 0) {
      const int64_t kv_len = pages.kv_len();
      const int64_t needed = (kv_len + page_size - 1) / page_size;
      if (kv_len < new_tokens || pages.page_ids_size() != needed ||
          (separate && pages.v_page_ids_size() != needed)) {
        return absl::InvalidArgumentError(
            absl::StrCat("reference: entries[", b, "].pages do not cover kv_len ", kv_len));
      }
      for (int32_t i = 0; i < needed; ++i) {
        const int32_t k_page = pages.page_ids(i);
        const int32_t v_page = separate ? pages.v_page_ids(i) : k_page;
        if (k_page < 0 || k_page >= num_pages_ || v_page < 0 || v_page >= num_pages_) {
          return absl::InvalidArgumentError(
              absl::StrCat("reference: entries[", b, "] page id out of range"));
        }
        step_.k_pages.push_back(k_page);
        step_.v_pages.push_back(v_page);
      }
      for (int32_t i = 0; i < new_tokens; ++i) {
        step_.token_batch.push_back(b);
        step_.token_position.push_back(static_cast<int32_t>(kv_len - new_tokens + i));
      }
      step_.last_page_len.push_back(static_cast<int32_t>(kv_len - (needed - 1) * page_size));
    } else {
      step_.last_page_len.push_back(0);
    }
    step_.qo_indptr.push_back(step_.qo_indptr.back() + new_tokens);
    step_.page_indptr.push_back(static_cast<int32_t>(step_.k_pages.size()));
  }
  return absl::OkStatus();
}

absl::StatusOr<ReferenceOutput> ReferenceCache::Forward(const attnd::v1::ForwardRequest& request) {
  if (!step_open_) return absl::FailedPreconditionError("reference: no open step");
  const int32_t layer = request.layer();
  if (layer < 0 || layer >= config_.num_layers() || step_.layer_done[layer]) {
    return absl::InvalidArgumentError(absl::StrCat("reference: layer ", layer, " not runnable"));
  }
  const int64_t num_tokens = static_cast<int64_t>(step_.token_batch.size());
  const int32_t num_qo_heads = config_.num_qo_heads();
  const int32_t num_kv_heads = config_.num_kv_heads();
  const int32_t head_dim = config_.head_dim();
  ASSIGN_OR_RETURN(std::vector<float> q,
                   ReadRows(request.q(), "q", q_dtype_, num_tokens, num_qo_heads, head_dim));
  ASSIGN_OR_RETURN(std::vector<float> k,
                   ReadRows(request.k(), "k", q_dtype_, num_tokens, num_kv_heads, head_dim));
  ASSIGN_OR_RETURN(std::vector<float> v,
                   ReadRows(request.v(), "v", q_dtype_, num_tokens, num_kv_heads, head_dim));
  step_.layer_done[layer] = true;

  PageTableView table;
  table.batch_size = static_cast<int32_t>(step_.last_page_len.size());
  table.page_size = config_.page_size();
  table.indptr = step_.page_indptr.data();
  table.k_indices = step_.k_pages.data();
  table.v_indices = step_.v_pages.data();
  table.last_page_len = step_.last_page_len.data();

  // q is rotated into q_dtype, as the server stores it for attention.
  std::vector<uint8_t> q_rotated(q.size() * DTypeBytes(q_dtype_));
  auto rows = [&](void* data, DType dtype, int32_t heads) {
    TokenHeadsView view;
    view.data = data;
    view.dtype = dtype;
    view.num_tokens = num_tokens;
    view.num_heads = heads;
    view.head_dim = head_dim;
    return view;
  };

  reference::AppendArgs append;
  append.tokens.num_tokens = num_tokens;
  append.tokens.batch_indices = step_.token_batch.data();
  append.tokens.positions = step_.token_position.data();
  append.pages = table;
  append.rope_style = rope_style_;
  append.rope_inv_freq = rope_inv_freq_;
  append.q_in = rows(q.data(), DType::kFloat32, num_qo_heads);
  append.q_out = rows(q_rotated.data(), q_dtype_, num_qo_heads);
  append.k_in = rows(k.data(), DType::kFloat32, num_kv_heads);
  append.v_in = rows(v.data(), DType::kFloat32, num_kv_heads);
  append.k_cache = Pool(layer, false);
  append.v_cache = Pool(layer, true);
  append.k_scale = step_.params.k_scale;
  append.v_scale = step_.params.v_scale;
  reference::AppendKv(append);

  ReferenceOutput output;
  output.o.assign(q.size(), 0.0f);
  if (step_.return_lse) output.lse.assign(num_tokens * num_qo_heads, 0.0f);
  reference::BatchAttentionArgs attention;
  attention.q = rows(q_rotated.data(), q_dtype_, num_qo_heads);
  attention.qo_indptr = step_.qo_indptr.data();
  attention.pages = table;
  attention.k_cache = Pool(layer, false);
  attention.v_cache = Pool(layer, true);
  attention.params = step_.params;
  attention.o = rows(output.o.data(), DType::kFloat32, num_qo_heads);
  attention.lse = step_.return_lse ? output.lse.data() : nullptr;
  attention.accumulation = reference::Accumulation::kFloat64;
  reference::BatchAttention(attention);
  return output;
}

void ReferenceCache::EndStep(bool abort) {
  if (!step_open_) return;
  step_open_ = false;
  if (!abort || external_) return;
  for (const auto& [id, old_length] : step_.old_lengths) {
    Sequence& sequence = sequences_[id];
    const size_t old_pages = step_.old_page_counts[id];
    free_pages_.insert(free_pages_.end(), sequence.pages.begin() + old_pages,
                       sequence.pages.end());
    sequence.pages.resize(old_pages);
    sequence.length = old_length;
    if (old_length == 0) sequences_.erase(id);
  }
}

void ReferenceCache::FreeSequences(const std::vector<uint64_t>& sequence_ids) {
  for (uint64_t id : sequence_ids) {
    auto it = sequences_.find(id);
    if (it == sequences_.end()) continue;
    free_pages_.insert(free_pages_.end(), it->second.pages.begin(), it->second.pages.end());
    sequences_.erase(it);
  }
}

int64_t ReferenceCache::SequenceLength(uint64_t sequence_id) const {
  auto it = sequences_.find(sequence_id);
  return it == sequences_.end() ? 0 : it->second.length;
}

}  // namespace attnd::client
