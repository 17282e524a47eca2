// The daemon's options structs, mirroring attnd's flags (main.cc maps one onto the other and
// nothing else reads flags). Plain data: the engine and the service read their parts without
// depending on the Server that assembles them.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "plan/decode_choice.h"
#include "plan/pod_choice.h"

namespace attnd {

enum class BackendKind { kAuto, kCuda, kCpu };

struct ServerLimitsOptions {
  int64_t max_message_bytes = 512ll << 20;  // receive and send, each direction
  int32_t max_plan_entries = 4096;
  int64_t max_step_tokens = 65536;
  int32_t max_open_steps = 1024;  // across all caches
  // Per tenant (only with a token file): one tenant cannot take every step slot.
  int32_t max_open_steps_per_tenant = 256;
  // Messages one ForwardStream has in flight before the server stops reading from it.
  int32_t max_stream_in_flight = 64;
  // Concurrent HTTP/2 streams (calls) per client connection; a client's further calls wait.
  int32_t max_streams_per_connection = 256;
  // Bytes all open channels' rings may take together (device memory for CUDA_IPC, shared
  // memory for HOST_SHM).
  int64_t max_channel_bytes = int64_t{4} << 30;
  // Open channels across all tenants.
  int32_t max_channels = 64;
};

// TLS of the gRPC port. Empty cert_file and key_file: plaintext.
struct TlsServerOptions {
  std::string cert_file;       // PEM certificate chain
  std::string key_file;        // PEM private key
  std::string client_ca_file;  // PEM CA bundle: mutual TLS, every client presents a cert it signed
};

// HTTP/2 keepalive. The client library's defaults (client_options.h: pings every 30 s,
// permitted without calls) stay within min_ping_interval, so the server never answers them
// with GOAWAY too_many_pings.
struct KeepaliveServerOptions {
  absl::Duration time = absl::Seconds(60);     // the server pings an idle client this often
  absl::Duration timeout = absl::Seconds(20);  // and drops it when a ping is unanswered this long
  // Client pings closer together than this (without data in between) count as abuse.
  absl::Duration min_ping_interval = absl::Seconds(10);
  bool permit_without_calls = true;  // clients may ping with no call in flight
};

struct ServerOptions {
  // gRPC listen address; port 0 picks a free port (see Server::port()).
  std::string listen_address = "0.0.0.0:50051";
  // Prometheus exposer address ("" disables it); port 0 picks a free port.
  std::string metrics_address = "0.0.0.0:9400";
  BackendKind backend = BackendKind::kAuto;
  // Devices to place caches on (--devices): CUDA ordinals; empty = every visible GPU. The CPU
  // backend pretends to have these devices (default one, 0), each with its own KV budget.
  std::vector<int32_t> devices;
  // KV budget per device: bytes, or when 0 a fraction of free device memory (CUDA) / 1 GiB
  // (CPU).
  int64_t kv_memory_bytes = 0;
  double kv_memory_fraction = 0.9;
  // CUDA backend: when a mixed step runs as one POD launch (plan/pod_choice.h), which decode
  // kernel the decode planner may use (plan/decode_choice.h), and how the completion threads
  // wait for a layer ("blocking" or "spin"; "" = blocking).
  plan::PodMode pod_mode = plan::PodMode::kAuto;
  plan::DecodeKernelChoice decode_kernel = plan::DecodeKernelChoice::kAuto;
  std::string cuda_completion_wait;
  // CUDA_IPC channels: the kernels of one layer in this many are timed for the kernel metrics
  // and GetStats (1: every layer, 0: none): a timing event costs ~2 us of a layer under MPS.
  int32_t channel_kernel_timing = 16;
  // CUDA_IPC channels: a decode layer's last kernel sets its done word itself (true), or a
  // stream memory operation after the kernels does (false).
  bool channel_done_by_kernel = false;
  // HOST_SHM channels: a decode layer runs in this many parts of its rows, part p + 1's inputs
  // crossing the bus while part p computes (1: the whole layer at once).
  int32_t host_shm_parts = 2;
  // NCCL channels: how long attnd waits for the client to join the communicator before it
  // closes the channel.
  absl::Duration nccl_init_timeout = absl::Seconds(60);
  ServerLimitsOptions limits;
  TlsServerOptions tls;
  KeepaliveServerOptions keepalive;
  // Bearer tokens, one tenant each (util/token_file.h); "" leaves the service open.
  std::string token_file;
  // Page quota of tenants whose token-file line names none; 0 = unlimited.
  int64_t tenant_page_quota = 0;
  // Per-cache labels on the attnd_kv_* gauges. Unset: on without a token file, off with one
  // (the gauges then carry cache="" summed over all caches).
  std::optional<bool> metrics_cache_labels;
  // Open steps with no call for this long are aborted and rolled back.
  absl::Duration step_ttl = absl::Seconds(60);
  // On drain (SIGTERM): readiness goes NOT_SERVING, new steps are refused, and open steps get
  // this long to finish before the server stops.
  absl::Duration drain_grace = absl::Seconds(30);
  // Time in-flight RPCs get to complete once shutdown starts.
  absl::Duration exit_grace = absl::Seconds(5);
};

}  // namespace attnd
