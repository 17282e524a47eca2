// Writes the seed corpus (tests/fuzz/corpus): small valid and almost-valid cases covering
// every request type, every cache shape of case_builder.h and every step ending (commit by
// last layer, EndStep, abort, stream close, TTL expiry, forced cache deletion).
//
//   make_seeds OUTPUT_DIR
//
// Deterministic: the same binary writes the same bytes, so regenerating shows a diff only when
// this file changed.
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "attnd/kernels/dtype.h"
#include "case_builder.h"

namespace attnd::fuzz {
namespace {

class SeedWriter {
 public:
  explicit SeedWriter(std::filesystem::path dir) : dir_(std::move(dir)) {}
  void Write(const std::string& name, const std::string& bytes) {
    std::ofstream file(dir_ / name, std::ios::binary | std::ios::trunc);
    file.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    ++count_;
  }
  void Write(const std::string& name, const FuzzCase& fuzz_case) {
    Write(name, fuzz_case.SerializeAsString());
  }
  int count() const { return count_; }

 private:
  std::filesystem::path dir_;
  int count_ = 0;
};

// A managed cache of kMhaManaged shape with its geometry.
struct Managed {
  FuzzCase fuzz_case;
  CacheGeometry g;
  Managed() {
    *fuzz_case.mutable_cache() = SmallCache(CacheVariant::kMhaManaged);
    g = ResolvedGeometry(fuzz_case.cache());
  }
  void Plan(const Entries& entries, uint32_t stream = 0, bool lse = false) {
    attnd::v1::PlanRequest plan = ManagedPlan("fuzz", entries);
    if (lse) plan.mutable_options()->set_return_lse(true);
    *fuzz_case.add_actions() = PlanAction(std::move(plan), stream);
  }
  void Forward(uint64_t ordinal, int32_t layer, std::mt19937_64& rng, uint32_t stream = 0,
               bool async = false) {
    *fuzz_case.add_actions() = ForwardAction(
        ValidForward(g, PlannedTokens(fuzz_case, ordinal), layer, ordinal, rng), stream, async);
  }
  void End(uint64_t ordinal, bool abort, uint32_t stream = 0) {
    *fuzz_case.add_actions() = EndStepAction(ordinal, abort, stream);
  }
  // The case's first step: `tokens` tokens of sequence 1 through both layers (committed by the
  // last one).
  void FirstStep(int32_t tokens, std::mt19937_64& rng) {
    Plan({{1, tokens}});
    Forward(1, 0, rng);
    Forward(1, 1, rng);
  }
  // A second cache of the same shape, "other" (export/import targets).
  void CreateOther() {
    Action create;
    *create.mutable_create_cache() = SmallCache(CacheVariant::kMhaManaged, "other");
    *fuzz_case.add_actions() = create;
  }
  // A HOST_SHM channel on `cache` of `slots` slots of `max_tokens` rows.
  void OpenShmChannel(const std::string& cache, int32_t max_tokens, int32_t slots) {
    Action open;
    attnd::v1::OpenChannelRequest& request = *open.mutable_open_channel();
    request.set_cache(cache);
    request.set_kind(attnd::v1::CHANNEL_KIND_HOST_SHM);
    request.set_max_tokens(max_tokens);
    request.set_slots(slots);
    *fuzz_case.add_actions() = open;
  }
};

Action ForkAction(uint64_t source, uint64_t new_id, int64_t tokens) {
  Action action;
  attnd::v1::ForkSequenceRequest* fork = action.mutable_fork_sequence();
  fork->set_cache("fuzz");
  fork->set_source_id(source);
  fork->set_new_id(new_id);
  fork->set_num_tokens(tokens);
  return action;
}

Action ExportImportAction(uint64_t id, const std::string& target, uint64_t new_id,
                          int64_t chunk_bytes) {
  Action action;
  ExportImport* copy = action.mutable_export_import();
  copy->mutable_export_()->set_cache("fuzz");
  copy->mutable_export_()->set_sequence_id(id);
  copy->mutable_export_()->set_max_chunk_bytes(chunk_bytes);
  copy->set_target_cache(target);
  copy->set_new_id(new_id);
  return action;
}

// ForkSequence, copy-on-write, ExportSequence/ImportSequence (issue 17). Their own generator, so
// the seeds above keep their bytes.
void WriteLifecycleSeeds(SeedWriter& out) {
  std::mt19937_64 rng(20261125);
  {  // Fork inside a page; both sides write into the shared page; the source freed first.
    Managed m;
    m.FirstStep(6, rng);
    *m.fuzz_case.add_actions() = ForkAction(1, 2, 5);
    *m.fuzz_case.add_actions() = ForkAction(1, 3, 0);
    m.Plan({{2, 1}, {3, 2}});
    m.Forward(2, 0, rng);
    m.Forward(2, 1, rng);
    *m.fuzz_case.add_actions() = FreeAction("fuzz", {1});
    m.Plan({{3, 1}});
    m.Forward(3, 0, rng);
    m.Forward(3, 1, rng);
    out.Write("fork_copy_on_write", m.fuzz_case);
  }
  {  // A copying step aborted, then committed early (the unrun layer's copy at commit).
    Managed m;
    m.FirstStep(3, rng);
    *m.fuzz_case.add_actions() = ForkAction(1, 2, 0);
    m.Plan({{2, 1}});
    m.Forward(2, 0, rng);
    m.End(2, /*abort=*/true);
    m.Plan({{2, 1}});
    m.Forward(3, 0, rng);
    m.End(3, /*abort=*/false);
    *m.fuzz_case.add_actions() = ForkAction(2, 2, 0);  // exists
    *m.fuzz_case.add_actions() = ForkAction(9, 4, 0);  // no source
    *m.fuzz_case.add_actions() = ForkAction(1, 5, 4);  // longer than the source
    out.Write("fork_abort_and_early_commit", m.fuzz_case);
  }
  {  // Export/import round trips into a second cache, and damaged copies of it.
    Managed m;
    m.CreateOther();
    m.FirstStep(7, rng);
    *m.fuzz_case.add_actions() = ExportImportAction(1, "other", 0, 300);
    Action corrupt = ExportImportAction(1, "other", 2, 300);
    corrupt.mutable_export_import()->set_corrupt_message(3);
    corrupt.mutable_export_import()->set_corrupt_byte(17);
    *m.fuzz_case.add_actions() = corrupt;
    Action truncated = ExportImportAction(1, "other", 3, 0);
    truncated.mutable_export_import()->set_drop_message(4);
    *m.fuzz_case.add_actions() = truncated;
    Action repeated = ExportImportAction(1, "other", 4, 0);
    repeated.mutable_export_import()->set_repeat_message(2);
    *m.fuzz_case.add_actions() = repeated;
    Action abandoned = ExportImportAction(1, "other", 5, 0);
    abandoned.mutable_export_import()->set_abandon_after(2);
    *m.fuzz_case.add_actions() = abandoned;
    *m.fuzz_case.add_actions() = ExportImportAction(1, "fuzz", 6, 0);  // same cache, new id
    *m.fuzz_case.add_actions() = ExportImportAction(1, "fuzz", 1, 0);  // id taken
    m.Plan({{6, 1}});
    m.Forward(2, 0, rng);
    m.Forward(2, 1, rng);
    out.Write("export_import", m.fuzz_case);
  }
  {  // Export and import through a HOST_SHM channel (regions of ~1.8 KiB: chunks of one page),
     // damaged, and with a step on the channel in between.
    Managed m;
    m.CreateOther();
    m.OpenShmChannel("other", 1, 2);
    m.FirstStep(7, rng);
    Action through = ExportImportAction(1, "other", 0, 0);
    through.mutable_export_import()->mutable_export_()->set_channel_id(1);
    through.mutable_export_import()->set_import_channel_id(1);
    *m.fuzz_case.add_actions() = through;
    Action corrupt = ExportImportAction(1, "other", 2, 0);
    corrupt.mutable_export_import()->mutable_export_()->set_channel_id(1);
    corrupt.mutable_export_import()->set_import_channel_id(1);
    corrupt.mutable_export_import()->set_corrupt_message(4);
    corrupt.mutable_export_import()->set_corrupt_byte(5);
    *m.fuzz_case.add_actions() = corrupt;
    Action grpc_in = ExportImportAction(1, "other", 3, 0);
    grpc_in.mutable_export_import()->mutable_export_()->set_channel_id(1);
    *m.fuzz_case.add_actions() = grpc_in;
    Action unknown = ExportImportAction(1, "other", 4, 0);
    unknown.mutable_export_import()->mutable_export_()->set_channel_id(7);
    *m.fuzz_case.add_actions() = unknown;
    out.Write("export_import_channel", m.fuzz_case);
  }
  {  // A sequence of 4 pages a (layer, pool) through regions that hold 3: the channel cuts the
     // export's chunks at the region (3 + 1 pages), a gRPC export takes all 4 in one.
    Managed m;
    m.CreateOther();
    m.OpenShmChannel("other", 1, 2);
    m.FirstStep(16, rng);
    for (const uint64_t import_channel : {uint64_t{0}, uint64_t{1}}) {
      Action through = ExportImportAction(1, "other", 1 + import_channel, 0);
      through.mutable_export_import()->mutable_export_()->set_channel_id(1);
      through.mutable_export_import()->set_import_channel_id(import_channel);
      *m.fuzz_case.add_actions() = through;
    }
    out.Write("export_import_channel_chunks", m.fuzz_case);
  }
  {  // A chunk repeated at the end and its first copy dropped: every chunk once, in another
     // order, which is a whole import (chunks come in any order), not a damaged one.
    Managed m;
    m.CreateOther();
    m.FirstStep(7, rng);
    Action moved = ExportImportAction(1, "other", 0, 0);
    moved.mutable_export_import()->set_repeat_message(2);
    moved.mutable_export_import()->set_drop_message(2);
    *m.fuzz_case.add_actions() = moved;
    out.Write("export_import_reordered", m.fuzz_case);
  }
  {  // A hand-written import stream: a header for 2 tokens and one chunk of K of layer 0 only.
    Managed m;
    Action action;
    ImportStream* stream = action.mutable_import_stream();
    attnd::v1::ImportSequenceRequest* first = stream->add_messages();
    first->set_cache("fuzz");
    first->set_sequence_id(3);
    attnd::v1::SequenceHeader* header = first->mutable_header();
    *header->mutable_config() = m.fuzz_case.cache().config();
    header->mutable_config()->set_num_pages(m.g.num_pages);
    header->set_num_tokens(2);
    header->set_num_pages(1);
    attnd::v1::SequenceChunk* chunk = stream->add_messages()->mutable_chunk();
    chunk->set_layer(0);
    chunk->set_pool(attnd::v1::KV_POOL_K);
    chunk->set_num_pages(1);
    chunk->set_data(std::string(m.g.KPageBytes(), '\x01'));
    *m.fuzz_case.add_actions() = action;
    out.Write("import_stream_partial", m.fuzz_case);
    attnd::v1::ForkSequenceRequest raw;
    raw.set_source_id(1);
    raw.set_new_id(2);
    out.Write("raw_fork_sequence", raw.SerializeAsString());
  }
}

void WriteAll(SeedWriter& out) {
  std::mt19937_64 rng(20240601);
  for (int v = 0; v < static_cast<int>(CacheVariant::kCount); ++v) {
    out.Write("valid_" + std::to_string(v), ValidCase(static_cast<CacheVariant>(v), rng));
  }
  {  // Abort after one layer, then the same sequence again.
    Managed m;
    m.Plan({{1, 6}});
    m.Forward(1, 0, rng);
    m.End(1, /*abort=*/true);
    m.Plan({{1, 6}}, 0, true);
    m.Forward(2, 0, rng);
    m.Forward(2, 1, rng);
    out.Write("abort_then_redo", m.fuzz_case);
  }
  {  // EndStep commits with a layer not run; a second EndStep{abort} cannot undo it.
    Managed m;
    m.Plan({{1, 3}, {2, 1}});
    m.Forward(1, 1, rng);
    m.End(1, false);
    m.End(1, true);
    m.Forward(1, 0, rng);
    out.Write("commit_partial", m.fuzz_case);
  }
  {  // A stream goes away mid-step, with a layer in flight.
    Managed m;
    m.Plan({{1, 5}}, 1);
    m.Forward(1, 0, rng, 1, /*async=*/true);
    Action close;
    close.set_stream(1);
    close.mutable_close_stream();
    *m.fuzz_case.add_actions() = close;
    m.Forward(1, 1, rng, 1);
    out.Write("stream_close_mid_step", m.fuzz_case);
  }
  {  // Deleting a cache with an open step: refused without force, aborted with it.
    Managed m;
    m.Plan({{1, 4}});
    m.Forward(1, 0, rng, 0, /*async=*/true);
    *m.fuzz_case.add_actions() = DeleteAction("fuzz", false);
    *m.fuzz_case.add_actions() = DeleteAction("fuzz", true);
    m.Forward(1, 1, rng);
    Action create;
    *create.mutable_create_cache() = SmallCache(CacheVariant::kMhaManaged);
    *m.fuzz_case.add_actions() = create;
    m.Plan({{1, 2}});
    out.Write("delete_open_step", m.fuzz_case);
  }
  {  // TTL expiry between layers.
    Managed m;
    m.Plan({{3, 2}});
    m.Forward(1, 0, rng);
    Action expire;
    expire.mutable_expire_steps();
    *m.fuzz_case.add_actions() = expire;
    m.Forward(1, 1, rng);
    m.End(1, false);
    m.Plan({{3, 2}});
    out.Write("ttl_expiry", m.fuzz_case);
  }
  {  // Capacity: one page over the pool, then exactly the pool.
    Managed m;
    const int32_t capacity = static_cast<int32_t>(m.g.num_pages * m.g.page_size);
    m.Plan({{1, capacity - 4}, {2, 5}});
    m.Plan({{1, capacity - 4}, {2, 4}});
    m.End(2, true);
    out.Write("capacity", m.fuzz_case);
  }
  {  // Two plans on one sequence: the second is refused while the first is open.
    Managed m;
    m.Plan({{1, 2}});
    m.Plan({{1, 1}, {2, 1}}, 1);
    m.End(1, false);
    m.Plan({{1, 1}, {2, 1}}, 1);
    m.Forward(3, 0, rng, 1);
    out.Write("sequence_in_open_step", m.fuzz_case);
  }
  {  // FreeSequences: while in a step, unknown, repeated, then fine.
    Managed m;
    m.Plan({{1, 5}, {2, 2}});
    *m.fuzz_case.add_actions() = FreeAction("fuzz", {1});
    m.Forward(1, 0, rng);
    m.Forward(1, 1, rng);
    *m.fuzz_case.add_actions() = FreeAction("fuzz", {1, 99});
    *m.fuzz_case.add_actions() = FreeAction("fuzz", {1, 1});
    *m.fuzz_case.add_actions() = FreeAction("fuzz", {2, 1});
    *m.fuzz_case.add_actions() = FreeAction("nope", {2});
    out.Write("free_sequences", m.fuzz_case);
  }
  {  // More open steps than the limit; padding-only and empty plans.
    Managed m;
    for (uint64_t id = 1; id <= 9; ++id) m.Plan({{id, 1}});
    m.Plan({{0, 0}, {0, 0}});
    m.Plan({});
    out.Write("open_step_limit", m.fuzz_case);
  }
  {  // Plans the validation must refuse.
    Managed m;
    m.Plan({{1, -1}});
    m.Plan({{1, 1}, {1, 2}});
    m.Plan({{1, std::numeric_limits<int32_t>::max()}});
    attnd::v1::PlanRequest pages = ManagedPlan("fuzz", {{1, 1}});
    pages.mutable_entries(0)->mutable_pages()->add_page_ids(0);
    *m.fuzz_case.add_actions() = PlanAction(pages);
    attnd::v1::PlanRequest options = ManagedPlan("fuzz", {{1, 1}});
    options.mutable_options()->set_sm_scale(std::numeric_limits<float>::quiet_NaN());
    options.mutable_options()->set_window_left(-2);
    *m.fuzz_case.add_actions() = PlanAction(options);
    attnd::v1::PlanRequest fine = ManagedPlan("fuzz", {{1, 1}});
    fine.mutable_options()->set_logits_soft_cap(30.0f);
    fine.mutable_options()->set_window_left(0);
    fine.mutable_options()->set_causal(false);
    fine.mutable_options()->set_return_lse(true);
    *m.fuzz_case.add_actions() = PlanAction(fine);
    m.Forward(6, 0, rng);
    out.Write("invalid_plans", m.fuzz_case);
  }
  {  // A channel: steps on it run through Forward{use_channel} in any layer order; a second
     // step aborted, the channel closed with a third open, bad opens refused.
    Managed m;
    attnd::v1::OpenChannelRequest open;
    open.set_cache("fuzz");
    open.set_kind(attnd::v1::CHANNEL_KIND_HOST_SHM);
    open.set_max_tokens(8);
    open.set_with_lse(true);
    Action open_action;
    *open_action.mutable_open_channel() = open;
    *m.fuzz_case.add_actions() = open_action;
    attnd::v1::PlanRequest plan = ManagedPlan("fuzz", {{1, 3}, {2, 1}});
    plan.mutable_options()->set_return_lse(true);
    plan.set_channel_id(1);
    *m.fuzz_case.add_actions() = PlanAction(plan);
    for (const int32_t layer : {1, 0}) {
      attnd::v1::ForwardRequest through;
      through.set_step_id(1);
      through.set_layer(layer);
      through.set_use_channel(true);
      *m.fuzz_case.add_actions() = ForwardAction(through);
    }
    plan = ManagedPlan("fuzz", {{1, 1}});
    plan.set_channel_id(1);
    *m.fuzz_case.add_actions() = PlanAction(plan);
    m.End(2, /*abort=*/true);
    *m.fuzz_case.add_actions() = PlanAction(plan);
    Action close;
    close.mutable_close_channel()->set_channel_id(1);
    *m.fuzz_case.add_actions() = close;
    open.set_max_tokens(0);
    *open_action.mutable_open_channel() = open;
    *m.fuzz_case.add_actions() = open_action;
    open.set_max_tokens(4);
    open.set_kind(attnd::v1::CHANNEL_KIND_CUDA_IPC);
    *open_action.mutable_open_channel() = open;
    *m.fuzz_case.add_actions() = open_action;
    out.Write("channel_steps", m.fuzz_case);
  }
  {  // Issue 19's fields: NCCL refused on the cpu backend, client_pci_bus_id malformed
     // (refused by field), well-formed (ignored by HOST_SHM), and on CUDA_IPC.
    Managed m;
    attnd::v1::OpenChannelRequest open;
    open.set_cache("fuzz");
    open.set_max_tokens(4);
    Action open_action;
    for (const auto& [kind, bus_id] :
         std::vector<std::pair<attnd::v1::ChannelKind, std::string>>{
             {attnd::v1::CHANNEL_KIND_NCCL, ""},
             {attnd::v1::CHANNEL_KIND_HOST_SHM, "not:a:bus:id"},
             {attnd::v1::CHANNEL_KIND_HOST_SHM, "0000:3B:00.0"},
             {attnd::v1::CHANNEL_KIND_CUDA_IPC, "3b:00.0"}}) {
      open.set_kind(kind);
      open.set_client_pci_bus_id(bus_id);
      *open_action.mutable_open_channel() = open;
      *m.fuzz_case.add_actions() = open_action;
    }
    out.Write("channel_kinds", m.fuzz_case);
  }
  {  // Forwards the validation must refuse, then the same layer right.
    Managed m;
    m.Plan({{1, 2}, {2, 1}});
    attnd::v1::ForwardRequest good = ValidForward(m.g, 3, 0, 1, rng);
    attnd::v1::ForwardRequest bad = good;
    bad.mutable_q()->set_shape(0, 4);
    *m.fuzz_case.add_actions() = ForwardAction(bad);
    bad = good;
    bad.mutable_k()->set_dtype(attnd::v1::DTYPE_FLOAT16);
    *m.fuzz_case.add_actions() = ForwardAction(bad);
    bad = good;
    bad.mutable_v()->mutable_data()->pop_back();
    *m.fuzz_case.add_actions() = ForwardAction(bad);
    bad = good;
    bad.set_layer(2);
    *m.fuzz_case.add_actions() = ForwardAction(bad);
    bad = good;
    bad.set_layer(-1);
    *m.fuzz_case.add_actions() = ForwardAction(bad);
    bad = good;
    *bad.mutable_ckv() = good.q();
    *m.fuzz_case.add_actions() = ForwardAction(bad);
    bad = good;
    bad.mutable_q()->add_values(1.0f);
    *m.fuzz_case.add_actions() = ForwardAction(bad);
    // The same q as float values (the grpcurl form): valid.
    bad = good;
    attnd::v1::Tensor& q = *bad.mutable_q();
    const int64_t elements = static_cast<int64_t>(q.data().size()) / 2;
    for (int64_t i = 0; i < elements; ++i) q.add_values(LoadAsFloat(DType::kBFloat16, q.data().data(), i));
    q.clear_data();
    *m.fuzz_case.add_actions() = ForwardAction(bad);
    *m.fuzz_case.add_actions() = ForwardAction(good);
    m.Forward(1, 1, rng);
    out.Write("invalid_forwards", m.fuzz_case);
  }
  {  // EXTERNAL page tables the validation must refuse, then a valid one.
    FuzzCase c;
    *c.mutable_cache() = SmallCache(CacheVariant::kMhaExternal);
    const CacheGeometry g = ResolvedGeometry(c.cache());
    attnd::v1::PlanRequest plan = ExternalPlan("fuzz", g, {{5, 2}}, false);
    attnd::v1::PlanRequest bad = plan;
    bad.mutable_entries(0)->mutable_pages()->set_page_ids(1, static_cast<int32_t>(g.num_pages));
    *c.add_actions() = PlanAction(bad);
    bad = plan;
    bad.mutable_entries(0)->mutable_pages()->set_page_ids(0, -1);
    *c.add_actions() = PlanAction(bad);
    bad = plan;
    bad.mutable_entries(0)->mutable_pages()->set_kv_len(1);
    *c.add_actions() = PlanAction(bad);
    bad = plan;
    bad.mutable_entries(0)->mutable_pages()->add_v_page_ids(0);
    *c.add_actions() = PlanAction(bad);
    bad = plan;
    bad.mutable_entries(0)->clear_pages();
    *c.add_actions() = PlanAction(bad);
    *c.add_actions() = PlanAction(plan);
    *c.add_actions() = ForwardAction(ValidForward(g, 2, 0, 6, rng));
    *c.add_actions() = ForwardAction(ValidForward(g, 2, 1, 6, rng));
    *c.add_actions() = FreeAction("fuzz", {100});
    out.Write("external_pages", c);
  }
  {  // Invalid cache configs fall back to the harness's cache.
    FuzzCase c = ValidCase(CacheVariant::kMhaManaged, rng);
    c.mutable_cache()->mutable_config()->set_head_dim(100);
    out.Write("invalid_config_head_dim", c);
    c.mutable_cache()->mutable_config()->set_head_dim(64);
    c.mutable_cache()->mutable_config()->set_page_size(3);
    out.Write("invalid_config_page_size", c);
    c.mutable_cache()->mutable_config()->set_page_size(4);
    c.mutable_cache()->mutable_config()->set_num_pages(int64_t{1} << 40);
    out.Write("invalid_config_num_pages", c);
    c.mutable_cache()->set_name("bad/name");
    out.Write("invalid_config_name", c);
  }
  {  // Raw requests (not cases): the bytes are parsed as every request type.
    const CacheGeometry g = ResolvedGeometry(SmallCache(CacheVariant::kMhaManaged));
    out.Write("raw_plan", ManagedPlan("fuzz", {{1, 2}}).SerializeAsString());
    out.Write("raw_forward", ValidForward(g, 1, 0, 1, rng).SerializeAsString());
    attnd::v1::StreamRequest stream;
    stream.set_tag(7);
    *stream.mutable_plan() = ManagedPlan("", {{5, 1}});
    out.Write("raw_stream_request", stream.SerializeAsString());
    out.Write("raw_create_cache", SmallCache(CacheVariant::kGqaHndFp8).SerializeAsString());
  }
  WriteLifecycleSeeds(out);
}

}  // namespace
}  // namespace attnd::fuzz

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: make_seeds OUTPUT_DIR\n");
    return 2;
  }
  std::filesystem::create_directories(argv[1]);
  attnd::fuzz::SeedWriter writer(argv[1]);
  attnd::fuzz::WriteAll(writer);
  std::printf("make_seeds: wrote %d seeds to %s\n", writer.count(), argv[1]);
  return 0;
}
