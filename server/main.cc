// attnd: flags -> ServerOptions -> Server. Nothing else reads flags.
#include <algorithm>
#include <cstdlib>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>


#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/time.h"
#include "server.h"
#include "util/exit_watchdog.h"
#include "util/log.h"

ABSL_FLAG(std::string, listen_address, "0.0.0.0:50051", "gRPC listen address (host:port)");
ABSL_FLAG(std::string, metrics_address, "0.0.0.0:9400",
          "Prometheus /metrics listen address (host:port); empty disables it");
ABSL_FLAG(std::string, backend, "auto", "auto (CUDA when a GPU is present), cuda or cpu");
ABSL_FLAG(std::string, devices, "",
          "Devices to place caches on, comma-separated CUDA ordinals (0,1,...); empty = every "
          "visible GPU. With the CPU backend: devices to pretend to have (default one, 0)");
ABSL_FLAG(int64_t, kv_memory_bytes, 0,
          "KV budget in bytes per device; 0 = kv_memory_fraction of free GPU memory (CUDA) or "
          "1 GiB (CPU)");
ABSL_FLAG(double, kv_memory_fraction, 0.9, "Fraction of free GPU memory reserved for KV pools");
ABSL_FLAG(std::string, pod, "",
          "CUDA backend: mixed prefill/decode steps as one POD launch: auto (a measured rule), on "
          "or off; empty: the environment variable ATTND_POD, else auto");
ABSL_FLAG(std::string, decode_kernel, "",
          "CUDA backend: the decode kernel: auto (the planner's per-step choice), cuda_core or "
          "tensor_core (forced, for measurements; a cache without it stays on auto); empty: the "
          "environment variable ATTND_DECODE_KERNEL, else auto");
ABSL_FLAG(std::string, cuda_completion, "",
          "CUDA backend: how completion threads wait for a layer: blocking or spin; empty: the "
          "environment variable ATTND_CUDA_COMPLETION, else blocking");
ABSL_FLAG(int32_t, channel_kernel_timing, 16,
          "CUDA backend: time the kernels of one CUDA_IPC channel layer in this many for the "
          "kernel metrics and GetStats (1: every layer, 0: none; each timed layer costs ~6 us "
          "of GPU time under MPS). The Forward path times every layer");
ABSL_FLAG(bool, channel_done_by_kernel, false,
          "CUDA backend: a CUDA_IPC channel's decode layer has its last kernel set the layer's "
          "done word from its last CTA, instead of a stream memory operation after the kernels "
          "(prefill, mixed and MLA layers always use the latter). Off by default: not yet "
          "measured");
ABSL_FLAG(int32_t, host_shm_parts, 2,
          "CUDA backend: a HOST_SHM channel's decode layer runs in this many parts of its rows "
          "(1..16), so that part p + 1's inputs cross PCIe while part p computes and part p's "
          "outputs cross back while part p + 1 computes; 1 copies and computes the layer whole");
ABSL_FLAG(absl::Duration, nccl_init_timeout, absl::Seconds(60),
          "CUDA backend: how long an NCCL channel waits for its client to join the communicator "
          "(rank 1, ChannelInfo.nccl_unique_id) before it closes");
ABSL_FLAG(int64_t, max_message_bytes, 512ll << 20, "Largest gRPC message received or sent");
ABSL_FLAG(int32_t, max_plan_entries, 4096, "Most entries in one Plan");
ABSL_FLAG(int64_t, max_step_tokens, 65536, "Most new tokens in one step");
ABSL_FLAG(int32_t, max_open_steps, 1024, "Most steps open at once, across caches");
ABSL_FLAG(int32_t, max_open_steps_per_tenant, 256,
          "Most steps one tenant may have open at once (with --token_file)");
ABSL_FLAG(int32_t, max_stream_in_flight, 64,
          "Messages one ForwardStream may have in flight before the server stops reading it");
ABSL_FLAG(int32_t, max_streams_per_connection, 256,
          "Concurrent calls (HTTP/2 streams) per client connection; further calls wait");
ABSL_FLAG(int64_t, max_channel_bytes, int64_t{4} << 30,
          "Bytes all open channels' rings may take together (device memory for CUDA_IPC, "
          "/dev/shm for HOST_SHM)");
ABSL_FLAG(int32_t, max_channels, 64, "Most channels open at once, across tenants");
ABSL_FLAG(absl::Duration, step_ttl, absl::Seconds(60),
          "Open steps idle this long are aborted and rolled back");
ABSL_FLAG(std::string, tls_cert, "", "PEM certificate chain of the gRPC port; with --tls_key "
          "enables TLS (default: plaintext)");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls_cert");
ABSL_FLAG(std::string, tls_client_ca, "",
          "PEM CA bundle: mutual TLS, every client must present a certificate it signed");
ABSL_FLAG(std::string, token_file, "",
          "Bearer tokens, one 'TENANT TOKEN [PAGE_QUOTA]' per line (# comments); every "
          "AttentionService call then needs 'authorization: Bearer <token>' and sees only its "
          "tenant's caches. Reloaded on SIGHUP. Empty: no authentication");
ABSL_FLAG(int64_t, tenant_page_quota, 0,
          "Pages (sum of num_pages over its caches) a tenant may hold when its token-file line "
          "names no quota; 0 = unlimited");
ABSL_FLAG(std::string, metrics_cache_labels, "auto",
          "true: attnd_kv_* gauges per cache name; false: one cache=\"\" series summed over "
          "all caches; auto: true without --token_file, false with it");
ABSL_FLAG(absl::Duration, keepalive_time, absl::Seconds(60),
          "The server pings a connection idle this long");
ABSL_FLAG(absl::Duration, keepalive_timeout, absl::Seconds(20),
          "and closes it when the ping is not answered within this");
ABSL_FLAG(absl::Duration, keepalive_min_ping_interval, absl::Seconds(10),
          "Clients may ping this often without data (closer pings get GOAWAY too_many_pings); "
          "the client library pings every 30s");
ABSL_FLAG(bool, keepalive_permit_without_calls, true,
          "Clients may ping while no call is in flight");
ABSL_FLAG(absl::Duration, drain_grace, absl::Seconds(30),
          "On SIGTERM, how long open steps get to finish before they are aborted");
ABSL_FLAG(absl::Duration, exit_grace, absl::Seconds(5),
          "After draining, how long in-flight RPCs get before they are cancelled");

namespace {

// Beyond drain_grace + exit_grace, what the shutdown may take (the engine's last layers, the
// backend's release) before the watchdog ends the process.
constexpr absl::Duration kShutdownMargin = absl::Seconds(10);

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
  for (const absl::string_view ordinal :
       absl::StrSplit(absl::GetFlag(FLAGS_devices), ',', absl::SkipEmpty())) {
    int32_t parsed = 0;
    if (!absl::SimpleAtoi(ordinal, &parsed) || parsed < 0) {
      std::fprintf(stderr, "attnd: --devices: expected device ordinals >= 0 separated by commas, "
                   "got '%s'\n", absl::GetFlag(FLAGS_devices).c_str());
      return 2;
    }
    if (std::find(options.devices.begin(), options.devices.end(), parsed) != options.devices.end()) {
      std::fprintf(stderr, "attnd: --devices: device %d is listed twice\n", parsed);
      return 2;
    }
    options.devices.push_back(parsed);
  }
  options.kv_memory_bytes = absl::GetFlag(FLAGS_kv_memory_bytes);
  options.kv_memory_fraction = absl::GetFlag(FLAGS_kv_memory_fraction);
  // The environment variables are the flags' fallbacks (older scripts set them); nothing past
  // this point reads them.
  const std::string pod = absl::GetFlag(FLAGS_pod);
  const absl::StatusOr<attnd::plan::PodMode> pod_mode =
      pod.empty() ? attnd::plan::PodModeFromEnvironment() : attnd::plan::ParsePodMode(pod);
  if (!pod_mode.ok()) {
    std::fprintf(stderr, "attnd: --pod: %s\n", std::string(pod_mode.status().message()).c_str());
    return 2;
  }
  options.pod_mode = *pod_mode;
  const std::string decode_kernel = absl::GetFlag(FLAGS_decode_kernel);
  const absl::StatusOr<attnd::plan::DecodeKernelChoice> decode_kernel_choice =
      decode_kernel.empty() ? attnd::plan::DecodeKernelChoiceFromEnvironment()
                            : attnd::plan::ParseDecodeKernelChoice(decode_kernel);
  if (!decode_kernel_choice.ok()) {
    std::fprintf(stderr, "attnd: --decode_kernel: %s\n",
                 std::string(decode_kernel_choice.status().message()).c_str());
    return 2;
  }
  options.decode_kernel = *decode_kernel_choice;
  options.cuda_completion_wait = absl::GetFlag(FLAGS_cuda_completion);
  if (options.cuda_completion_wait.empty()) {
    const char* from_environment = std::getenv("ATTND_CUDA_COMPLETION");
    if (from_environment != nullptr) options.cuda_completion_wait = from_environment;
  }
  if (!options.cuda_completion_wait.empty() && options.cuda_completion_wait != "blocking" &&
      options.cuda_completion_wait != "spin") {
    std::fprintf(stderr, "attnd: --cuda_completion: expected blocking or spin, got '%s'\n",
                 options.cuda_completion_wait.c_str());
    return 2;
  }
  options.channel_kernel_timing = absl::GetFlag(FLAGS_channel_kernel_timing);
  if (options.channel_kernel_timing < 0) {
    std::fprintf(stderr, "attnd: --channel_kernel_timing: expected >= 0, got %d\n",
                 options.channel_kernel_timing);
    return 2;
  }
  options.channel_done_by_kernel = absl::GetFlag(FLAGS_channel_done_by_kernel);
  options.host_shm_parts = absl::GetFlag(FLAGS_host_shm_parts);
  if (options.host_shm_parts < 1 || options.host_shm_parts > 16) {
    std::fprintf(stderr, "attnd: --host_shm_parts: expected 1..16, got %d\n",
                 options.host_shm_parts);
    return 2;
  }
  options.nccl_init_timeout = absl::GetFlag(FLAGS_nccl_init_timeout);
  if (options.nccl_init_timeout <= absl::ZeroDuration()) {
    std::fprintf(stderr, "attnd: --nccl_init_timeout: expected > 0, got %s\n",
                 absl::FormatDuration(options.nccl_init_timeout).c_str());
    return 2;
  }
  options.limits.max_message_bytes = absl::GetFlag(FLAGS_max_message_bytes);
  options.limits.max_plan_entries = absl::GetFlag(FLAGS_max_plan_entries);
  options.limits.max_step_tokens = absl::GetFlag(FLAGS_max_step_tokens);
  options.limits.max_open_steps = absl::GetFlag(FLAGS_max_open_steps);
  options.limits.max_open_steps_per_tenant = absl::GetFlag(FLAGS_max_open_steps_per_tenant);
  options.limits.max_stream_in_flight = absl::GetFlag(FLAGS_max_stream_in_flight);
  options.limits.max_streams_per_connection = absl::GetFlag(FLAGS_max_streams_per_connection);
  options.limits.max_channel_bytes = absl::GetFlag(FLAGS_max_channel_bytes);
  options.limits.max_channels = absl::GetFlag(FLAGS_max_channels);
  options.step_ttl = absl::GetFlag(FLAGS_step_ttl);
  options.tls.cert_file = absl::GetFlag(FLAGS_tls_cert);
  options.tls.key_file = absl::GetFlag(FLAGS_tls_key);
  options.tls.client_ca_file = absl::GetFlag(FLAGS_tls_client_ca);
  options.token_file = absl::GetFlag(FLAGS_token_file);
  options.tenant_page_quota = absl::GetFlag(FLAGS_tenant_page_quota);
  const std::string cache_labels = absl::GetFlag(FLAGS_metrics_cache_labels);
  if (cache_labels == "true") {
    options.metrics_cache_labels = true;
  } else if (cache_labels == "false") {
    options.metrics_cache_labels = false;
  } else if (cache_labels != "auto") {
    std::fprintf(stderr, "attnd: --metrics_cache_labels: expected auto, true or false, got '%s'\n",
                 cache_labels.c_str());
    return 2;
  }
  options.keepalive.time = absl::GetFlag(FLAGS_keepalive_time);
  options.keepalive.timeout = absl::GetFlag(FLAGS_keepalive_timeout);
  options.keepalive.min_ping_interval = absl::GetFlag(FLAGS_keepalive_min_ping_interval);
  options.keepalive.permit_without_calls = absl::GetFlag(FLAGS_keepalive_permit_without_calls);
  options.drain_grace = absl::GetFlag(FLAGS_drain_grace);
  options.exit_grace = absl::GetFlag(FLAGS_exit_grace);

  attnd::LogInfo(absl::StrCat(
      "limits: max_message_bytes=", options.limits.max_message_bytes,
      " max_plan_entries=", options.limits.max_plan_entries,
      " max_step_tokens=", options.limits.max_step_tokens,
      " max_open_steps=", options.limits.max_open_steps,
      " max_open_steps_per_tenant=", options.limits.max_open_steps_per_tenant,
      " max_stream_in_flight=", options.limits.max_stream_in_flight,
      " max_streams_per_connection=", options.limits.max_streams_per_connection,
      " max_channel_bytes=", options.limits.max_channel_bytes,
      " max_channels=", options.limits.max_channels,
      " tenant_page_quota=", options.tenant_page_quota,
      " step_ttl=", absl::FormatDuration(options.step_ttl),
      " drain_grace=", absl::FormatDuration(options.drain_grace),
      " exit_grace=", absl::FormatDuration(options.exit_grace),
      " keepalive_time=", absl::FormatDuration(options.keepalive.time),
      " keepalive_timeout=", absl::FormatDuration(options.keepalive.timeout),
      " keepalive_min_ping_interval=", absl::FormatDuration(options.keepalive.min_ping_interval),
      " keepalive_permit_without_calls=",
      options.keepalive.permit_without_calls ? "true" : "false"));

  // Signals are taken synchronously by this thread; every other thread inherits the mask. The
  // watchdog takes SIGTERM and SIGINT while this thread cannot (starting, shutting down), and
  // bounds the shutdown: a second signal, or a drain that overstays drain_grace + exit_grace +
  // a margin, ends the process at once (util/exit_watchdog.h).
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGHUP);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  attnd::ExitWatchdog watchdog;

  auto server = attnd::Server::Start(options);
  if (!server.ok()) {
    attnd::LogError(absl::StrCat("cannot start: ", server.status().ToString()));
    return 1;
  }
  watchdog.Serving();
  int signal_number = 0;
  for (;;) {
    sigwait(&signals, &signal_number);
    if (signal_number != SIGHUP) break;
    if (const absl::Status reloaded = (*server)->ReloadTokens(); !reloaded.ok()) {
      attnd::LogError(absl::StrCat("SIGHUP: ", reloaded.message()));
    }
  }
  watchdog.ShuttingDown(options.drain_grace + options.exit_grace + kShutdownMargin);
  attnd::LogInfo(absl::StrCat("received ", strsignal(signal_number),
                              ": draining (send it again to exit at once)"));
  watchdog.Phase("Server::Shutdown (see the log lines above)");
  (*server)->Shutdown();
  watchdog.Phase("releasing the server (backend, device memory)");
  server->reset();
  watchdog.Done();
  return 0;
}
