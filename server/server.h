// The attnd daemon as a library: main.cc maps flags onto ServerOptions (options.h) and calls
// Server::Start; integration tests start it in-process on a loopback port.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "options.h"

namespace attnd {

class Server {
 public:
  // Builds the backend, binds the ports and starts serving.
  static absl::StatusOr<std::unique_ptr<Server>> Start(const ServerOptions& options);
  virtual ~Server() = default;

  virtual int port() const = 0;          // bound gRPC port
  virtual int metrics_port() const = 0;  // bound metrics port, 0 when disabled
  virtual std::string backend_name() const = 0;

  // Re-reads the token file (SIGHUP). On error the previous tokens stay in force and the
  // error says why. Thread-safe.
  virtual absl::Status ReloadTokens() = 0;

  // Readiness NOT_SERVING, refuse new steps, wait up to drain_grace for open steps, then stop
  // accepting RPCs and wait up to exit_grace for in-flight ones. Idempotent; thread-safe.
  virtual void Shutdown() = 0;
  // Blocks until Shutdown has completed.
  virtual void Wait() = 0;
};

}  // namespace attnd
