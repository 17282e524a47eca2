#include "backend/cuda_plan_cache.h"

#include <cstring>

namespace attnd::cuda_backend {
namespace {

uint64_t HashOf(const std::vector<int32_t>& key) {
  // FNV-1a over the words: the key is short and compared in full on a hit.
  uint64_t hash = 1469598103934665603ull;
  for (const int32_t word : key) {
    hash ^= static_cast<uint32_t>(word);
    hash *= 1099511628211ull;
  }
  return hash;
}

int32_t Bits(float value) {
  int32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  return bits;
}

}  // namespace

void PlanKeyOf(const StepBatch& batch, int32_t page_size, std::vector<int32_t>& key) {
  key.clear();
  const StepOptions& o = batch.options;
  key.insert(key.end(), {batch.batch_size, o.params.causal ? 1 : 0, Bits(o.params.sm_scale),
                         Bits(o.params.logits_soft_cap), o.params.window_left,
                         Bits(o.params.k_scale), Bits(o.params.v_scale), o.return_lse ? 1 : 0,
                         o.deterministic ? 1 : 0, o.fixed_split_tokens,
                         o.disable_split_kv ? 1 : 0});
  for (int32_t b = 0; b < batch.batch_size; ++b) {
    const int32_t pages = batch.page_indptr[b + 1] - batch.page_indptr[b];
    const int32_t kv_len = pages == 0 ? 0 : (pages - 1) * page_size + batch.last_page_len[b];
    key.push_back(batch.qo_indptr[b + 1] - batch.qo_indptr[b]);
    key.push_back(kv_len);
  }
}

absl::StatusOr<std::shared_ptr<const plan::StepPlan>> PlanCache::Get(const StepBatch& batch,
                                                               const plan::StepPlanContext& context) {
  thread_local std::vector<int32_t> key;
  PlanKeyOf(batch, context.geometry->page_size, key);
  const uint64_t hash = HashOf(key);
  {
    std::lock_guard lock(mu_);
    for (auto it = entries_.begin(); it != entries_.end(); ++it) {
      if (it->hash == hash && it->key == key) {
        entries_.splice(entries_.begin(), entries_, it);
        ++hits_;
        return it->plan;
      }
    }
    ++misses_;
  }
  absl::StatusOr<plan::StepPlan> built = plan::PlanStep(batch, context);
  if (!built.ok()) return built.status();
  auto plan = std::make_shared<const plan::StepPlan>(*std::move(built));
  std::lock_guard lock(mu_);
  entries_.push_front(Entry{hash, key, plan});
  if (entries_.size() > capacity_) entries_.pop_back();
  return plan;
}

int64_t PlanCache::hits() const {
  std::lock_guard lock(mu_);
  return hits_;
}

int64_t PlanCache::misses() const {
  std::lock_guard lock(mu_);
  return misses_;
}

}  // namespace attnd::cuda_backend
