// attnctl seq fork | free | export | import | bench: managed sequences' lifecycle.
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "attnd/client/sequence.h"
#include "attnd/status_macros.h"
#include "commands.h"
#include "global_flags.h"
#include "printing.h"
#include "seq_bench.h"

ABSL_FLAG(int64_t, tokens, 0,
          "seq fork: how many of the source's first tokens to share (0: all); seq bench: the "
          "sequence's tokens (0: 8192)");
ABSL_FLAG(std::string, out, "", "seq export: write the sequence to this file");
ABSL_FLAG(std::string, to, "",
          "seq export: import it straight into the daemon at this address (may be --server)");
ABSL_FLAG(std::string, to_cache, "", "seq export --to: the target cache (default: the same name)");
ABSL_FLAG(std::string, in, "", "seq import: read the sequence from this file (seq export --out)");
ABSL_FLAG(uint64_t, new_id, 0,
          "seq export --to, seq import: the imported sequence's id (0: the exported id)");
ABSL_FLAG(std::string, channel, "",
          "seq export/import/bench: move the KV bytes through a channel of this kind, shm or "
          "cuda_ipc, instead of gRPC messages (the daemon at --server, HOST_SHM needs its host)");
ABSL_FLAG(std::string, to_channel, "",
          "seq export --to: the target daemon's side through a channel too (shm or cuda_ipc)");

namespace attnd::attnctl {
namespace {

constexpr char kUsage[] =
    "usage: attnctl seq fork CACHE SOURCE_ID NEW_ID [--tokens=N]\n"
    "       attnctl seq free CACHE ID...\n"
    "       attnctl seq export CACHE ID --out=FILE\n"
    "       attnctl seq export CACHE ID --to=HOST:PORT [--to_cache=NAME] [--new_id=N]\n"
    "       attnctl seq import CACHE --in=FILE [--new_id=N]\n"
    "       (export and import take --channel=shm|cuda_ipc, export --to also --to_channel)\n"
    "       attnctl seq bench [--tokens=8192] [--layers=32 ...] [--channel=shm|cuda_ipc]\n";

int Usage() {
  absl::FPrintF(stderr, "%s", kUsage);
  return kExitUsage;
}

bool ParseId(const std::string& text, uint64_t& id) { return absl::SimpleAtoi(text, &id); }

double SecondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

void PrintImported(const attnd::v1::ImportSequenceResponse& imported, double seconds) {
  if (absl::GetFlag(FLAGS_json)) {
    PrintJson(imported);
    return;
  }
  absl::PrintF("sequence %d: %d tokens, %d pages, %d bytes in %.3f s (%.1f MB/s)\n",
               imported.sequence_id(), imported.num_tokens(), imported.num_pages(),
               imported.bytes(), seconds, imported.bytes() / seconds / 1e6);
}

// --channel / --to_channel: a transfer channel on `cache` of `client`'s daemon, or none.
absl::StatusOr<std::unique_ptr<client::Channel>> ChannelFromFlag(client::Client& client,
                                                                  const std::string& cache,
                                                                  const std::string& flag) {
  if (flag.empty()) return std::unique_ptr<client::Channel>();
  ASSIGN_OR_RETURN(const attnd::v1::ChannelKind kind, TransferChannelKind(flag));
  return client::OpenTransferChannel(client, cache, kind);
}

}  // namespace

absl::StatusOr<attnd::v1::ChannelKind> TransferChannelKind(const std::string& name) {
  if (name == "shm" || name == "host_shm") return attnd::v1::CHANNEL_KIND_HOST_SHM;
  if (name == "cuda_ipc") return attnd::v1::CHANNEL_KIND_CUDA_IPC;
  return absl::InvalidArgumentError(
      absl::StrCat("--channel: expected shm or cuda_ipc, got '", name, "'"));
}

int RunSeq(const Args& args) {
  if (args.empty()) return Usage();
  const std::string& verb = args[0];
  auto client = ConnectFromFlags();
  if (!client.ok()) {
    PrintError("connect", client.status());
    return kExitFailure;
  }
  if (verb == "fork") {
    uint64_t source = 0;
    uint64_t new_id = 0;
    if (args.size() != 4 || !ParseId(args[2], source) || !ParseId(args[3], new_id)) return Usage();
    auto forked = client::ForkSequence(**client, args[1], source, new_id,
                                       absl::GetFlag(FLAGS_tokens));
    if (!forked.ok()) {
      PrintError("seq fork", forked.status());
      return kExitFailure;
    }
    if (absl::GetFlag(FLAGS_json)) {
      PrintJson(*forked);
    } else {
      absl::PrintF("sequence %d: %d tokens, %d pages shared with %d\n", new_id,
                   forked->num_tokens(), forked->shared_pages(), source);
    }
    return kExitOk;
  }
  if (verb == "free") {
    if (args.size() < 3) return Usage();
    std::vector<uint64_t> ids;
    for (size_t i = 2; i < args.size(); ++i) {
      if (!ParseId(args[i], ids.emplace_back())) return Usage();
    }
    auto freed = (*client)->FreeSequences(args[1], ids);
    if (!freed.ok()) {
      PrintError("seq free", freed.status());
      return kExitFailure;
    }
    absl::PrintF("%d pages returned to the pool\n", *freed);
    return kExitOk;
  }
  if (verb == "bench") {
    if (args.size() != 1) return Usage();
    return RunSeqBench(**client);
  }
  if (verb == "export") {
    uint64_t id = 0;
    if (args.size() != 3 || !ParseId(args[2], id)) return Usage();
    const std::string out = absl::GetFlag(FLAGS_out);
    const std::string to = absl::GetFlag(FLAGS_to);
    if (out.empty() == to.empty()) return Usage();  // exactly one of them
    auto channel = ChannelFromFlag(**client, args[1], absl::GetFlag(FLAGS_channel));
    if (!channel.ok()) {
      PrintError("seq export --channel", channel.status());
      return kExitFailure;
    }
    const auto start = std::chrono::steady_clock::now();
    if (!out.empty()) {
      absl::Status status =
          client::ExportSequenceToFile(**client, args[1], id, out, channel->get());
      if (!status.ok()) {
        PrintError("seq export", status);
        return kExitFailure;
      }
      absl::PrintF("sequence %d of '%s' written to %s in %.3f s\n", id, args[1], out,
                   SecondsSince(start));
      return kExitOk;
    }
    auto target = ConnectFromFlags(to);
    if (!target.ok()) {
      PrintError("connect --to", target.status());
      return kExitFailure;
    }
    const std::string to_cache =
        absl::GetFlag(FLAGS_to_cache).empty() ? args[1] : absl::GetFlag(FLAGS_to_cache);
    auto to_channel = ChannelFromFlag(**target, to_cache, absl::GetFlag(FLAGS_to_channel));
    if (!to_channel.ok()) {
      PrintError("seq export --to_channel", to_channel.status());
      return kExitFailure;
    }
    auto imported = client::CopySequenceThroughChannels(**client, args[1], id, channel->get(),
                                                        **target, to_cache,
                                                        absl::GetFlag(FLAGS_new_id),
                                                        to_channel->get());
    if (!imported.ok()) {
      PrintError("seq export --to", imported.status());
      return kExitFailure;
    }
    PrintImported(*imported, SecondsSince(start));
    return kExitOk;
  }
  if (verb == "import") {
    const std::string in = absl::GetFlag(FLAGS_in);
    if (args.size() != 2 || in.empty()) return Usage();
    auto channel = ChannelFromFlag(**client, args[1], absl::GetFlag(FLAGS_channel));
    if (!channel.ok()) {
      PrintError("seq import --channel", channel.status());
      return kExitFailure;
    }
    const auto start = std::chrono::steady_clock::now();
    auto imported = client::ImportSequenceFromFile(**client, args[1],
                                                   absl::GetFlag(FLAGS_new_id), in,
                                                   channel->get());
    if (!imported.ok()) {
      PrintError("seq import", imported.status());
      return kExitFailure;
    }
    PrintImported(*imported, SecondsSince(start));
    return kExitOk;
  }
  return Usage();
}

}  // namespace attnd::attnctl
