// BatchAttention (MHA/GQA): splits the batch into (request, kv head, token chunk) tasks for
// the thread pool; each task converts the keys it needs once, tile by tile, and serves every
// query head of the group from them (attend.h).
#include "reference/attention.h"

#include <algorithm>
#include <vector>

#include "reference/attend.h"
#include "reference/convert.h"
#include "reference/parallel.h"

namespace attnd::reference {
namespace {

// Query rows (token x head in group) per task: enough that converting the task's keys costs
// little next to the products, few enough that a prefill splits over the cores.
constexpr int64_t kRowsPerTask = 64;
// Cache rows requested this many keys before they are converted.
constexpr int64_t kPrefetchKeysAhead = 4;

struct Task {
  int32_t request = 0;
  int32_t kv_head = 0;
  int64_t first_token = 0;  // within the request
  int64_t end_token = 0;
};

const uint8_t* PoolRow(const PagedKvView& pool, const int32_t* page_ids, int32_t page_size,
                       int64_t token, int32_t head) {
  const int64_t page = page_ids[token / page_size];
  const int32_t entry = static_cast<int32_t>(token % page_size);
  return static_cast<const uint8_t*>(pool.data) +
         pool.Offset(page, entry, head) * DTypeBytes(pool.dtype);
}

template <typename T>
void RunTask(const BatchAttentionArgs& args, const Task& task) {
  const int32_t num_qo_heads = args.q.num_heads;
  const int32_t group = num_qo_heads / args.k_cache.num_heads;
  const int32_t head_dim = args.q.head_dim;
  const int32_t request = task.request;
  const int64_t q_begin = args.qo_indptr[request];
  const int64_t q_len = args.qo_indptr[request + 1] - q_begin;
  const int64_t kv_len = args.pages.KvLength(request);
  const int32_t page_size = args.pages.page_size;
  const int32_t* k_pages = args.pages.k_indices + args.pages.indptr[request];
  const int32_t* v_pages = args.pages.v_indices + args.pages.indptr[request];
  const int32_t first_head = task.kv_head * group;

  AttendWorkspace<T>& ws = AttendWorkspace<T>::ForThisThread();
  const int64_t num_rows = (task.end_token - task.first_token) * group;
  ws.ranges.resize(num_rows);
  // Rows are (token, head in group): the heads of one token see the same keys, so a block of
  // rows shares one pass over V.
  for (int64_t row = 0; row < num_rows; ++row)
    ws.ranges[row] = VisibleKeys(args.params, q_len, kv_len, task.first_token + row / group);

  const auto token_of = [&](int64_t row) { return q_begin + task.first_token + row / group; };
  const auto head_of = [&](int64_t row) {
    return first_head + static_cast<int32_t>(row % group);
  };
  const auto load_q = [&](int64_t row, T* out) {
    const auto* base = static_cast<const uint8_t*>(args.q.data) +
                       args.q.Offset(token_of(row), head_of(row)) * DTypeBytes(args.q.dtype);
    ConvertRow<T>(args.q.dtype, base, head_dim, T{1}, out);
  };
  const T k_scale = static_cast<T>(args.params.k_scale);
  const T v_scale = static_cast<T>(args.params.v_scale);
  const int64_t k_row_bytes = int64_t{head_dim} * DTypeBytes(args.k_cache.dtype);
  const int64_t v_row_bytes = int64_t{head_dim} * DTypeBytes(args.v_cache.dtype);
  const auto load_kv = [&](int64_t first_key, int64_t num_keys, T* k_rows, int64_t k_stride, T* v,
                           int64_t v_stride) {
    for (int64_t k = 0; k < num_keys; ++k) {
      const int64_t token = first_key + k;
      if (k + kPrefetchKeysAhead < num_keys) {
        const int64_t ahead = token + kPrefetchKeysAhead;
        PrefetchRow(PoolRow(args.k_cache, k_pages, page_size, ahead, task.kv_head), k_row_bytes);
        PrefetchRow(PoolRow(args.v_cache, v_pages, page_size, ahead, task.kv_head), v_row_bytes);
      }
      ConvertRow<T>(args.k_cache.dtype,
                    PoolRow(args.k_cache, k_pages, page_size, token, task.kv_head), head_dim,
                    k_scale, k_rows + k * k_stride);
      ConvertRow<T>(args.v_cache.dtype,
                    PoolRow(args.v_cache, v_pages, page_size, token, task.kv_head), head_dim,
                    v_scale, v + k * v_stride);
    }
  };
  const auto write_row = [&](int64_t row, const T* o, T lse) {
    const int64_t element = args.o.Offset(token_of(row), head_of(row));
    for (int32_t d = 0; d < head_dim; ++d)
      StoreFromFloat(args.o.dtype, args.o.data, element + d, static_cast<float>(o[d]));
    if (args.lse != nullptr) {
      args.lse[token_of(row) * num_qo_heads + head_of(row)] = static_cast<float>(lse);
    }
  };
  AttendChunk<T>(ws, num_rows, head_dim, head_dim, args.params, load_q, load_kv, write_row);
}

template <typename T>
void Run(const BatchAttentionArgs& args) {
  const int32_t group = args.q.num_heads / args.k_cache.num_heads;
  const int64_t tokens_per_task = std::max<int64_t>(1, kRowsPerTask / group);
  std::vector<Task> tasks;
  for (int32_t request = 0; request < args.pages.batch_size; ++request) {
    const int64_t q_len = args.qo_indptr[request + 1] - args.qo_indptr[request];
    for (int32_t kv_head = 0; kv_head < args.k_cache.num_heads; ++kv_head) {
      for (int64_t first = 0; first < q_len; first += tokens_per_task)
        tasks.push_back({request, kv_head, first, std::min(q_len, first + tokens_per_task)});
    }
  }
  // Longest key ranges first, so a long request does not start last and leave a core idle.
  std::stable_sort(tasks.begin(), tasks.end(), [&](const Task& a, const Task& b) {
    return args.pages.KvLength(a.request) > args.pages.KvLength(b.request);
  });
  ParallelFor(static_cast<int64_t>(tasks.size()),
              [&](int64_t index) { RunTask<T>(args, tasks[index]); });
}

}  // namespace

void BatchAttention(const BatchAttentionArgs& args) {
  if (args.accumulation == Accumulation::kFloat64) {
    Run<double>(args);
  } else {
    Run<float>(args);
  }
}

}  // namespace attnd::reference
