// attnd: flags -> ServerOptions -> Server. Nothing else reads flags.
#include <csignal>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "server.h"
#include "util/log.h"

ABSL_FLAG(std::string, listen_address, "0.0.0.0:50051", "gRPC listen address (host:port)");
ABSL_FLAG(std::string, metrics_address, "0.0.0.0:9400",
          "Prometheus /metrics listen address (host:port); empty disables it");
ABSL_FLAG(std::string, backend, "auto", "auto (CUDA when a GPU is present), cuda or cpu");
ABSL_FLAG(int64_t, kv_memory_bytes, 0,
          "KV budget in bytes; 0 = kv_memory_fraction of free GPU memory (CUDA) or 1 GiB (CPU)");
ABSL_FLAG(double, kv_memory_fraction, 0.9, "Fraction of free GPU memory reserved for KV pools");
ABSL_FLAG(int64_t, max_message_bytes, 512ll << 20, "Largest gRPC message received or sent");
ABSL_FLAG(int32_t, max_plan_entries, 4096, "Most entries in one Plan");
ABSL_FLAG(int64_t, max_step_tokens, 65536, "Most new tokens in one step");
ABSL_FLAG(int32_t, max_open_steps, 1024, "Most steps open at once, across caches");
ABSL_FLAG(absl::Duration, step_ttl, absl::Seconds(60),
          "Open steps idle this long are aborted and rolled back");
ABSL_FLAG(absl::Duration, drain_grace, absl::Seconds(30),
          "On SIGTERM, how long open steps get to finish before they are aborted");
ABSL_FLAG(absl::Duration, exit_grace, absl::Seconds(5),
          "After draining, how long in-flight RPCs get before they are cancelled");

namespace {

// Accepts --kv-memory-bytes as well as --kv_memory_bytes: dashes in a flag's name (before '=')
// become underscores.
std::vector<char*> NormaliseFlagNames(int argc, char** argv, std::vector<std::string>& storage) {
  storage.assign(argv, argv + argc);
  for (size_t i = 1; i < storage.size(); ++i) {
    std::string& arg = storage[i];
    if (arg == "--") break;
    if (arg.rfind("--", 0) != 0) continue;
    const size_t end = std::min(arg.find('='), arg.size());
    for (size_t c = 2; c < end; ++c) {
      if (arg[c] == '-') arg[c] = '_';
    }
  }
  std::vector<char*> pointers;
  for (std::string& arg : storage) pointers.push_back(arg.data());
  return pointers;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "attnd: a gRPC attention-offload daemon holding paged KV caches.\n"
      "Usage: attnd [--listen_address=0.0.0.0:50051] [--backend=auto|cuda|cpu] ...");
  std::vector<std::string> storage;
  std::vector<char*> args = NormaliseFlagNames(argc, argv, storage);
  absl::ParseCommandLine(static_cast<int>(args.size()), args.data());

  attnd::ServerOptions options;
  options.listen_address = absl::GetFlag(FLAGS_listen_address);
  options.metrics_address = absl::GetFlag(FLAGS_metrics_address);
  const std::string backend = absl::GetFlag(FLAGS_backend);
  if (backend == "auto") {
    options.backend = attnd::BackendKind::kAuto;
  } else if (backend == "cuda") {
    options.backend = attnd::BackendKind::kCuda;
  } else if (backend == "cpu") {
    options.backend = attnd::BackendKind::kCpu;
  } else {
    std::fprintf(stderr, "attnd: --backend: expected auto, cuda or cpu, got '%s'\n", backend.c_str());
    return 2;
  }
  options.kv_memory_bytes = absl::GetFlag(FLAGS_kv_memory_bytes);
  options.kv_memory_fraction = absl::GetFlag(FLAGS_kv_memory_fraction);
  options.limits.max_message_bytes = absl::GetFlag(FLAGS_max_message_bytes);
  options.limits.max_plan_entries = absl::GetFlag(FLAGS_max_plan_entries);
  options.limits.max_step_tokens = absl::GetFlag(FLAGS_max_step_tokens);
  options.limits.max_open_steps = absl::GetFlag(FLAGS_max_open_steps);
  options.step_ttl = absl::GetFlag(FLAGS_step_ttl);
  options.drain_grace = absl::GetFlag(FLAGS_drain_grace);
  options.exit_grace = absl::GetFlag(FLAGS_exit_grace);

  attnd::LogInfo(absl::StrCat(
      "limits: max_message_bytes=", options.limits.max_message_bytes,
      " max_plan_entries=", options.limits.max_plan_entries,
      " max_step_tokens=", options.limits.max_step_tokens,
      " max_open_steps=", options.limits.max_open_steps,
      " step_ttl=", absl::FormatDuration(options.step_ttl),
      " drain_grace=", absl::FormatDuration(options.drain_grace),
      " exit_grace=", absl::FormatDuration(options.exit_grace)));

  // Signals are taken synchronously by this thread; every other thread inherits the mask.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  auto server = attnd::Server::Start(options);
  if (!server.ok()) {
    attnd::LogError(absl::StrCat("cannot start: ", server.status().ToString()));
    return 1;
  }
  int signal_number = 0;
  sigwait(&signals, &signal_number);
  attnd::LogInfo(absl::StrCat("received ", strsignal(signal_number), ": draining"));
  (*server)->Shutdown();
  return 0;
}
