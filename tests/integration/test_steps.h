// Building caches, plans and layers for the integration tests, and running steps against the
// server and the host-side reference together.
#pragma once

#include <cstdint>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "attnd/client/client.h"
#include "attnd/client/reference_cache.h"
#include "attnd/client/step.h"
#include "attnd/v1/attnd.pb.h"

namespace attnd::integration {

// 2 layers, 4 query / 2 KV heads, head_dim 64, 4-token pages (so short sequences cross page
// boundaries), bf16, NeoX RoPE, MANAGED.
attnd::v1::CacheConfig SmallConfig(int64_t num_pages = 64);

// (sequence id, new tokens); 0 tokens is a padding slot.
using Entries = std::vector<std::pair<uint64_t, int32_t>>;

attnd::v1::PlanRequest MakePlan(const std::string& cache, const Entries& entries,
                                bool return_lse = true);

// Random q/k/v for one layer of a step with `rows` rows, in the cache's q dtype.
attnd::v1::ForwardRequest RandomLayer(std::mt19937_64& rng, const attnd::v1::CacheConfig& config,
                                      int64_t rows, int32_t layer);

// Expects `actual` (a server answer) to match `expected` (the reference) within the dtype's
// tolerance, o and lse. `what` names the layer in failure messages.
void ExpectMatchesReference(const attnd::v1::ForwardResponse& actual,
                            const client::ReferenceOutput& expected, DType q_dtype,
                            const std::string& what);

// Runs every layer of an open `step` (in `layer_order`, or 0..L-1 when empty), replaying each
// into `reference` (which must have begun the same plan) and checking each output. Commits the
// reference when the server reports the step committed.
void RunLayersAndCheck(client::Step& step, client::ReferenceCache& reference,
                       const attnd::v1::CacheConfig& config, std::mt19937_64& rng,
                       std::vector<int32_t> layer_order = {});

// Plans and runs a whole step through `client` and `reference`, checking every layer.
void RunStepAndCheck(client::Client& client, client::ReferenceCache& reference,
                     const attnd::v1::CacheInfo& cache, const Entries& entries,
                     std::mt19937_64& rng);

// The committed length of a MANAGED sequence as the server sees it: plans one token for it
// and reads its start position, then aborts. 0 for an unknown sequence.
int64_t ProbeLength(client::Client& client, const std::string& cache, uint64_t sequence_id);

}  // namespace attnd::integration
