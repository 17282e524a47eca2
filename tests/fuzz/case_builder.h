// Builds valid fuzz cases and actions: the seed corpus (make_seeds.cc) and the structure-aware
// mutator (case_mutator.cc) start from these, then bend fields towards edge values.
#pragma once

#include <cstdint>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "attnd/v1/attnd.pb.h"
#include "backend/backend.h"
#include "fuzz_case.pb.h"

namespace attnd::fuzz {

// Cache shapes small enough for the harness's 1 MiB KV budget, covering every axis the
// validation and the kernels branch on.
enum class CacheVariant : int {
  kMhaManaged,        // 2 layers, 2/1 heads (GQA 2), d64, page 4, bf16, NeoX RoPE
  kGqaHndFp8,         // 1 layer, 4/2 heads, d64, page 8, HND, fp16 q, fp8 KV, interleaved RoPE
  kMhaExternal,       // as kMhaManaged, EXTERNAL, SHARED
  kMhaSeparateKv,     // as kMhaManaged, EXTERNAL, SEPARATE_KV
  kMla,               // 1 layer, 2 heads, kv_lora_rank 256, rope 64, page 2
  kLlama3Rope,        // 1 layer, 1/1 heads, d128, page 1, memory_bytes capacity, llama3 scaling
  kCount,
};

attnd::v1::CreateCacheRequest SmallCache(CacheVariant variant, const std::string& name = "fuzz");

// The geometry the server resolves for `request`, or the fallback cache's when it is invalid
// (what the harness falls back to).
CacheGeometry ResolvedGeometry(const attnd::v1::CreateCacheRequest& request);

// (sequence id, new tokens); MANAGED plans.
using Entries = std::vector<std::pair<uint64_t, int32_t>>;
attnd::v1::PlanRequest ManagedPlan(const std::string& cache, const Entries& entries);

// EXTERNAL plans: one entry per (kv_len, new tokens), page ids taken consecutively from
// `first_page` (V pages from `first_v_page` when separate_kv).
struct ExternalEntry {
  int64_t kv_len = 0;
  int32_t num_new_tokens = 0;
};
attnd::v1::PlanRequest ExternalPlan(const std::string& cache, const CacheGeometry& geometry,
                                    const std::vector<ExternalEntry>& entries, bool separate_kv,
                                    int32_t first_page = 0, int32_t first_v_page = 0);

// Rows ValidForward fills at most (the harness refuses bigger steps anyway).
inline constexpr int64_t kMaxValidForwardTokens = 256;

// A Forward with tensors of exactly the shapes and dtype a step of `num_tokens` rows needs, with
// random finite contents. `step_ordinal` is the case-relative step id (1..16).
attnd::v1::ForwardRequest ValidForward(const CacheGeometry& geometry, int64_t num_tokens,
                                       int32_t layer, uint64_t step_ordinal, std::mt19937_64& rng);

// Actions wrapping requests; stream 0 = unary.
Action PlanAction(attnd::v1::PlanRequest plan, uint32_t stream = 0);
Action ForwardAction(attnd::v1::ForwardRequest forward, uint32_t stream = 0, bool async = false);
Action EndStepAction(uint64_t step_ordinal, bool abort, uint32_t stream = 0);
Action FreeAction(const std::string& cache, const std::vector<uint64_t>& ids);
Action DeleteAction(const std::string& cache, bool force);

// Rows of q/k/v of the `ordinal`-th plan (1-based, counting every plan action of the case in
// order, as the harness does), or -1 when there is no such plan.
int64_t PlannedTokens(const FuzzCase& fuzz_case, uint64_t ordinal);
// Plan actions among actions [0, end).
uint64_t CountPlans(const FuzzCase& fuzz_case, int end);
// The plan request carried by an action (plain or on a stream), or null.
const attnd::v1::PlanRequest* PlanOf(const Action& action);

// A whole valid case: a cache of `variant` and a few complete steps (the seed shape).
FuzzCase ValidCase(CacheVariant variant, std::mt19937_64& rng);

}  // namespace attnd::fuzz
