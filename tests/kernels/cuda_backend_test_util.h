// Fixtures of cuda_backend_test: steps built the way the engine builds them, random inputs,
// and the error measures the CUDA backend is held to against the CPU backend.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <memory>
#include <numeric>
#include <random>
#include <utility>
#include <vector>

#include "attnd/kernels/dtype.h"
#include "absl/status/statusor.h"
#include "backend/backend.h"
#include "backend/cpu_backend.h"
#include "backend/cuda_backend.h"

namespace attnd::testing {

// The engine's managed-page bookkeeping and StepBatch construction (server/engine/plan.cc),
// with pages handed out in a shuffled order so requests' pages are scattered. SEPARATE_KV tables
// draw V pages from their own shuffled list, as an external block manager would.
class SequenceBook {
 public:
  SequenceBook(const CacheGeometry& geometry, bool separate_kv, uint32_t seed)
      : page_size_(geometry.page_size), separate_kv_(separate_kv) {
    std::mt19937 rng(seed);
    for (auto* free : {&k_free_, &v_free_}) {
      free->resize(geometry.num_pages);
      std::iota(free->begin(), free->end(), 0);
      std::shuffle(free->begin(), free->end(), rng);
    }
  }

  // entries: {sequence id, new tokens}; 0 tokens is a padding slot.
  std::shared_ptr<StepBatch> Plan(const std::vector<std::pair<int, int32_t>>& entries,
                                  const StepOptions& options) {
    auto batch = std::make_shared<StepBatch>();
    batch->batch_size = static_cast<int32_t>(entries.size());
    batch->options = options;
    batch->qo_indptr.push_back(0);
    batch->page_indptr.push_back(0);
    bool decode = false;
    bool prefill = false;
    for (size_t i = 0; i < entries.size(); ++i) {
      const auto [id, new_tokens] = entries[i];
      int64_t kv_len = 0;
      if (new_tokens > 0) {
        Sequence& sequence = sequences_[id];
        const int64_t start = sequence.length;
        sequence.length += new_tokens;
        kv_len = sequence.length;
        while (static_cast<int64_t>(sequence.k_pages.size()) * page_size_ < kv_len) {
          sequence.k_pages.push_back(Take(k_free_));
          sequence.v_pages.push_back(separate_kv_ ? Take(v_free_) : sequence.k_pages.back());
        }
        batch->k_page_indices.insert(batch->k_page_indices.end(), sequence.k_pages.begin(),
                                     sequence.k_pages.end());
        batch->v_page_indices.insert(batch->v_page_indices.end(), sequence.v_pages.begin(),
                                     sequence.v_pages.end());
        for (int32_t t = 0; t < new_tokens; ++t) {
          batch->token_batch_indices.push_back(static_cast<int32_t>(i));
          batch->token_positions.push_back(static_cast<int32_t>(start + t));
        }
        decode |= new_tokens == 1;
        prefill |= new_tokens > 1;
      }
      batch->num_tokens += new_tokens;
      batch->qo_indptr.push_back(batch->qo_indptr.back() + new_tokens);
      batch->page_indptr.push_back(static_cast<int32_t>(batch->k_page_indices.size()));
      const int64_t pages = (kv_len + page_size_ - 1) / page_size_;
      batch->last_page_len.push_back(
          pages == 0 ? 0 : static_cast<int32_t>(kv_len - (pages - 1) * page_size_));
    }
    batch->phase = decode && prefill ? StepPhase::kMixed
                   : prefill         ? StepPhase::kPrefill
                   : decode          ? StepPhase::kDecode
                                     : StepPhase::kEmpty;
    return batch;
  }

 private:
  struct Sequence {
    std::vector<int32_t> k_pages;
    std::vector<int32_t> v_pages;
    int64_t length = 0;
  };
  static int32_t Take(std::vector<int32_t>& free) {
    const int32_t page = free.back();
    free.pop_back();
    return page;
  }

  int32_t page_size_;
  bool separate_kv_;
  std::vector<int32_t> k_free_;
  std::vector<int32_t> v_free_;
  std::map<int, Sequence> sequences_;
};

inline std::vector<uint8_t> RandomTensor(DType dtype, int64_t elements, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<uint8_t> bytes(elements * DTypeBytes(dtype));
  for (int64_t i = 0; i < elements; ++i) StoreFromFloat(dtype, bytes.data(), i, normal(rng));
  return bytes;
}

// ||a - b|| / ||b|| over every element, and whether `a` holds a NaN (an unwritten element).
struct Error {
  double relative = 0.0;
  bool nan = false;
};

inline Error NormwiseError(DType dtype, const std::vector<uint8_t>& a, const std::vector<uint8_t>& b) {
  Error error;
  double diff = 0.0;
  double norm = 0.0;
  const int64_t elements = static_cast<int64_t>(a.size()) / DTypeBytes(dtype);
  for (int64_t i = 0; i < elements; ++i) {
    const double x = LoadAsFloat(dtype, a.data(), i);
    const double y = LoadAsFloat(dtype, b.data(), i);
    if (std::isnan(x)) error.nan = true;
    diff += (x - y) * (x - y);
    norm += y * y;
  }
  error.relative = norm > 0.0 ? std::sqrt(diff / norm) : std::sqrt(diff);
  return error;
}

inline double MaxLseDifference(const std::vector<float>& a, const std::vector<float>& b) {
  double worst = 0.0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::isinf(a[i]) || std::isinf(b[i])) {
      if (a[i] != b[i]) return INFINITY;
      continue;
    }
    if (std::isnan(a[i]) || std::isnan(b[i])) return NAN;
    worst = std::max(worst, std::fabs(static_cast<double>(a[i]) - b[i]));
  }
  return worst;
}

// Distance in units in the last place between two codes of a sign-magnitude format.
inline int64_t UlpDistance(uint32_t a, uint32_t b, int bits) {
  const uint32_t sign = 1u << (bits - 1);
  auto ordered = [sign](uint32_t code) {
    return (code & sign) ? -static_cast<int64_t>(code & (sign - 1)) : static_cast<int64_t>(code);
  };
  return std::llabs(ordered(a) - ordered(b));
}

// A cache of `geometry` on a CUDA backend and on a CPU backend of `budget_bytes` each; the CUDA
// backend reports to `observer` (may be null). Members go in reverse order: caches before their
// backends.
struct BackendPair {
  std::unique_ptr<Backend> gpu_backend;
  std::unique_ptr<Backend> cpu_backend;
  std::unique_ptr<BackendCache> gpu;
  std::unique_ptr<BackendCache> cpu;
};

inline absl::StatusOr<BackendPair> MakeBackendPair(const CacheGeometry& geometry,
                                                   int64_t budget_bytes,
                                                   BackendObserver* observer) {
  BackendPair pair;
  CudaBackendOptions cuda_options;
  cuda_options.kv_budget_bytes = budget_bytes;
  cuda_options.observer = observer;
  absl::StatusOr<std::unique_ptr<Backend>> gpu_backend = MakeCudaBackend(cuda_options);
  if (!gpu_backend.ok()) return gpu_backend.status();
  pair.gpu_backend = *std::move(gpu_backend);
  CpuBackendOptions cpu_options;
  cpu_options.kv_budget_bytes = budget_bytes;
  pair.cpu_backend = MakeCpuBackend(cpu_options);
  absl::StatusOr<std::unique_ptr<BackendCache>> gpu = pair.gpu_backend->CreateCache(geometry);
  if (!gpu.ok()) return gpu.status();
  pair.gpu = *std::move(gpu);
  absl::StatusOr<std::unique_ptr<BackendCache>> cpu = pair.cpu_backend->CreateCache(geometry);
  if (!cpu.ok()) return cpu.status();
  pair.cpu = *std::move(cpu);
  return pair;
}

}  // namespace attnd::testing
