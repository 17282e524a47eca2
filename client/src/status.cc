#include "attnd/client/status.h"

namespace attnd::client {

absl::Status FromGrpcStatus(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
}

absl::Status FromStreamError(const attnd::v1::StreamError& error) {
  if (error.code() == 0) {
    // A set error with code OK would be a server bug; do not turn it into success.
    return absl::InternalError("stream response carried an error with code OK: " + error.message());
  }
  return absl::Status(static_cast<absl::StatusCode>(error.code()), error.message());
}

}  // namespace attnd::client
