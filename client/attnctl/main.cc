// attnctl: inspect and exercise an attnd daemon.
#include <algorithm>
#include <cctype>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/flags/commandlineflag.h"
#include "absl/flags/parse.h"
#include "absl/flags/reflection.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "commands.h"

namespace {

constexpr char kUsage[] =
    "attnctl COMMAND [ARGS] [--flags]\n"
    "\n"
    "commands:\n"
    "  info                       server version, backend, device, limits\n"
    "  health [--service=NAME]    grpc.health.v1 check; exit 0 only when SERVING\n"
    "  cache create NAME [...]    create a KV cache (shape flags below)\n"
    "  cache list                 list caches\n"
    "  cache get NAME             describe one cache\n"
    "  cache delete NAME [--force]\n"
    "  seq fork CACHE SOURCE NEW [--tokens=N]   share SOURCE's first N tokens (0: all)\n"
    "  seq free CACHE ID...       free managed sequences\n"
    "  seq export CACHE ID (--out=FILE | --to=HOST:PORT [--to_cache=C] [--new_id=N])\n"
    "  seq import CACHE --in=FILE [--new_id=N]   (export/import: --channel=shm|cuda_ipc)\n"
    "  seq bench [--tokens=N] [--channel=shm|cuda_ipc]   export+import: gRPC vs channel\n"
    "  stats                      per-kernel counts and time\n"
    "  demo                       a small mixed prefill/decode run checked against the CPU "
    "reference\n"
    "  bench                      load generator: decode steps over unary calls or --stream\n"
    "\n"
    "global flags: --server=HOST:PORT (localhost:50051) --timeout=30s --json\n"
    "  TLS: --tls (system roots) | --tls_ca=CA.pem, [--tls_cert=C.pem --tls_key=K.pem] (mutual),\n"
    "       [--tls_server_name=NAME]; bearer token: --token_file=FILE | $ATTND_TOKEN | --token\n"
    "Flag names accept dashes or underscores (--qo-heads = --qo_heads).";

// attnctl's flags by the file that defines them, in the order --help lists them.
struct FlagGroup {
  const char* file;
  const char* heading;
};
constexpr FlagGroup kFlagGroups[] = {
    {"global_flags.cc", "global flags (every command)"},
    {"info_commands.cc", "health"},
    {"cache_flags.cc", "cache shape (cache create; demo and bench take them too)"},
    {"cache_commands.cc", "cache delete"},
    {"seq_commands.cc", "seq"},
    {"demo.cc", "demo"},
    {"bench.cc", "bench"},
};

// Appends `text` wrapped at 78 columns, each line indented by `indent` spaces.
void AppendWrapped(std::string& out, absl::string_view text, size_t indent) {
  size_t column = 0;
  for (absl::string_view word : absl::StrSplit(text, ' ', absl::SkipEmpty())) {
    if (column > 0 && column + 1 + word.size() > 78) {
      out += "\n";
      column = 0;
    }
    if (column == 0) {
      out.append(indent, ' ');
      column = indent;
    } else {
      out += ' ';
      ++column;
    }
    absl::StrAppend(&out, word);
    column += word.size();
  }
  out += "\n";
}

// The whole help: commands, then every attnctl flag under its command, with its default.
std::string FullHelp() {
  std::string out = absl::StrCat("usage: ", kUsage, "\n");
  std::vector<absl::CommandLineFlag*> flags;
  for (const auto& [name, flag] : absl::GetAllFlags()) {
    if (absl::StrContains(flag->Filename(), "attnctl/")) flags.push_back(flag);
  }
  std::sort(flags.begin(), flags.end(),
            [](const auto* a, const auto* b) { return a->Name() < b->Name(); });
  auto grouped = [](const absl::CommandLineFlag* flag, const char* file) {
    if (file != nullptr) return absl::EndsWith(flag->Filename(), absl::StrCat("/", file));
    // A flag of a file without a group of its own is listed last, under "other flags".
    return std::none_of(std::begin(kFlagGroups), std::end(kFlagGroups), [&](const FlagGroup& g) {
      return absl::EndsWith(flag->Filename(), absl::StrCat("/", g.file));
    });
  };
  std::vector<FlagGroup> groups(std::begin(kFlagGroups), std::end(kFlagGroups));
  groups.push_back({nullptr, "other flags"});
  for (const FlagGroup& group : groups) {
    std::string listed;
    for (const absl::CommandLineFlag* flag : flags) {
      if (!grouped(flag, group.file)) continue;
      const std::string default_value = flag->DefaultValue();
      absl::StrAppend(&listed, "  --", flag->Name(),
                      default_value.empty() ? "" : absl::StrCat(" (default ", default_value, ")"),
                      "\n");
      AppendWrapped(listed, flag->Help(), 6);
    }
    if (!listed.empty()) absl::StrAppend(&out, "\n", group.heading, ":\n", listed);
  }
  return out;
}

bool IsHelpFlag(const std::string& arg) {
  return arg == "-h" || arg == "--help" || arg == "-help" || arg == "--helpfull" ||
         arg == "-helpfull" || arg == "--helpshort" || arg == "-helpshort";
}

// absl flags spell names with underscores; accept the dashed spelling users type too.
// Only the name part (before '=') changes; arguments after a bare "--" are left alone.
std::vector<std::string> NormaliseFlagNames(int argc, char** argv) {
  std::vector<std::string> normalised(argv, argv + argc);
  for (size_t i = 1; i < normalised.size(); ++i) {
    std::string& arg = normalised[i];
    if (arg == "--") break;
    if (arg.size() < 2 || arg[0] != '-') continue;
    const size_t name_start = arg[1] == '-' ? 2 : 1;
    if (name_start >= arg.size() || !std::isalpha(static_cast<unsigned char>(arg[name_start]))) {
      continue;  // "-1" is a value, not a flag
    }
    const size_t name_end = std::min(arg.find('='), arg.size());
    for (size_t c = name_start; c < name_end; ++c) {
      if (arg[c] == '-') arg[c] = '_';
    }
  }
  return normalised;
}

}  // namespace

int main(int argc, char** argv) {
  absl::FlagsUsageConfig usage_config;
  // --help lists attnctl's own flags, not Abseil's or gRPC's.
  usage_config.contains_help_flags = [](absl::string_view path) {
    return absl::StrContains(path, "attnctl/");
  };
  usage_config.contains_helpshort_flags = usage_config.contains_help_flags;
  absl::SetFlagsUsageConfig(usage_config);
  absl::SetProgramUsageMessage(kUsage);

  std::vector<std::string> normalised = NormaliseFlagNames(argc, argv);
  // Help is an answer, not a usage error: print it to stdout and exit 0 (Abseil's own
  // --help exits 1 and heads groups with source paths).
  for (size_t i = 1; i < normalised.size() && normalised[i] != "--"; ++i) {
    if (IsHelpFlag(normalised[i])) {
      absl::PrintF("%s", FullHelp());
      return attnd::attnctl::kExitOk;
    }
  }
  std::vector<char*> pointers;
  for (std::string& arg : normalised) pointers.push_back(arg.data());
  std::vector<char*> positional =
      absl::ParseCommandLine(static_cast<int>(pointers.size()), pointers.data());

  using attnd::attnctl::Args;
  Args args(positional.begin() + 1, positional.end());
  if (args.empty()) {
    absl::FPrintF(stderr, "usage: %s\nattnctl --help lists every flag.\n", kUsage);
    return attnd::attnctl::kExitUsage;
  }
  const std::string command = args.front();
  args.erase(args.begin());
  if (command == "info") return attnd::attnctl::RunInfo(args);
  if (command == "health") return attnd::attnctl::RunHealth(args);
  if (command == "stats") return attnd::attnctl::RunStats(args);
  if (command == "cache") return attnd::attnctl::RunCache(args);
  if (command == "seq") return attnd::attnctl::RunSeq(args);
  if (command == "demo") return attnd::attnctl::RunDemo(args);
  if (command == "bench") return attnd::attnctl::RunBench(args);
  if (command == "help") {
    absl::PrintF("%s", FullHelp());
    return attnd::attnctl::kExitOk;
  }
  absl::FPrintF(stderr, "attnctl: unknown command '%s'\n\nusage: %s\nattnctl --help lists every flag.\n",
                command, kUsage);
  return attnd::attnctl::kExitUsage;
}
