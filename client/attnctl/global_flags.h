// attnctl's global flags (--server, --timeout, --json, TLS and token) and the client they
// describe.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/flags/declare.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "attnd/client/client.h"

ABSL_DECLARE_FLAG(std::string, server);
ABSL_DECLARE_FLAG(absl::Duration, timeout);
ABSL_DECLARE_FLAG(bool, json);
// Shared by demo and bench.
ABSL_DECLARE_FLAG(bool, stream);
ABSL_DECLARE_FLAG(uint64_t, seed);

namespace attnd::attnctl {

// A client for --server (or `address` when not empty) with --timeout as each call's deadline,
// over TLS when a --tls* flag says so, sending the bearer token of --token, --token_file or
// $ATTND_TOKEN.
absl::StatusOr<std::unique_ptr<client::Client>> ConnectFromFlags(const std::string& address = "");

}  // namespace attnd::attnctl
