// Plain structs the service hands to the engine, already decoded from protobuf. The service
// validates what it can check alone (enums, ranges of config fields); the engine validates what
// needs state (ids, page indices, shapes against a step).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "backend/backend.h"
#include "channel/channel_layout.h"

namespace attnd {

struct CacheSpec {
  std::string name;
  CacheGeometry geometry;
  // The device to place the pools on (CreateCacheRequest.device); Backend::kAnyDevice: the
  // device with the most free KV budget. After creation: the device chosen.
  int32_t device = Backend::kAnyDevice;
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
  // Run the step through this channel (0: none); see Engine::OpenChannel.
  uint64_t channel_id = 0;
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
  uint32_t channel_sequence = 0;  // steps on a channel: the value of their ready/done words
};

// A tensor argument as it came on the wire, in one form: its bytes are the concatenation of
// `pieces` (views into the received message's slices, which the backend copies straight into
// staging; a contiguous tensor is one piece). The pieces belong to the caller.
struct TensorArg {
  bool present = false;
  DType dtype = DType::kBFloat16;
  std::vector<int64_t> shape;
  std::span<const std::string_view> pieces = {};

  int64_t size_bytes() const {
    int64_t bytes = 0;
    for (const std::string_view piece : pieces) bytes += static_cast<int64_t>(piece.size());
    return bytes;
  }
  bool empty() const { return size_bytes() == 0; }
};

struct ForwardArgs {
  uint64_t step_id = 0;
  int32_t layer = 0;
  TensorArg q, k, v;           // MHA (q is q_nope for MLA)
  TensorArg q_pe, ckv, kpe;    // MLA
  std::string tenant;          // must match the step's PlanSpec::tenant
  LayerTrace* trace = nullptr;  // benchmarks only (backend/layer_trace.h)
  // The step runs through its channel: no tensors here; set the layer's ready word (if the
  // client has not) and finish once its done word is set.
  bool use_channel = false;
};

struct StepEntry;

// Where Forward writes its outputs. The strings belong to the caller's response message; they
// and this struct must stay alive until the done callback runs. With `o` null the backend lends
// its output buffer instead (`lease`, valid until lease.Release(), which the caller calls):
// the bytes can be sent from there with no copy.
struct ForwardOutputs {
  std::string* o = nullptr;
  std::string* lse = nullptr;  // filled when the step returns lse (and o is set)
  OutputLease lease;
  // Set by the engine before the callback runs.
  std::vector<int64_t> o_shape;
  std::vector<int64_t> lse_shape;
  DType o_dtype = DType::kBFloat16;
  bool step_committed = false;
  // Forward{use_channel}: o and lse are in the channel slot; nothing to send.
  bool in_channel = false;

  // The engine's own state while the layer runs (kept here so that its completion callback
  // needs no allocation); not for the caller.
  std::shared_ptr<StepEntry> running_step;
  std::function<void(absl::Status)> running_done;
  int32_t running_layer = 0;
};

enum class StepOutcome { kCommitted, kAborted };

struct EndStepResult {
  StepOutcome outcome = StepOutcome::kCommitted;
  int32_t layers_run = 0;
};

struct ChannelOpenSpec {
  std::string cache;
  ChannelKind kind = ChannelKind::kHostShm;
  int32_t max_tokens = 0;
  int32_t num_slots = 0;  // 0: the default (2, at most num_layers)
  bool with_lse = false;
  // CUDA_IPC: the client's GPU, normalised (backend/peer_access.h); empty: not checked.
  std::string client_pci_bus_id;
  std::string tenant;
};

struct ChannelStatus {
  uint64_t id = 0;
  std::string cache;
  ChannelKind kind = ChannelKind::kHostShm;
  int32_t max_tokens = 0;
  int32_t num_slots = 0;
  bool with_lse = false;
  std::shared_ptr<const ChannelLayout> layout;
  std::string shm_name;
  std::string cuda_ipc_handle;
  std::string pci_bus_id;
  int32_t device = 0;
  bool peer_access = false;
  std::string nccl_unique_id;
  int32_t open_steps = 0;
  uint32_t last_sequence = 0;
  int64_t bytes_in = 0;
  int64_t bytes_out = 0;
  bool transferring = false;  // lent to an ExportSequence or ImportSequence
};

struct ForkSpec {
  std::string cache;
  uint64_t source_id = 0;
  uint64_t new_id = 0;
  int64_t num_tokens = 0;  // 0: the source's whole length
};

struct ForkResult {
  int64_t num_tokens = 0;
  int64_t shared_pages = 0;
};

struct CacheStatus {
  CacheSpec spec;
  bool failed = false;
  std::string failure;
  int64_t pool_bytes = 0;
  int64_t used_pages = 0;
  int64_t shared_pages = 0;  // of used_pages, those held more than once
  int64_t num_sequences = 0;
  int32_t open_steps = 0;
  std::vector<ChannelStatus> channels;  // sorted by id
};

}  // namespace attnd
