#include "plan/step_plan.h"

#include <algorithm>
#include <cstring>
#include <span>

#include "attnd/status_macros.h"

namespace attnd::plan {
namespace {

// The prefill planner's input for every entry of `batch`, with the KV lengths given.
PrefillPlanInput PrefillInputOf(const StepBatch& batch, const CacheGeometry& g,
                                std::span<const int32_t> kv_lengths,
                                const PrefillWaveSizes& ctas_per_wave) {
  PrefillPlanInput input;
  input.qo_indptr = batch.qo_indptr;
  input.kv_lengths = kv_lengths;
  input.num_qo_heads = g.num_qo_heads;
  input.num_kv_heads = g.num_kv_heads;
  input.head_dim = g.k_head_dim;
  input.causal = batch.options.params.causal;
  input.ctas_per_wave = ctas_per_wave;
  input.deterministic = batch.options.deterministic;
  input.disable_split_kv = batch.options.disable_split_kv;
  input.fixed_split_tokens = batch.options.fixed_split_tokens;
  return input;
}

// Decode plan of the 1-row entries: planned over a copy of qo_indptr in which every other
// entry has no row, then its q rows mapped back onto the step's rows.
absl::StatusOr<DecodePlan> PlanDecodeRows(const StepBatch& batch,
                                                const StepPlanContext& context) {
  const int32_t page_size = context.geometry->page_size;
  std::vector<int32_t> decode_indptr(batch.batch_size + 1, 0);
  std::vector<int64_t> kv_lengths(batch.batch_size, 0);
  std::vector<int32_t> row_of_decode_row;  // decode plan's row -> the step's row
  row_of_decode_row.reserve(batch.batch_size);
  bool identity = true;  // every row is a decode row: the rows need no mapping
  for (int32_t b = 0; b < batch.batch_size; ++b) {
    const bool decode = batch.Rows(b) == 1;
    decode_indptr[b + 1] = decode_indptr[b] + (decode ? 1 : 0);
    if (!decode) continue;
    const int32_t pages = batch.page_indptr[b + 1] - batch.page_indptr[b];
    kv_lengths[b] = pages == 0 ? 0 : int64_t{pages - 1} * page_size + batch.last_page_len[b];
    identity &= batch.qo_indptr[b] == static_cast<int32_t>(row_of_decode_row.size());
    row_of_decode_row.push_back(batch.qo_indptr[b]);
  }
  DecodePlanOptions options;
  options.num_kv_heads = context.geometry->num_kv_heads;
  options.ctas_per_wave = context.decode_ctas_per_wave;
  options.cuda_core_supported = context.decode_cuda_core_supported;
  options.tensor_core_supported = context.decode_tensor_core_supported;
  options.tensor_core_ctas_per_wave = context.decode_tensor_core_ctas_per_wave;
  options.kernel_choice = context.decode_kernel_choice;
  options.fixed_split_tokens = batch.options.fixed_split_tokens;
  options.disable_split_kv = batch.options.disable_split_kv;
  options.deterministic = batch.options.deterministic;
  options.window_left = batch.options.params.window_left;
  ASSIGN_OR_RETURN(DecodePlan decode,
                   PlanBatchDecode(decode_indptr, kv_lengths, options));
  if (!identity) {
    for (int32_t& row : decode.item_q_row) row = row_of_decode_row[row];
    for (int32_t& row : decode.merge_q_row) row = row_of_decode_row[row];
  }
  return decode;
}

// Prefill plan of the step; with `skip_decode_rows`, 1-row entries are left to BatchDecode:
// they are planned with no keys (so they are never split and own no partial or merge row) and
// their CTAs are dropped. Items are self-contained, so a launch keeps the rest of its items.
absl::StatusOr<PrefillPlan> PlanPrefillRows(const StepBatch& batch,
                                                  const StepPlanContext& context,
                                                  bool skip_decode_rows) {
  const CacheGeometry& g = *context.geometry;
  std::vector<int32_t> kv_lengths(batch.batch_size);
  for (int32_t b = 0; b < batch.batch_size; ++b) {
    const bool skipped = skip_decode_rows && batch.Rows(b) == 1;
    kv_lengths[b] = skipped ? 0 : static_cast<int32_t>(batch.KvLength(b, g.page_size));
  }
  ASSIGN_OR_RETURN(PrefillPlan prefill,
                   PlanPrefill(PrefillInputOf(batch, g, kv_lengths, context.prefill_ctas_per_wave)));
  if (!skip_decode_rows) return prefill;

  std::vector<PrefillWorkItem> items;
  std::vector<PrefillLaunch> launches;
  for (const PrefillLaunch& launch : prefill.launches) {
    PrefillLaunch kept = launch;
    kept.first_item = static_cast<int32_t>(items.size());
    for (int32_t i = launch.first_item; i < launch.first_item + launch.num_items; ++i) {
      const PrefillWorkItem& item = prefill.items[i];
      if (batch.Rows(item.request) > 1) {
        items.push_back(item);
      } else if (item.partial_first >= 0) {
        return absl::InternalError("prefill plan split a request planned with no keys");
      }
    }
    kept.num_items = static_cast<int32_t>(items.size()) - kept.first_item;
    // Items dropped from a balanced layout shift the rest off their CTAs' positions: the kernel
    // then snakes through them (prefill_hopper_kernel.cuh).
    if (kept.num_items != launch.num_items) kept.balanced_grid = 0;
    if (kept.num_items > 0) launches.push_back(kept);
  }
  prefill.items = std::move(items);
  prefill.launches = std::move(launches);
  return prefill;
}

// MLA plan of the requests whose row count `select` accepts, planned over a copy of qo_indptr
// in which every other entry has no row, then its q rows mapped back onto the step's rows.
absl::StatusOr<MlaPlan> PlanMlaRows(const StepBatch& batch,
                                          std::span<const int64_t> kv_lengths,
                                          const MlaPlanOptions& options,
                                          bool (*select)(int32_t rows)) {
  std::vector<int32_t> indptr(batch.batch_size + 1, 0);
  std::vector<int32_t> step_row;  // the plan's row -> the step's row
  for (int32_t b = 0; b < batch.batch_size; ++b) {
    const int32_t rows = batch.Rows(b);
    const bool selected = rows > 0 && select(rows);
    indptr[b + 1] = indptr[b] + (selected ? rows : 0);
    if (!selected) continue;
    for (int32_t t = 0; t < rows; ++t) step_row.push_back(batch.qo_indptr[b] + t);
  }
  ASSIGN_OR_RETURN(MlaPlan mla, PlanMlaDecode(indptr, kv_lengths, options));
  // A unit names its request's first row; merge rows name each token's row.
  for (MlaWorkUnit& unit : mla.units) unit.q_row = batch.qo_indptr[unit.request];
  for (int32_t& row : mla.merge_q_row) row = step_row[row];
  return mla;
}

bool IsSplitPlanned(int32_t rows) { return rows <= kMlaSplitMaxQueryTokens; }
bool IsUnsplit(int32_t rows) { return rows > kMlaSplitMaxQueryTokens; }

// Every row of an MLA step in one plan: the short requests planned with KV-split as the options
// say, the long ones unsplit (step_plan.h), their units first (the longest CTAs lead the
// launch order, as the planner orders its own).
absl::StatusOr<MlaPlan> PlanMla(const StepBatch& batch, const StepPlanContext& context,
                                      bool any_unsplit) {
  const CacheGeometry& g = *context.geometry;
  std::vector<int64_t> kv_lengths(batch.batch_size);
  for (int32_t b = 0; b < batch.batch_size; ++b) kv_lengths[b] = batch.KvLength(b, g.page_size);
  MlaPlanOptions options;
  options.num_heads = g.num_qo_heads;
  options.ctas_per_wave = context.mla_ctas_per_wave;
  if (batch.options.disable_split_kv) {
    options.split_mode = MlaSplitMode::kNone;
  } else {
    options.fixed_split_tokens = batch.options.fixed_split_tokens;
    options.deterministic = batch.options.deterministic;
  }
  ASSIGN_OR_RETURN(MlaPlan mla, PlanMlaRows(batch, kv_lengths, options, &IsSplitPlanned));
  if (!any_unsplit) return mla;
  MlaPlanOptions unsplit;
  unsplit.num_heads = g.num_qo_heads;
  unsplit.split_mode = MlaSplitMode::kNone;
  ASSIGN_OR_RETURN(MlaPlan whole, PlanMlaRows(batch, kv_lengths, unsplit, &IsUnsplit));
  if (whole.num_partials != 0) {
    return absl::InternalError("the MLA plan split a request planned without KV-split");
  }
  mla.units.insert(mla.units.begin(), whole.units.begin(), whole.units.end());
  mla.max_chunks = std::max(mla.max_chunks, whole.max_chunks);
  return mla;
}

StepArrayOffsets LayOut(const StepBatch& batch, int64_t decode_words, int64_t mla_words) {
  StepArrayOffsets offsets;
  int64_t at = 0;
  auto place = [&at](int64_t words) {
    const int64_t offset = at;
    at = AlignUp(at + words * static_cast<int64_t>(sizeof(int32_t)), kBufferAlignment);
    return offset;
  };
  const int64_t num_pages = static_cast<int64_t>(batch.k_page_indices.size());
  offsets.qo_indptr = place(batch.batch_size + 1);
  offsets.page_indptr = place(batch.batch_size + 1);
  offsets.k_page_indices = place(num_pages);
  // SHARED page tables upload one array, read as both K and V ids.
  offsets.v_page_indices =
      batch.v_page_indices.empty() ? offsets.k_page_indices : place(num_pages);
  offsets.last_page_len = place(batch.batch_size);
  offsets.token_batch_indices = place(batch.num_tokens);
  offsets.token_positions = place(batch.num_tokens);
  offsets.decode_work = place(decode_words);
  offsets.mla_work = place(mla_words);
  offsets.total_bytes = at;
  return offsets;
}

void Put(const std::vector<int32_t>& words, int64_t offset, uint8_t* buffer) {
  if (!words.empty()) std::memcpy(buffer + offset, words.data(), words.size() * sizeof(int32_t));
}

}  // namespace

std::string_view StepPlan::KernelName() const {
  if (run_mla) return mla_has_prefill ? "mla_prefill" : "mla_decode";
  if (run_pod) return "pod";
  if (run_prefill) return "prefill";
  return run_decode ? "decode" : "none";
}

void StepPlan::Fill(const StepBatch& batch, uint8_t* buffer) const {
  Put(batch.qo_indptr, offsets.qo_indptr, buffer);
  Put(batch.page_indptr, offsets.page_indptr, buffer);
  Put(batch.k_page_indices, offsets.k_page_indices, buffer);
  Put(batch.v_page_indices, offsets.v_page_indices, buffer);
  Put(batch.last_page_len, offsets.last_page_len, buffer);
  Put(batch.token_batch_indices, offsets.token_batch_indices, buffer);
  Put(batch.token_positions, offsets.token_positions, buffer);
  if (run_decode) decode.PackInto(reinterpret_cast<int32_t*>(buffer + offsets.decode_work));
  if (run_mla) Put(mla.Pack(), offsets.mla_work, buffer);
}

absl::StatusOr<StepPlan> PlanStep(const StepBatch& batch, const StepPlanContext& context) {
  const CacheGeometry& g = *context.geometry;
  if (static_cast<int32_t>(batch.qo_indptr.size()) != batch.batch_size + 1 ||
      static_cast<int32_t>(batch.page_indptr.size()) != batch.batch_size + 1 ||
      static_cast<int32_t>(batch.last_page_len.size()) != batch.batch_size ||
      (!batch.v_page_indices.empty() &&
       batch.v_page_indices.size() != batch.k_page_indices.size()) ||
      static_cast<int64_t>(batch.token_batch_indices.size()) != batch.num_tokens ||
      static_cast<int64_t>(batch.token_positions.size()) != batch.num_tokens ||
      batch.qo_indptr.back() != batch.num_tokens) {
    return absl::InvalidArgumentError("step batch: array sizes disagree with its counts");
  }
  const StepPhase phase = StepPhaseOf(batch.qo_indptr);
  const bool any_decode = phase == StepPhase::kDecode || phase == StepPhase::kMixed;
  const bool any_prefill = phase == StepPhase::kPrefill || phase == StepPhase::kMixed;

  StepPlan step;
  if (g.mla) {
    bool any_unsplit = false;
    for (int32_t b = 0; b < batch.batch_size; ++b) any_unsplit |= IsUnsplit(batch.Rows(b));
    step.run_mla = any_decode || any_prefill;
    step.mla_has_prefill = any_prefill;
    if (step.run_mla) {
      ASSIGN_OR_RETURN(step.mla, PlanMla(batch, context, any_unsplit));
    }
    const int64_t mla_words =
        step.run_mla ? int64_t{step.mla.num_units()} * (sizeof(MlaWorkUnit) / sizeof(int32_t)) +
                           static_cast<int64_t>(step.mla.merge_indptr.size() +
                                                step.mla.merge_q_row.size())
                     : 0;
    step.offsets = LayOut(batch, 0, mla_words);
    return step;
  }
  // The separate prefill runs the Hopper kernel wherever the device and shapes allow it
  // (PrefillKernel::kAuto): a positive Hopper wave.
  const bool hopper_prefill = context.prefill_ctas_per_wave.hopper_tile128 > 0;
  if (any_decode && any_prefill &&
      ChoosePod(context.pod_mode, PodShapeOf(batch, g.page_size, hopper_prefill))) {
    ASSIGN_OR_RETURN(step.pod, PlanPodStep(batch, g, context.prefill_ctas_per_wave,
                                           context.pod_ctas_per_wave));
    // A plan that found no two tiles to fuse runs the separate kernels below instead.
    if (step.pod.fused()) {
      step.run_pod = true;
      step.offsets = LayOut(batch, 0, 0);
      return step;
    }
    step.pod = PodPlan();
  }
  step.run_decode = any_decode && context.decode_supported;
  step.run_prefill = any_prefill || (any_decode && !context.decode_supported);
  if (step.run_decode) {
    ASSIGN_OR_RETURN(step.decode, PlanDecodeRows(batch, context));
  }
  // Side by side, the Hopper prefill gets its share of the SMs, and is planned for that grid (its
  // items laid out for those CTAs, its split sized to them). Without a Hopper launch (no 128-row
  // tile) the share changes nothing in the plan and is dropped.
  if (step.run_decode && step.run_prefill && hopper_prefill) {
    step.side_by_side_prefill_ctas =
        SideBySidePrefillCtas(batch, g, context.prefill_ctas_per_wave.hopper_tile128);
  }
  if (step.run_prefill) {
    StepPlanContext prefill_context = context;
    if (step.side_by_side_prefill_ctas > 0) {
      prefill_context.prefill_ctas_per_wave.hopper_tile128 = step.side_by_side_prefill_ctas;
    }
    ASSIGN_OR_RETURN(step.prefill, PlanPrefillRows(batch, prefill_context, step.run_decode));
  }
  const bool hopper_launch =
      std::any_of(step.prefill.launches.begin(), step.prefill.launches.end(),
                  [](const PrefillLaunch& launch) { return launch.kernel == PrefillKernel::kHopper; });
  if (!hopper_launch) step.side_by_side_prefill_ctas = 0;
  step.side_by_side_tail_ctas =
      step.side_by_side_prefill_ctas > 0
          ? std::max(context.prefill_ctas_per_wave.hopper_tile128 - step.side_by_side_prefill_ctas, 0)
          : 0;
  step.offsets = LayOut(batch, step.run_decode ? step.decode.PackedWords() : 0, 0);
  return step;
}

int32_t SideBySidePrefillCtas(const StepBatch& batch, const CacheGeometry& geometry,
                              int32_t hopper_wave) {
  double flops = 0;       // the prefill's Q K^T and P V
  double kv_bytes = 0;    // the decode's K and V
  for (int32_t b = 0; b < batch.batch_size; ++b) {
    const int32_t rows = batch.Rows(b);
    const double keys = static_cast<double>(batch.KvLength(b, geometry.page_size));
    if (rows > 1) {
      // Causal: row i of q new rows sees keys - q + i + 1 keys.
      const double seen = batch.options.params.causal ? rows * (keys - rows) + 0.5 * rows * (rows + 1.0)
                                                      : rows * keys;
      flops += 2.0 * seen * geometry.num_qo_heads * (geometry.k_head_dim + geometry.v_head_dim);
    } else if (rows == 1) {
      kv_bytes += keys * geometry.num_kv_heads * (geometry.k_head_dim + geometry.v_head_dim) *
                  DTypeBytes(geometry.kv_dtype);
    }
  }
  if (hopper_wave <= 1 || flops <= 0 || flops > kSideBySideMaxFlopsPerByte * kv_bytes) return 0;
  const double prefill_part = flops / (flops + kPrefillFlopsPerDecodeByte * kv_bytes);
  const double share = prefill_part < kSideBySideSmallPrefill ? kSideBySideSmallPrefillShare : kSideBySidePrefillShare;
  return std::max(1, static_cast<int32_t>(share * hopper_wave + 0.5));
}

absl::StatusOr<PodPlan> PlanPodStep(const StepBatch& batch, const CacheGeometry& geometry,
                                    const PrefillWaveSizes& prefill_ctas_per_wave,
                                    const PodWaveSizes& pod_ctas_per_wave) {
  std::vector<int32_t> kv_lengths(batch.batch_size);
  for (int32_t b = 0; b < batch.batch_size; ++b) {
    kv_lengths[b] = static_cast<int32_t>(batch.KvLength(b, geometry.page_size));
  }
  return PlanPod(PrefillInputOf(batch, geometry, kv_lengths, prefill_ctas_per_wave),
                 pod_ctas_per_wave);
}

}  // namespace attnd::plan
