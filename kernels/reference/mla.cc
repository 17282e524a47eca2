// MlaAttention, absorbed form: every head of a token shares one latent key row, so a task is a
// (request, rows) chunk whose keys are the concatenation [ckv * ckv_scale, kpe * kpe_scale]
// (kv_lora_rank + rope_dim wide) and whose values are ckv * ckv_scale.
#include <algorithm>
#include <vector>

#include "reference/attend.h"
#include "reference/attention.h"
#include "reference/convert.h"
#include "reference/parallel.h"

namespace attnd::reference {
namespace {

constexpr int64_t kRowsPerTask = 64;
constexpr int64_t kPrefetchKeysAhead = 4;

struct Task {
  int32_t request = 0;
  int64_t first_row = 0;  // rows are (token, head) of the request, token-major
  int64_t end_row = 0;
};

const uint8_t* LatentRow(const PagedKvView& pool, const int32_t* page_ids, int32_t page_size,
                         int64_t token) {
  const int64_t page = page_ids[token / page_size];
  const int32_t entry = static_cast<int32_t>(token % page_size);
  return static_cast<const uint8_t*>(pool.data) +
         pool.Offset(page, entry, 0) * DTypeBytes(pool.dtype);
}

template <typename T>
void RunTask(const MlaAttentionArgs& args, const Task& task) {
  const int32_t num_heads = args.q_nope.num_heads;
  const int32_t latent_dim = args.q_nope.head_dim;
  const int32_t rope_dim = args.q_pe.head_dim;
  const int32_t request = task.request;
  const int64_t q_begin = args.qo_indptr[request];
  const int64_t q_len = args.qo_indptr[request + 1] - q_begin;
  const int64_t kv_len = args.pages.KvLength(request);
  const int32_t page_size = args.pages.page_size;
  const int32_t* ckv_pages = args.pages.k_indices + args.pages.indptr[request];
  const int32_t* kpe_pages = args.pages.v_indices + args.pages.indptr[request];

  AttendWorkspace<T>& ws = AttendWorkspace<T>::ForThisThread();
  const int64_t num_rows = task.end_row - task.first_row;
  ws.ranges.resize(num_rows);
  for (int64_t row = 0; row < num_rows; ++row)
    ws.ranges[row] = VisibleKeys(args.params, q_len, kv_len, (task.first_row + row) / num_heads);

  const auto token_of = [&](int64_t row) { return q_begin + (task.first_row + row) / num_heads; };
  const auto head_of = [&](int64_t row) {
    return static_cast<int32_t>((task.first_row + row) % num_heads);
  };
  const auto load_q = [&](int64_t row, T* out) {
    const int64_t token = token_of(row);
    const int32_t head = head_of(row);
    const auto* nope = static_cast<const uint8_t*>(args.q_nope.data) +
                       args.q_nope.Offset(token, head) * DTypeBytes(args.q_nope.dtype);
    const auto* pe = static_cast<const uint8_t*>(args.q_pe.data) +
                     args.q_pe.Offset(token, head) * DTypeBytes(args.q_pe.dtype);
    ConvertRow<T>(args.q_nope.dtype, nope, latent_dim, T{1}, out);
    ConvertRow<T>(args.q_pe.dtype, pe, rope_dim, T{1}, out + latent_dim);
  };
  const T ckv_scale = static_cast<T>(args.params.k_scale);
  const T kpe_scale = static_cast<T>(args.params.v_scale);
  const int64_t ckv_row_bytes = int64_t{latent_dim} * DTypeBytes(args.ckv_cache.dtype);
  const int64_t kpe_row_bytes = int64_t{rope_dim} * DTypeBytes(args.kpe_cache.dtype);
  const auto load_kv = [&](int64_t first_key, int64_t num_keys, T* k_rows, int64_t k_stride, T* v,
                           int64_t v_stride) {
    for (int64_t k = 0; k < num_keys; ++k) {
      const int64_t token = first_key + k;
      if (k + kPrefetchKeysAhead < num_keys) {
        const int64_t ahead = token + kPrefetchKeysAhead;
        PrefetchRow(LatentRow(args.ckv_cache, ckv_pages, page_size, ahead), ckv_row_bytes);
        PrefetchRow(LatentRow(args.kpe_cache, kpe_pages, page_size, ahead), kpe_row_bytes);
      }
      T* key = k_rows + k * k_stride;
      ConvertRow<T>(args.ckv_cache.dtype, LatentRow(args.ckv_cache, ckv_pages, page_size, token),
                    latent_dim, ckv_scale, key);
      ConvertRow<T>(args.kpe_cache.dtype, LatentRow(args.kpe_cache, kpe_pages, page_size, token),
                    rope_dim, kpe_scale, key + latent_dim);
      // The values are the dequantised ckv just loaded.
      std::copy(key, key + latent_dim, v + k * v_stride);
    }
  };
  const auto write_row = [&](int64_t row, const T* o, T lse) {
    const int64_t element = args.o.Offset(token_of(row), head_of(row));
    for (int32_t d = 0; d < latent_dim; ++d)
      StoreFromFloat(args.o.dtype, args.o.data, element + d, static_cast<float>(o[d]));
    if (args.lse != nullptr) {
      args.lse[token_of(row) * num_heads + head_of(row)] = static_cast<float>(lse);
    }
  };
  AttendChunk<T>(ws, num_rows, latent_dim + rope_dim, latent_dim, args.params, load_q, load_kv,
                 write_row);
}

template <typename T>
void Run(const MlaAttentionArgs& args) {
  const int32_t num_heads = args.q_nope.num_heads;
  std::vector<Task> tasks;
  for (int32_t request = 0; request < args.pages.batch_size; ++request) {
    const int64_t num_rows =
        (args.qo_indptr[request + 1] - int64_t{args.qo_indptr[request]}) * num_heads;
    for (int64_t first = 0; first < num_rows; first += kRowsPerTask)
      tasks.push_back({request, first, std::min(num_rows, first + kRowsPerTask)});
  }
  std::stable_sort(tasks.begin(), tasks.end(), [&](const Task& a, const Task& b) {
    return args.pages.KvLength(a.request) > args.pages.KvLength(b.request);
  });
  ParallelFor(static_cast<int64_t>(tasks.size()),
              [&](int64_t index) { RunTask<T>(args, tasks[index]); });
}

}  // namespace

void MlaAttention(const MlaAttentionArgs& args) {
  if (args.accumulation == Accumulation::kFloat64) {
    Run<double>(args);
  } else {
    Run<float>(args);
  }
}

}  // namespace attnd::reference
