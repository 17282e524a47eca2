// attnctl bench over a channel (--transport=shm|cuda_ipc|nccl), see channel_bench.cc.
#pragma once

#include <cstdint>

#include "attnd/client/client.h"

namespace attnd::attnctl {

struct ChannelBenchSettings {
  int32_t sequences = 0;
  int32_t steps = 0;
  int32_t warmup_steps = 0;
  int32_t prompt_tokens = 0;
  int64_t max_step_tokens = 0;  // the server's limit
  uint64_t first_id = 1;        // sequence ids first_id .. first_id + sequences - 1
  // CUDA_IPC: > 1 adds a pipelined phase: the sequences split into this many micro-batches,
  // each on its own channel and stream, one planned and enqueued while the others run.
  int32_t micro_batches = 1;
  // CUDA_IPC, NCCL: the GPU (this process's CUDA ordinal) the channels are opened from and the
  // emulator runs on; another GPU than attnd's is the peer case. -1: the current one (0).
  int32_t client_device = -1;
};

int RunChannelBench(client::Client& client, const attnd::v1::CacheInfo& cache,
                    const ChannelBenchSettings& settings, attnd::v1::ChannelKind kind);

}  // namespace attnd::attnctl
