#include "case_builder.h"

#include <algorithm>

#include "attnd/kernels/dtype.h"
#include "service/convert.h"

namespace attnd::fuzz {
namespace {

attnd::v1::CacheConfig BaseMha() {
  attnd::v1::CacheConfig config;
  config.set_kind(attnd::v1::ATTENTION_KIND_MHA);
  config.set_num_layers(2);
  config.set_num_qo_heads(2);
  config.set_num_kv_heads(1);
  config.set_head_dim(64);
  config.set_page_size(4);
  config.set_q_dtype(attnd::v1::DTYPE_BFLOAT16);
  config.set_num_pages(32);
  config.mutable_rope()->set_style(attnd::v1::ROPE_STYLE_NEOX);
  return config;
}

// Random finite values in the tensor's dtype.
attnd::v1::Tensor RandomTensor(DType dtype, std::vector<int64_t> shape, std::mt19937_64& rng) {
  attnd::v1::Tensor tensor;
  tensor.set_dtype(static_cast<attnd::v1::DType>(static_cast<int>(dtype)));
  int64_t elements = 1;
  for (const int64_t dim : shape) {
    tensor.add_shape(dim);
    elements *= dim;
  }
  std::string bytes(static_cast<size_t>(elements * DTypeBytes(dtype)), '\0');
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int64_t i = 0; i < elements; ++i) StoreFromFloat(dtype, bytes.data(), i, normal(rng));
  tensor.set_data(std::move(bytes));
  return tensor;
}

}  // namespace

attnd::v1::CreateCacheRequest SmallCache(CacheVariant variant, const std::string& name) {
  attnd::v1::CreateCacheRequest request;
  request.set_name(name);
  attnd::v1::CacheConfig& config = *request.mutable_config();
  config = BaseMha();
  switch (variant) {
    case CacheVariant::kMhaManaged:
    case CacheVariant::kCount:
      break;
    case CacheVariant::kGqaHndFp8:
      config.set_num_layers(1);
      config.set_num_qo_heads(4);
      config.set_num_kv_heads(2);
      config.set_page_size(8);
      config.set_layout(attnd::v1::KV_LAYOUT_HND);
      config.set_q_dtype(attnd::v1::DTYPE_FLOAT16);
      config.set_kv_dtype(attnd::v1::DTYPE_FLOAT8_E4M3);
      config.set_k_scale(0.5f);
      config.set_v_scale(2.0f);
      config.mutable_rope()->set_style(attnd::v1::ROPE_STYLE_INTERLEAVED);
      config.mutable_rope()->set_rotary_dim(32);
      break;
    case CacheVariant::kMhaExternal:
      config.set_page_table_mode(attnd::v1::PAGE_TABLE_MODE_EXTERNAL);
      break;
    case CacheVariant::kMhaSeparateKv:
      config.set_page_table_mode(attnd::v1::PAGE_TABLE_MODE_EXTERNAL);
      config.set_page_table_form(attnd::v1::PAGE_TABLE_FORM_SEPARATE_KV);
      break;
    case CacheVariant::kMla:
      config.Clear();
      config.set_kind(attnd::v1::ATTENTION_KIND_MLA);
      config.set_num_layers(1);
      config.set_num_qo_heads(2);
      config.set_kv_lora_rank(256);
      config.set_rope_dim(64);
      config.set_page_size(2);
      config.set_num_pages(16);
      config.mutable_rope()->set_style(attnd::v1::ROPE_STYLE_NEOX);
      break;
    case CacheVariant::kLlama3Rope: {
      config.set_num_layers(1);
      config.set_num_qo_heads(1);
      config.set_num_kv_heads(1);
      config.set_head_dim(128);
      config.set_page_size(1);
      // 1 layer x (K + V) x 1 token x 128 dims x 2 bytes = 512 bytes a page.
      config.set_memory_bytes(512 * 24 + 100);
      attnd::v1::RopeConfig& rope = *config.mutable_rope();
      rope.set_style(attnd::v1::ROPE_STYLE_NEOX);
      rope.set_theta(500000.0);
      rope.set_scaling(attnd::v1::ROPE_SCALING_LLAMA3);
      rope.set_factor(8.0);
      rope.set_low_freq_factor(1.0);
      rope.set_high_freq_factor(4.0);
      rope.set_original_max_position(8192);
      break;
    }
  }
  return request;
}

CacheGeometry ResolvedGeometry(const attnd::v1::CreateCacheRequest& request) {
  auto spec = CacheSpecFromProto(request);
  if (spec.ok()) return spec->geometry;
  return CacheSpecFromProto(SmallCache(CacheVariant::kMhaManaged))->geometry;
}

attnd::v1::PlanRequest ManagedPlan(const std::string& cache, const Entries& entries) {
  attnd::v1::PlanRequest plan;
  plan.set_cache(cache);
  for (const auto& [id, tokens] : entries) {
    attnd::v1::PlanEntry* entry = plan.add_entries();
    entry->set_sequence_id(id);
    entry->set_num_new_tokens(tokens);
  }
  return plan;
}

attnd::v1::PlanRequest ExternalPlan(const std::string& cache, const CacheGeometry& geometry,
                                    const std::vector<ExternalEntry>& entries, bool separate_kv,
                                    int32_t first_page, int32_t first_v_page) {
  attnd::v1::PlanRequest plan;
  plan.set_cache(cache);
  int32_t next_page = first_page;
  int32_t next_v_page = first_v_page;
  const int32_t page_size = geometry.page_size > 0 ? geometry.page_size : 1;
  for (size_t i = 0; i < entries.size(); ++i) {
    attnd::v1::PlanEntry* entry = plan.add_entries();
    entry->set_sequence_id(100 + i);
    entry->set_num_new_tokens(entries[i].num_new_tokens);
    attnd::v1::ExternalPages* pages = entry->mutable_pages();
    pages->set_kv_len(entries[i].kv_len);
    const int64_t count = (entries[i].kv_len + page_size - 1) / page_size;
    for (int64_t p = 0; p < count; ++p) {
      pages->add_page_ids(static_cast<int32_t>(next_page++ % geometry.num_pages));
      if (separate_kv) pages->add_v_page_ids(static_cast<int32_t>(next_v_page++ % geometry.num_pages));
    }
  }
  return plan;
}

attnd::v1::ForwardRequest ValidForward(const CacheGeometry& g, int64_t num_tokens, int32_t layer,
                                       uint64_t step_ordinal, std::mt19937_64& rng) {
  attnd::v1::ForwardRequest request;
  request.set_step_id(step_ordinal);
  request.set_layer(layer);
  // Steps bigger than the harness's --max_step_tokens are refused at Plan; their forwards
  // need no real tensors.
  const int64_t tokens = std::clamp<int64_t>(num_tokens, 0, kMaxValidForwardTokens);
  if (!g.mla) {
    *request.mutable_q() = RandomTensor(g.q_dtype, {tokens, g.num_qo_heads, g.k_head_dim}, rng);
    *request.mutable_k() = RandomTensor(g.q_dtype, {tokens, g.num_kv_heads, g.k_head_dim}, rng);
    *request.mutable_v() = RandomTensor(g.q_dtype, {tokens, g.num_kv_heads, g.v_head_dim}, rng);
  } else {
    *request.mutable_q() = RandomTensor(g.q_dtype, {tokens, g.num_qo_heads, g.k_head_dim}, rng);
    *request.mutable_q_pe() = RandomTensor(g.q_dtype, {tokens, g.num_qo_heads, g.v_head_dim}, rng);
    *request.mutable_ckv() = RandomTensor(g.q_dtype, {tokens, g.k_head_dim}, rng);
    *request.mutable_kpe() = RandomTensor(g.q_dtype, {tokens, g.v_head_dim}, rng);
  }
  return request;
}

Action PlanAction(attnd::v1::PlanRequest plan, uint32_t stream) {
  Action action;
  action.set_stream(stream);
  if (stream == 0) {
    *action.mutable_plan() = std::move(plan);
  } else {
    *action.mutable_stream_request()->mutable_plan() = std::move(plan);
  }
  return action;
}

Action ForwardAction(attnd::v1::ForwardRequest forward, uint32_t stream, bool async) {
  Action action;
  action.set_stream(stream);
  action.set_async(async);
  if (stream == 0) {
    *action.mutable_forward() = std::move(forward);
  } else {
    *action.mutable_stream_request()->mutable_forward() = std::move(forward);
  }
  return action;
}

Action EndStepAction(uint64_t step_ordinal, bool abort, uint32_t stream) {
  Action action;
  action.set_stream(stream);
  attnd::v1::EndStepRequest* end = stream == 0 ? action.mutable_end_step()
                                               : action.mutable_stream_request()->mutable_end_step();
  end->set_step_id(step_ordinal);
  end->set_abort(abort);
  return action;
}

Action FreeAction(const std::string& cache, const std::vector<uint64_t>& ids) {
  Action action;
  action.mutable_free_sequences()->set_cache(cache);
  for (const uint64_t id : ids) action.mutable_free_sequences()->add_sequence_ids(id);
  return action;
}

Action DeleteAction(const std::string& cache, bool force) {
  Action action;
  action.mutable_delete_cache()->set_name(cache);
  action.mutable_delete_cache()->set_force(force);
  return action;
}

const attnd::v1::PlanRequest* PlanOf(const Action& action) {
  if (action.has_plan()) return &action.plan();
  if (action.has_stream_request() && action.stream_request().has_plan()) {
    return &action.stream_request().plan();
  }
  return nullptr;
}

uint64_t CountPlans(const FuzzCase& fuzz_case, int end) {
  uint64_t plans = 0;
  for (int i = 0; i < end && i < fuzz_case.actions_size(); ++i) {
    if (PlanOf(fuzz_case.actions(i)) != nullptr) ++plans;
  }
  return plans;
}

int64_t PlannedTokens(const FuzzCase& fuzz_case, uint64_t ordinal) {
  uint64_t seen = 0;
  for (const Action& action : fuzz_case.actions()) {
    const attnd::v1::PlanRequest* plan = PlanOf(action);
    if (plan == nullptr || ++seen != ordinal) continue;
    int64_t tokens = 0;
    for (const attnd::v1::PlanEntry& entry : plan->entries()) {
      if (entry.num_new_tokens() > 0) tokens += entry.num_new_tokens();
    }
    return tokens;
  }
  return -1;
}

FuzzCase ValidCase(CacheVariant variant, std::mt19937_64& rng) {
  FuzzCase fuzz_case;
  *fuzz_case.mutable_cache() = SmallCache(variant);
  const CacheGeometry g = ResolvedGeometry(fuzz_case.cache());
  const bool external =
      variant == CacheVariant::kMhaExternal || variant == CacheVariant::kMhaSeparateKv;
  const bool separate = variant == CacheVariant::kMhaSeparateKv;
  auto add_step = [&](attnd::v1::PlanRequest plan, uint32_t stream) {
    int64_t tokens = 0;
    for (const auto& entry : plan.entries()) tokens += entry.num_new_tokens();
    *fuzz_case.add_actions() = PlanAction(std::move(plan), stream);
    const uint64_t ordinal = CountPlans(fuzz_case, fuzz_case.actions_size());
    for (int32_t layer = 0; layer < g.num_layers; ++layer) {
      *fuzz_case.add_actions() = ForwardAction(ValidForward(g, tokens, layer, ordinal, rng), stream);
    }
  };
  if (external) {
    add_step(ExternalPlan("fuzz", g, {{5, 5}, {3, 3}}, separate, 0, 7), 0);
    add_step(ExternalPlan("fuzz", g, {{6, 1}, {0, 0}, {4, 1}}, separate, 0, 7), 1);
  } else {
    add_step(ManagedPlan("fuzz", {{1, 5}, {2, 3}}), 0);
    add_step(ManagedPlan("fuzz", {{1, 1}, {7, 0}, {2, 1}}), 1);
    *fuzz_case.add_actions() = FreeAction("fuzz", {1});
  }
  return fuzz_case;
}

}  // namespace attnd::fuzz
