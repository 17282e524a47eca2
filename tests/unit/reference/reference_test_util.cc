#include "reference_test_util.h"

#include <algorithm>
#include <numeric>

namespace attnd::testing {

HostTensor HostTensor::Random(DType dtype, int64_t num_tokens, int32_t num_heads,
                              int32_t head_dim, std::mt19937& rng, double magnitude) {
  HostTensor tensor{dtype, num_tokens, num_heads, head_dim, {}};
  const int64_t count = num_tokens * num_heads * head_dim;
  tensor.bytes.resize(count * DTypeBytes(dtype));
  std::uniform_real_distribution<double> uniform(-magnitude, magnitude);
  for (int64_t i = 0; i < count; ++i)
    StoreFromFloat(dtype, tensor.bytes.data(), i, static_cast<float>(uniform(rng)));
  return tensor;
}

HostTensor HostTensor::Poisoned(DType dtype, int64_t num_tokens, int32_t num_heads,
                                int32_t head_dim) {
  HostTensor tensor{dtype, num_tokens, num_heads, head_dim, {}};
  tensor.bytes.assign(num_tokens * num_heads * head_dim * DTypeBytes(dtype), 0xFF);
  return tensor;
}

double HostTensor::At(int64_t token, int32_t head, int32_t dim) const {
  return LoadAsFloat(dtype, bytes.data(), (token * num_heads + head) * head_dim + dim);
}

bool HostTensor::IsPoisoned(int64_t token, int32_t head, int32_t dim) const {
  const int bytes_per = DTypeBytes(dtype);
  const int64_t offset = ((token * num_heads + head) * head_dim + dim) * bytes_per;
  for (int i = 0; i < bytes_per; ++i)
    if (bytes[offset + i] != 0xFF) return false;
  return true;
}

PagedCache::PagedCache(const PagedCacheSpec& spec) : spec_(spec) {
  std::mt19937 rng(spec.seed);
  const int32_t batch = static_cast<int32_t>(spec.kv_lens.size());
  indptr_.push_back(0);
  for (int32_t b = 0; b < batch; ++b) {
    const int64_t pages = (spec.kv_lens[b] + spec.page_size - 1) / spec.page_size;
    indptr_.push_back(indptr_.back() + static_cast<int32_t>(pages));
    last_page_len_.push_back(
        pages == 0 ? 0 : static_cast<int32_t>(spec.kv_lens[b] - (pages - 1) * spec.page_size));
  }
  num_pages_ = indptr_.back() + spec.spare_pages;
  std::vector<int32_t> ids(num_pages_);
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng);
  k_indices_.assign(ids.begin(), ids.begin() + indptr_.back());
  if (spec.separate_kv) std::shuffle(ids.begin(), ids.end(), rng);
  v_indices_.assign(ids.begin(), ids.begin() + indptr_.back());

  const auto garbage = [&](std::vector<uint8_t>& pool, int32_t head_dim) {
    pool.resize(num_pages_ * spec.page_size * spec.num_heads * head_dim * DTypeBytes(spec.dtype));
    for (uint8_t& byte : pool) byte = static_cast<uint8_t>(rng());
  };
  garbage(k_pool_, spec.head_dim);
  garbage(v_pool_, VHeadDim());
  std::uniform_real_distribution<double> k_values(-spec.k_magnitude, spec.k_magnitude);
  std::uniform_real_distribution<double> v_values(-spec.v_magnitude, spec.v_magnitude);
  for (int32_t b = 0; b < batch; ++b) {
    for (int64_t t = 0; t < spec.kv_lens[b]; ++t) {
      for (int32_t h = 0; h < spec.num_heads; ++h) {
        for (int32_t d = 0; d < spec.head_dim; ++d) {
          StoreFromFloat(spec.dtype, k_pool_.data(), ElementOffset(b, t, h, d, false),
                         static_cast<float>(k_values(rng)));
        }
        for (int32_t d = 0; d < VHeadDim(); ++d) {
          StoreFromFloat(spec.dtype, v_pool_.data(), ElementOffset(b, t, h, d, true),
                         static_cast<float>(v_values(rng)));
        }
      }
    }
  }
}

PageTableView PagedCache::Table() const {
  return {static_cast<int32_t>(last_page_len_.size()), spec_.page_size, indptr_.data(),
          k_indices_.data(), v_indices_.data(), last_page_len_.data()};
}

PagedKvView PagedCache::View(std::vector<uint8_t>& pool, int32_t head_dim) {
  return {pool.data(), spec_.dtype,     spec_.layout, num_pages_,
          spec_.page_size, spec_.num_heads, head_dim};
}

int64_t PagedCache::ElementOffset(int32_t request, int64_t token, int32_t head, int32_t dim,
                                  bool v) const {
  const std::vector<int32_t>& ids = v ? v_indices_ : k_indices_;
  const int64_t page = ids[indptr_[request] + token / spec_.page_size];
  const int64_t entry = token % spec_.page_size;
  const int64_t head_dim = v ? VHeadDim() : spec_.head_dim;
  const int64_t heads = spec_.num_heads;
  const int64_t slot = spec_.layout == KvLayout::kNHD
                           ? (page * spec_.page_size + entry) * heads + head
                           : (page * heads + head) * spec_.page_size + entry;
  return slot * head_dim + dim;
}

double PagedCache::K(int32_t request, int64_t token, int32_t head, int32_t dim) const {
  return LoadAsFloat(spec_.dtype, k_pool_.data(), ElementOffset(request, token, head, dim, false));
}

double PagedCache::V(int32_t request, int64_t token, int32_t head, int32_t dim) const {
  return LoadAsFloat(spec_.dtype, v_pool_.data(), ElementOffset(request, token, head, dim, true));
}

}  // namespace attnd::testing
