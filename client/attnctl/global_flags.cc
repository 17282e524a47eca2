#include "global_flags.h"

#include <string>

#include "absl/flags/flag.h"

ABSL_FLAG(std::string, server, "localhost:50051", "attnd address (host:port or a gRPC target)");
ABSL_FLAG(absl::Duration, timeout, absl::Seconds(30),
          "deadline of each RPC, e.g. 30s, 500ms ('inf' for none)");
ABSL_FLAG(bool, json, false, "print responses as JSON (info, stats, cache list/get/create)");

ABSL_FLAG(bool, stream, false,
          "demo, bench: run steps over one ForwardStream instead of unary Plan/Forward/EndStep");
ABSL_FLAG(uint64_t, seed, 1, "demo, bench: seed of the random q/k/v");

namespace attnd::attnctl {

absl::StatusOr<std::unique_ptr<client::Client>> ConnectFromFlags() {
  client::ClientOptions options;
  options.address = absl::GetFlag(FLAGS_server);
  options.timeout = absl::GetFlag(FLAGS_timeout);
  return client::Client::Connect(options);
}

}  // namespace attnd::attnctl
