// attnctl demo: a small multi-layer run that mixes prefill, decode and padding, checked layer by
// layer against the CPU reference replayed locally.
#include <unistd.h>

#include <cinttypes>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "attnd/client/compare.h"
#include "attnd/client/reference_cache.h"
#include "attnd/client/tensor.h"
#include "cache_flags.h"
#include "commands.h"
#include "global_flags.h"
#include "latency.h"
#include "printing.h"
#include "random_tensors.h"

ABSL_FLAG(bool, keep_cache, false,
          "demo, seq bench: leave the demo (bench) caches on the server afterwards");

namespace attnd::attnctl {
namespace {

struct EntrySpec {
  uint64_t sequence_id;
  int32_t num_new_tokens;  // 0: a padding slot
};

struct StepSpec {
  std::string title;
  std::vector<EntrySpec> entries;
  bool reverse_layers = false;
};

// Sequence 1 and 2 start with prefills (2 is exactly one page), 3 with a single decode token;
// then everyone decodes; then 3 continues with a chunked prefill while 4 arrives.
std::vector<StepSpec> DemoSteps() {
  return {
      {"mixed prefill + decode, one padding slot", {{1, 37}, {0, 0}, {2, 16}, {3, 1}}, false},
      {"decode, one padding slot, layers in reverse order", {{1, 1}, {2, 1}, {3, 1}, {0, 0}},
       true},
      {"chunked prefill + decode + a new sequence", {{3, 9}, {1, 1}, {2, 1}, {4, 5}}, false},
  };
}

std::string DescribeEntry(const EntrySpec& entry, const attnd::v1::PlanEntryResult& result) {
  if (entry.num_new_tokens == 0) return "padding (no rows)";
  auto range = [](int64_t first, int64_t count) {
    return count == 1 ? absl::StrCat(first) : absl::StrCat(first, "..", first + count - 1);
  };
  return absl::StrFormat("seq %d  %-7s %2d token%s  positions %-7s  rows %s", entry.sequence_id,
                         entry.num_new_tokens == 1 ? "decode" : "prefill", entry.num_new_tokens,
                         entry.num_new_tokens == 1 ? " " : "s",
                         range(result.start_position(), entry.num_new_tokens),
                         range(result.row_offset(), entry.num_new_tokens));
}

// Deletes the demo cache on every exit path.
class CacheCleanup {
 public:
  CacheCleanup(client::Client& client, std::string name) : client_(client), name_(std::move(name)) {}
  ~CacheCleanup() {
    if (absl::GetFlag(FLAGS_keep_cache)) {
      absl::PrintF("kept cache %s (--keep_cache)\n", name_);
      return;
    }
    absl::Status status = client_.DeleteCache(name_, /*force=*/true);
    if (status.ok()) {
      absl::PrintF("deleted cache %s\n", name_);
    } else {
      PrintError(absl::StrCat("delete cache ", name_), status);
    }
  }

 private:
  client::Client& client_;
  std::string name_;
};

class Demo {
 public:
  Demo(client::Client& client, const attnd::v1::CacheInfo& cache,
       std::unique_ptr<client::ReferenceCache> reference, DType q_dtype)
      : client_(client),
        cache_(cache),
        reference_(std::move(reference)),
        q_dtype_(q_dtype),
        rng_(absl::GetFlag(FLAGS_seed)),
        o_tolerance_(client::OutputTolerance(q_dtype)),
        lse_tolerance_(client::LseTolerance(q_dtype)) {}

  // Runs every step; returns false on the first failure that stops the demo.
  bool Run() {
    std::unique_ptr<client::StreamSession> session;
    if (absl::GetFlag(FLAGS_stream)) {
      auto opened = client_.OpenStream({.window = 4});
      if (!opened.ok()) {
        PrintError("open ForwardStream", opened.status());
        return false;
      }
      session = *std::move(opened);
    }
    const std::vector<StepSpec> steps = DemoSteps();
    for (size_t i = 0; i < steps.size(); ++i) {
      if (!RunStep(static_cast<int>(i) + 1, steps[i], session.get())) return false;
    }
    return true;
  }

  bool CheckServerCounts() {
    auto info = client_.GetCache(cache_.name());
    if (!info.ok()) {
      PrintError("GetCache", info.status());
      return false;
    }
    int64_t expected_pages = 0;
    std::string lengths;
    for (uint64_t id : {1, 2, 3, 4}) {
      const int64_t length = reference_->SequenceLength(id);
      const int64_t page_size = cache_.config().page_size();
      expected_pages += (length + page_size - 1) / page_size;
      absl::StrAppend(&lengths, lengths.empty() ? "" : ", ", "seq ", id, ": ", length);
    }
    const bool ok = info->num_sequences() == 4 && info->used_pages() == expected_pages &&
                    info->open_steps() == 0;
    absl::PrintF("\nserver cache: %d sequences, %d used pages, %d open steps "
                 "(expected 4, %d, 0)  %s\n",
                 info->num_sequences(), info->used_pages(), info->open_steps(), expected_pages,
                 ok ? "PASS" : "FAIL");
    absl::PrintF("sequence lengths: %s tokens\n", lengths);
    const std::vector<uint64_t> ids = {1, 2, 3, 4};
    auto freed = client_.FreeSequences(cache_.name(), ids);
    if (!freed.ok()) {
      PrintError("FreeSequences", freed.status());
      return false;
    }
    const bool freed_ok = *freed == expected_pages;
    absl::PrintF("freed sequences 1-4: %d pages returned (expected %d)  %s\n", *freed,
                 expected_pages, freed_ok ? "PASS" : "FAIL");
    return ok && freed_ok;
  }

  int layers_checked() const { return layers_checked_; }
  int layers_failed() const { return layers_failed_; }
  double worst_o_error() const { return worst_o_error_; }
  double o_tolerance() const { return o_tolerance_; }
  double lse_tolerance() const { return lse_tolerance_; }

 private:
  bool RunStep(int number, const StepSpec& spec, client::StreamSession* session) {
    attnd::v1::PlanRequest plan;
    plan.set_cache(cache_.name());
    for (const EntrySpec& entry : spec.entries) {
      attnd::v1::PlanEntry* planned = plan.add_entries();
      planned->set_sequence_id(entry.sequence_id);
      planned->set_num_new_tokens(entry.num_new_tokens);
    }
    plan.mutable_options()->set_return_lse(true);

    absl::PrintF("\nstep %d: %s\n", number, spec.title);
    const absl::Time plan_start = absl::Now();
    auto step = session != nullptr ? session->BeginStep(plan) : client_.BeginStep(plan);
    const absl::Duration plan_latency = absl::Now() - plan_start;
    if (!step.ok()) {
      PrintError("Plan", step.status());
      return false;
    }
    if (absl::Status status = reference_->BeginStep(plan); !status.ok()) {
      PrintError("reference plan", status);
      return false;
    }
    const attnd::v1::PlanResponse& planned = (*step)->plan();
    absl::PrintF("  plan: step_id %d, kernel %s, %d rows per layer, %s%s\n", planned.step_id(),
                 planned.kernel(), planned.num_tokens(), FormatLatency(plan_latency),
                 session != nullptr ? " (ForwardStream)" : "");
    for (size_t e = 0; e < spec.entries.size(); ++e) {
      absl::PrintF("    entry %d: %s\n", e,
                   DescribeEntry(spec.entries[e], planned.entries(static_cast<int>(e))));
    }

    const int32_t num_layers = cache_.config().num_layers();
    const int64_t rows = planned.num_tokens();
    const attnd::v1::CacheConfig& config = cache_.config();
    bool committed = false;
    for (int32_t i = 0; i < num_layers; ++i) {
      const int32_t layer = spec.reverse_layers ? num_layers - 1 - i : i;
      attnd::v1::ForwardRequest request;
      request.set_layer(layer);
      auto q = RandomTensor(rng_, q_dtype_, {rows, config.num_qo_heads(), config.head_dim()});
      auto k = RandomTensor(rng_, q_dtype_, {rows, config.num_kv_heads(), config.head_dim()});
      auto v = RandomTensor(rng_, q_dtype_, {rows, config.num_kv_heads(), config.head_dim()});
      if (!q.ok() || !k.ok() || !v.ok()) {
        PrintError("make q/k/v", !q.ok() ? q.status() : !k.ok() ? k.status() : v.status());
        return false;
      }
      *request.mutable_q() = *std::move(q);
      *request.mutable_k() = *std::move(k);
      *request.mutable_v() = *std::move(v);

      const absl::Time start = absl::Now();
      auto response = (*step)->Forward(request);
      const absl::Duration latency = absl::Now() - start;
      if (!response.ok()) {
        PrintError(absl::StrCat("Forward layer ", layer), response.status());
        reference_->EndStep(/*abort=*/true);
        return false;
      }
      auto expected = reference_->Forward(request);
      if (!expected.ok()) {
        PrintError("reference forward", expected.status());
        return false;
      }
      CheckLayer(layer, latency, *response, *expected);
      committed = response->step_committed();
      const bool last = i + 1 == num_layers;
      if (committed != last) {
        absl::PrintF("  FAIL: step_committed is %s after %s layer\n", committed ? "true" : "false",
                     last ? "the last" : "a non-last");
        ++layers_failed_;
      }
    }
    reference_->EndStep(/*abort=*/false);
    if (!committed) {
      auto ended = (*step)->End();
      if (!ended.ok()) PrintError("EndStep", ended.status());
    }
    absl::PrintF("  committed after %d layers\n", num_layers);
    return true;
  }

  void CheckLayer(int32_t layer, absl::Duration latency, const attnd::v1::ForwardResponse& actual,
                  const client::ReferenceOutput& expected) {
    ++layers_checked_;
    std::string problem;
    auto o = client::TensorToFloats(actual.o());
    auto lse = client::TensorToFloats(actual.lse());
    client::ErrorStats o_error;
    client::ErrorStats lse_error;
    if (!o.ok()) {
      problem = absl::StrCat("o: ", o.status().message());
    } else if (actual.o().dtype() != client::ToProto(q_dtype_)) {
      problem = absl::StrCat("o dtype ", DTypeShortName(actual.o().dtype()));
    } else if (!lse.ok()) {
      problem = absl::StrCat("lse: ", lse.status().message());
    } else {
      o_error = client::CompareOutputs(*o, expected.o);
      lse_error = client::CompareOutputs(*lse, expected.lse);
      if (o->size() != expected.o.size()) {
        problem = absl::StrCat("o has ", o->size(), " elements, expected ", expected.o.size());
      } else if (lse->size() != expected.lse.size()) {
        problem = absl::StrCat("lse has ", lse->size(), " elements, expected ",
                               expected.lse.size());
      } else if (o_error.mismatched_non_finite + lse_error.mismatched_non_finite > 0) {
        problem = "non-finite values where the reference has none";
      } else if (o_error.normwise_relative > o_tolerance_) {
        problem = "o error above tolerance";
      } else if (lse_error.max_abs > lse_tolerance_) {
        problem = "lse error above tolerance";
      }
    }
    if (o_error.normwise_relative > worst_o_error_) worst_o_error_ = o_error.normwise_relative;
    if (!problem.empty()) ++layers_failed_;
    absl::PrintF("  layer %d  %9s  o rel err %.2e (max abs %.2e)  lse max err %.2e  %s%s\n", layer,
                 FormatLatency(latency), o_error.normwise_relative, o_error.max_abs,
                 lse_error.max_abs, problem.empty() ? "PASS" : "FAIL: ", problem);
  }

  client::Client& client_;
  const attnd::v1::CacheInfo cache_;
  std::unique_ptr<client::ReferenceCache> reference_;
  const DType q_dtype_;
  std::mt19937_64 rng_;
  const double o_tolerance_;
  const double lse_tolerance_;
  int layers_checked_ = 0;
  int layers_failed_ = 0;
  double worst_o_error_ = 0.0;
};

}  // namespace

int RunDemo(const Args& args) {
  if (!args.empty()) {
    absl::FPrintF(stderr, "usage: attnctl demo [--stream] [--seed=N] [cache shape flags]\n");
    return kExitUsage;
  }
  auto config = CacheConfigFromFlags(CacheShapeDefaults{.num_pages = 64});
  if (!config.ok()) {
    PrintError("demo", config.status());
    return kExitUsage;
  }
  if (config->kind() == attnd::v1::ATTENTION_KIND_MLA ||
      config->page_table_mode() == attnd::v1::PAGE_TABLE_MODE_EXTERNAL) {
    absl::FPrintF(stderr, "attnctl demo: runs MHA/GQA caches in managed mode only\n");
    return kExitUsage;
  }
  auto client = ConnectFromFlags();
  if (!client.ok()) {
    PrintError("connect", client.status());
    return kExitFailure;
  }
  auto info = (*client)->GetServerInfo();
  if (!info.ok()) {
    PrintError("GetServerInfo", info.status());
    return kExitFailure;
  }
  absl::PrintF("attnd %s at %s: backend %s, device %s\n", info->version(),
               (*client)->options().address, info->backend(), info->device());

  std::random_device entropy;
  const std::string name = absl::StrFormat("attnctl-demo-%d-%08x", getpid(), entropy());
  auto cache = (*client)->CreateCache(name, *config);
  if (!cache.ok()) {
    PrintError(absl::StrCat("create cache ", name), cache.status());
    return kExitFailure;
  }
  CacheCleanup cleanup(**client, name);
  absl::PrintF("created cache %s: %s (%s)\n", name, DescribeConfig(cache->config()),
               FormatBytes(cache->pool_bytes()));

  auto reference = client::ReferenceCache::Create(cache->config());
  if (!reference.ok()) {
    PrintError("reference cache", reference.status());
    return kExitFailure;
  }
  const DType q_dtype = (*reference)->q_dtype();
  Demo demo(**client, *cache, *std::move(reference), q_dtype);
  const bool ran = demo.Run();
  const bool counts_ok = ran && demo.CheckServerCounts();
  const bool pass = ran && counts_ok && demo.layers_failed() == 0;
  absl::PrintF(
      "\nresult: %s: %d layer outputs checked, %d failed; worst o error %.2e "
      "(tolerance %.1e normwise relative for %s outputs, lse %.1e absolute, against a float64 "
      "reference over the same stored K/V)\n",
      pass ? "PASS" : "FAIL", demo.layers_checked(), demo.layers_failed(), demo.worst_o_error(),
      demo.o_tolerance(), DTypeShortName(cache->config().q_dtype()), demo.lse_tolerance());
  return pass ? kExitOk : kExitFailure;
}

}  // namespace attnd::attnctl
