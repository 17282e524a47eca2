// Conversions between gRPC statuses and absl::Status. Both use the canonical code numbering,
// so the mapping is 1:1 and the server's message is kept verbatim.
#pragma once

#include <grpcpp/support/status.h>

#include "absl/status/status.h"
#include "attnd/v1/attnd.pb.h"

namespace attnd::client {

absl::Status FromGrpcStatus(const grpc::Status& status);

// A per-message error of ForwardStream (StreamResponse.error).
absl::Status FromStreamError(const attnd::v1::StreamError& error);

}  // namespace attnd::client
