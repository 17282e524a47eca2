// Plain structs the service hands to the engine, already decoded from protobuf. The service
// validates what it can check alone (enums, ranges of config fields); the engine validates what
// needs state (ids, page indices, shapes against a step).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "backend/backend.h"

namespace attnd {

struct CacheSpec {
  std::string name;
  CacheGeometry geometry;
  bool external_pages = false;  // PAGE_TABLE_MODE_EXTERNAL
  bool separate_kv = false;     // PAGE_TABLE_FORM_SEPARATE_KV (EXTERNAL only)
};

struct AttentionOptionsSpec {
  std::optional<bool> causal;
  std::optional<float> sm_scale;
  float logits_soft_cap = 0.0f;
  std::optional<int32_t> window_left;
  bool return_lse = false;
  bool deterministic = false;
  int32_t fixed_split_size = 0;
  bool disable_split_kv = false;
};

struct PlanEntrySpec {
  uint64_t sequence_id = 0;
  int32_t num_new_tokens = 0;
  bool has_pages = false;  // EXTERNAL mode: the client's page table of this entry
  std::vector<int32_t> page_ids;
  std::vector<int32_t> v_page_ids;
  int64_t kv_len = 0;
};

struct PlanSpec {
  std::string cache;
  std::vector<PlanEntrySpec> entries;
  AttentionOptionsSpec options;
  // An opaque owner label the engine keeps on the step: only calls naming the same tenant
  // find the step, and open steps are limited per tenant ("" when tenants are off: unlimited
  // beyond --max_open_steps).
  std::string tenant;
};

struct PlanEntryResult {
  int64_t start_position = 0;
  int64_t row_offset = 0;
};

struct PlanResult {
  uint64_t step_id = 0;
  std::vector<PlanEntryResult> entries;
  int64_t num_tokens = 0;
  std::string kernel;
};

// A tensor argument as it came on the wire; `data` points into the request message.
struct TensorArg {
  bool present = false;
  DType dtype = DType::kBFloat16;
  std::vector<int64_t> shape;
  std::string_view data;
};

struct ForwardArgs {
  uint64_t step_id = 0;
  int32_t layer = 0;
  TensorArg q, k, v;           // MHA (q is q_nope for MLA)
  TensorArg q_pe, ckv, kpe;    // MLA
  std::string tenant;          // must match the step's PlanSpec::tenant
};

// Where Forward writes its outputs. The strings belong to the caller's response message and
// must stay alive until the done callback runs.
struct ForwardOutputs {
  std::string* o = nullptr;
  std::string* lse = nullptr;  // filled when the step returns lse
  // Set by the engine before the callback runs.
  std::vector<int64_t> o_shape;
  std::vector<int64_t> lse_shape;
  DType o_dtype = DType::kBFloat16;
  bool step_committed = false;
};

enum class StepOutcome { kCommitted, kAborted };

struct EndStepResult {
  StepOutcome outcome = StepOutcome::kCommitted;
  int32_t layers_run = 0;
};

struct CacheStatus {
  CacheSpec spec;
  bool failed = false;
  std::string failure;
  int64_t pool_bytes = 0;
  int64_t used_pages = 0;
  int64_t num_sequences = 0;
  int32_t open_steps = 0;
};

}  // namespace attnd
