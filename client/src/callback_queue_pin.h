// Keeps gRPC's shared callback completion queue alive for the rest of the process (see
// tests/integration/test_server.h, PinGrpcCallbackQueue, for the test-side twin). gRPC 1.51
// (Debian's) runs the callback-API completions of every channel and server of a process on one
// completion queue with its own threads, reference-counted by them; when the last channel goes
// it is torn down while the tail of a call that just ended may still run on one of its threads:
// attnctl bench aborted that way at exit ("grpc_cq_internal_unref: assertion failed: prior > 0",
// exit 134), about once in 40 runs whose daemon got SIGTERM mid-stream (issue 18).
#pragma once

namespace attnd::client {

// Idempotent and thread-safe; Client::Connect calls it.
void PinCallbackQueue();

}  // namespace attnd::client
