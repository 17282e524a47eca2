// The attnd daemon as a library: main.cc maps flags onto ServerOptions and calls Server::Start;
// integration tests start it in-process on a loopback port.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace attnd {

enum class BackendKind { kAuto, kCuda, kCpu };

struct ServerLimitsOptions {
  int64_t max_message_bytes = 512ll << 20;  // receive and send, each direction
  int32_t max_plan_entries = 4096;
  int64_t max_step_tokens = 65536;
  int32_t max_open_steps = 1024;  // across all caches
};

struct ServerOptions {
  // gRPC listen address; port 0 picks a free port (see Server::port()).
  std::string listen_address = "0.0.0.0:50051";
  // Prometheus exposer address ("" disables it); port 0 picks a free port.
  std::string metrics_address = "0.0.0.0:9400";
  BackendKind backend = BackendKind::kAuto;
  // KV budget: bytes, or when 0 a fraction of free device memory (CUDA) / 1 GiB (CPU).
  int64_t kv_memory_bytes = 0;
  double kv_memory_fraction = 0.9;
  ServerLimitsOptions limits;
  // Open steps with no call for this long are aborted and rolled back.
  absl::Duration step_ttl = absl::Seconds(60);
  // On drain (SIGTERM): readiness goes NOT_SERVING, new steps are refused, and open steps get
  // this long to finish before the server stops.
  absl::Duration drain_grace = absl::Seconds(30);
  // Time in-flight RPCs get to complete once shutdown starts.
  absl::Duration exit_grace = absl::Seconds(5);
};

class Server {
 public:
  // Builds the backend, binds the ports and starts serving.
  static absl::StatusOr<std::unique_ptr<Server>> Start(const ServerOptions& options);
  virtual ~Server() = default;

  virtual int port() const = 0;          // bound gRPC port
  virtual int metrics_port() const = 0;  // bound metrics port, 0 when disabled
  virtual std::string backend_name() const = 0;

  // Readiness NOT_SERVING, refuse new steps, wait up to drain_grace for open steps, then stop
  // accepting RPCs and wait up to exit_grace for in-flight ones. Idempotent; thread-safe.
  virtual void Shutdown() = 0;
  // Blocks until Shutdown has completed.
  virtual void Wait() = 0;
};

}  // namespace attnd
