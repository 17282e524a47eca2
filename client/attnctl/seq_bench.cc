#include "seq_bench.h"

#include <zlib.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/declare.h"
#include "absl/flags/flag.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "attnd/client/channel.h"
#include "attnd/client/sequence.h"
#include "attnd/status_macros.h"
#include "cache_flags.h"
#include "commands.h"
#include "global_flags.h"
#include "printing.h"

ABSL_DECLARE_FLAG(int64_t, tokens);
ABSL_DECLARE_FLAG(std::string, channel);
ABSL_DECLARE_FLAG(bool, keep_cache);
ABSL_FLAG(int32_t, seq_bench_repeat, 3, "seq bench: timed runs of each case");

namespace attnd::attnctl {
namespace {

constexpr char kSource[] = "seqbench-src";
constexpr char kTarget[] = "seqbench-dst";
constexpr uint64_t kSequence = 1;

using Clock = std::chrono::steady_clock;

double SecondsSince(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

int64_t DTypeBytes(attnd::v1::DType dtype) {
  return dtype == attnd::v1::DTYPE_FLOAT8_E4M3 ? 1 : dtype == attnd::v1::DTYPE_FLOAT32 ? 4 : 2;
}

// Bytes of one page of one layer's K (ckv) and V (kpe) pool.
std::pair<int64_t, int64_t> PageBytes(const attnd::v1::CacheConfig& config) {
  const int64_t row = int64_t{config.page_size()} * DTypeBytes(config.kv_dtype());
  if (config.kind() == attnd::v1::ATTENTION_KIND_MLA) {
    return {row * config.kv_lora_rank(), row * config.rope_dim()};
  }
  return {row * config.num_kv_heads() * config.head_dim(),
          row * config.num_kv_heads() * config.head_dim()};
}

// An export's messages for a sequence of random bytes (a sequence's KV as attnd stores it: no
// step has to compute it, which on the CPU backend would take longer than the bench itself).
std::vector<attnd::v1::ExportSequenceResponse> RandomSequence(const attnd::v1::CacheConfig& config,
                                                              int64_t tokens, uint64_t seed) {
  const int64_t pages = (tokens + config.page_size() - 1) / config.page_size();
  const auto [k_page, v_page] = PageBytes(config);
  const int64_t chunk_bytes = 4 << 20;
  std::vector<attnd::v1::ExportSequenceResponse> messages(1);
  attnd::v1::SequenceHeader& header = *messages[0].mutable_header();
  *header.mutable_config() = config;
  header.set_sequence_id(kSequence);
  header.set_num_tokens(tokens);
  header.set_num_pages(pages);
  std::mt19937_64 rng(seed);
  for (int32_t layer = 0; layer < config.num_layers(); ++layer) {
    for (const bool v_pool : {false, true}) {
      const int64_t page_bytes = v_pool ? v_page : k_page;
      const int64_t per_chunk = std::max<int64_t>(1, chunk_bytes / page_bytes);
      for (int64_t first = 0; first < pages; first += per_chunk) {
        const int64_t count = std::min(per_chunk, pages - first);
        attnd::v1::SequenceChunk& chunk = *messages.emplace_back().mutable_chunk();
        chunk.set_layer(layer);
        chunk.set_pool(v_pool ? attnd::v1::KV_POOL_V : attnd::v1::KV_POOL_K);
        chunk.set_first_page(first);
        chunk.set_num_pages(static_cast<int32_t>(count));
        std::string& data = *chunk.mutable_data();
        data.resize(count * page_bytes);
        for (size_t i = 0; i + 8 <= data.size(); i += 8) {
          const uint64_t word = rng();
          std::memcpy(data.data() + i, &word, 8);
        }
        chunk.set_crc32(static_cast<uint32_t>(
            crc32(crc32(0L, Z_NULL, 0), reinterpret_cast<const Bytef*>(data.data()),
                  static_cast<uInt>(data.size()))));
      }
    }
  }
  header.set_num_chunks(static_cast<int64_t>(messages.size()) - 1);
  return messages;
}

struct Timings {
  std::vector<double> export_seconds, import_seconds, copy_seconds;
};

// "best / median" MB/s of runs that each moved `bytes`.
std::string Rates(int64_t bytes, std::vector<double> seconds) {
  std::sort(seconds.begin(), seconds.end());
  return absl::StrFormat("%.0f / %.0f", bytes / seconds.front() / 1e6,
                         bytes / seconds[seconds.size() / 2] / 1e6);
}

// One transport: `kind` empty for gRPC bytes. Channels are opened per side (a channel carries
// one transfer at a time): one on the source cache for exports, one on the target for imports.
absl::StatusOr<Timings> Measure(client::Client& client,
                                const std::vector<attnd::v1::ExportSequenceResponse>& messages,
                                std::optional<attnd::v1::ChannelKind> kind, int32_t repeat) {
  std::unique_ptr<client::Channel> out_channel, in_channel;
  if (kind.has_value()) {
    ASSIGN_OR_RETURN(out_channel, client::OpenTransferChannel(client, kSource, *kind));
    ASSIGN_OR_RETURN(in_channel, client::OpenTransferChannel(client, kTarget, *kind));
  }
  Timings timings;
  const uint64_t ids[] = {2};
  for (int32_t run = 0; run < repeat; ++run) {
    int64_t received = 0;
    const client::SequenceSink count = [&](const attnd::v1::ExportSequenceResponse& message) {
      received += message.chunk().data().size();
      return absl::OkStatus();
    };
    auto start = Clock::now();
    RETURN_IF_ERROR(out_channel ? client::ExportSequenceThroughChannel(
                                      client, kSource, kSequence, *out_channel, count)
                                : client::ExportSequence(client, kSource, kSequence, count));
    timings.export_seconds.push_back(SecondsSince(start));

    size_t next = 0;
    const client::SequenceSource replay =
        [&](attnd::v1::ExportSequenceResponse& message) -> absl::StatusOr<bool> {
      if (next == messages.size()) return false;
      message = messages[next++];  // a copy: the import helpers consume their messages
      return true;
    };
    start = Clock::now();
    RETURN_IF_ERROR(in_channel ? client::ImportSequenceThroughChannel(client, kTarget, 2,
                                                                      *in_channel, replay)
                                     .status()
                               : client::ImportSequence(client, kTarget, 2, replay).status());
    timings.import_seconds.push_back(SecondsSince(start));
    RETURN_IF_ERROR(client.FreeSequences(kTarget, ids).status());

    start = Clock::now();
    RETURN_IF_ERROR(client::CopySequenceThroughChannels(client, kSource, kSequence,
                                                        out_channel.get(), client, kTarget, 2,
                                                        in_channel.get())
                        .status());
    timings.copy_seconds.push_back(SecondsSince(start));
    RETURN_IF_ERROR(client.FreeSequences(kTarget, ids).status());
  }
  return timings;
}

absl::Status Run(client::Client& client) {
  CacheShapeDefaults defaults;
  defaults.num_layers = 32;
  defaults.num_qo_heads = 32;
  defaults.num_kv_heads = 8;
  defaults.head_dim = 128;
  defaults.page_size = 16;
  const int64_t tokens = absl::GetFlag(FLAGS_tokens) > 0 ? absl::GetFlag(FLAGS_tokens) : 8192;
  ASSIGN_OR_RETURN(attnd::v1::CacheConfig config, CacheConfigFromFlags(defaults));
  if (!CapacityFlagGiven()) {
    config.set_num_pages((tokens + config.page_size() - 1) / config.page_size());
  }
  std::vector<std::optional<attnd::v1::ChannelKind>> kinds = {std::nullopt};
  const std::string channel = absl::GetFlag(FLAGS_channel);
  if (channel.empty()) {
    kinds.push_back(attnd::v1::CHANNEL_KIND_HOST_SHM);
  } else {
    for (const std::string& name : std::vector<std::string>(absl::StrSplit(channel, ','))) {
      if (name == "all") {
        kinds.push_back(attnd::v1::CHANNEL_KIND_HOST_SHM);
        kinds.push_back(attnd::v1::CHANNEL_KIND_CUDA_IPC);
        continue;
      }
      ASSIGN_OR_RETURN(const attnd::v1::ChannelKind kind, TransferChannelKind(name));
      kinds.push_back(kind);
    }
  }
  for (const char* cache : {kSource, kTarget}) {
    client.DeleteCache(cache, /*force=*/true).IgnoreError();  // a previous run's
    RETURN_IF_ERROR(client.CreateCache(cache, config).status());
  }
  ASSIGN_OR_RETURN(const attnd::v1::CacheInfo info, client.GetCache(kSource));
  std::vector<attnd::v1::ExportSequenceResponse> messages =
      RandomSequence(info.config(), tokens, absl::GetFlag(FLAGS_seed));
  int64_t bytes = 0;
  for (const attnd::v1::ExportSequenceResponse& message : messages) {
    bytes += static_cast<int64_t>(message.chunk().data().size());
  }
  {
    size_t next = 0;
    RETURN_IF_ERROR(client::ImportSequence(
                        client, kSource, kSequence,
                        [&](attnd::v1::ExportSequenceResponse& message) -> absl::StatusOr<bool> {
                          if (next == messages.size()) return false;
                          message = messages[next++];
                          return true;
                        })
                        .status());
  }
  const int32_t repeat = std::max(1, absl::GetFlag(FLAGS_seq_bench_repeat));
  absl::PrintF("sequence of %d tokens, %d layers, %d KV bytes (%.1f MiB); %d runs each\n",
               tokens, config.num_layers(), bytes, bytes / 1048576.0, repeat);
  absl::PrintF("MB/s (1e6 bytes/s), best / median; copy = export piped into import\n");
  absl::PrintF("%-10s %16s %16s %16s\n", "transport", "export", "import", "copy");
  absl::Status failed;
  for (const auto& kind : kinds) {
    const std::string name = !kind.has_value()                             ? "grpc"
                             : *kind == attnd::v1::CHANNEL_KIND_HOST_SHM ? "host_shm"
                                                                           : "cuda_ipc";
    absl::StatusOr<Timings> timings = Measure(client, messages, kind, repeat);
    if (!timings.ok()) {
      absl::PrintF("%-10s failed: %s\n", name, timings.status().ToString());
      failed = timings.status();
      continue;
    }
    absl::PrintF("%-10s %16s %16s %16s\n", name, Rates(bytes, timings->export_seconds),
                 Rates(bytes, timings->import_seconds), Rates(bytes, timings->copy_seconds));
  }
  if (!absl::GetFlag(FLAGS_keep_cache)) {
    for (const char* cache : {kSource, kTarget}) client.DeleteCache(cache, true).IgnoreError();
  }
  return failed;
}

}  // namespace

int RunSeqBench(client::Client& client) {
  if (absl::Status status = Run(client); !status.ok()) {
    PrintError("seq bench", status);
    return kExitFailure;
  }
  return kExitOk;
}

}  // namespace attnd::attnctl
