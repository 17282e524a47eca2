// attnctl seq fork | free | export | import: managed sequences' lifecycle.
#include <chrono>
#include <cstdint>
#include <string>

#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "attnd/client/sequence.h"
#include "commands.h"
#include "global_flags.h"
#include "printing.h"

ABSL_FLAG(int64_t, tokens, 0, "seq fork: how many of the source's first tokens to share (0: all)");
ABSL_FLAG(std::string, out, "", "seq export: write the sequence to this file");
ABSL_FLAG(std::string, to, "",
          "seq export: import it straight into the daemon at this address (may be --server)");
ABSL_FLAG(std::string, to_cache, "", "seq export --to: the target cache (default: the same name)");
ABSL_FLAG(std::string, in, "", "seq import: read the sequence from this file (seq export --out)");
ABSL_FLAG(uint64_t, new_id, 0,
          "seq export --to, seq import: the imported sequence's id (0: the exported id)");

namespace attnd::attnctl {
namespace {

constexpr char kUsage[] =
    "usage: attnctl seq fork CACHE SOURCE_ID NEW_ID [--tokens=N]\n"
    "       attnctl seq free CACHE ID...\n"
    "       attnctl seq export CACHE ID --out=FILE\n"
    "       attnctl seq export CACHE ID --to=HOST:PORT [--to_cache=NAME] [--new_id=N]\n"
    "       attnctl seq import CACHE --in=FILE [--new_id=N]\n";

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

}  // namespace

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
  if (verb == "export") {
    uint64_t id = 0;
    if (args.size() != 3 || !ParseId(args[2], id)) return Usage();
    const std::string out = absl::GetFlag(FLAGS_out);
    const std::string to = absl::GetFlag(FLAGS_to);
    if (out.empty() == to.empty()) return Usage();  // exactly one of them
    const auto start = std::chrono::steady_clock::now();
    if (!out.empty()) {
      absl::Status status = client::ExportSequenceToFile(**client, args[1], id, out);
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
    const std::string to_cache = absl::GetFlag(FLAGS_to_cache);
    auto imported = client::CopySequence(**client, args[1], id, **target,
                                         to_cache.empty() ? args[1] : to_cache,
                                         absl::GetFlag(FLAGS_new_id));
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
    const auto start = std::chrono::steady_clock::now();
    auto imported =
        client::ImportSequenceFromFile(**client, args[1], absl::GetFlag(FLAGS_new_id), in);
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
