// The real daemon started in-process on loopback (CPU backend, small KV budget), and clients
// of it through the client library. Each test gets a fresh server.
#pragma once

#include <memory>
#include <string>

#include <gtest/gtest.h>

#include "attnd/client/client.h"
#include "server.h"

namespace attnd::integration {

// 64 MiB of KV budget: small enough to exhaust on purpose.
inline constexpr int64_t kTestKvBudgetBytes = int64_t{64} << 20;

// Options of the test server: a loopback port picked by the kernel, CPU backend, short drain,
// no metrics exposer.
ServerOptions TestServerOptions();

// The backend TestServerOptions() picks: "cpu", or "cuda" when the environment sets
// ATTND_TEST_BACKEND=cuda (to run this suite against the CUDA backend on a GPU machine).
std::string TestBackendName();

// Keeps gRPC's shared callback completion queue alive for the rest of the process. On Linux,
// gRPC 1.51 (Debian's) runs callback-API completions for every channel and server of a process
// on one completion queue with its own threads, reference-counted by them: it is shut down when
// the last user goes and rebuilt by the next. Tests that start and stop many servers and
// clients in one process cross zero often, and that teardown races callbacks still finishing
// (aborts in grpc_cq_internal_unref: "prior > 0" under --gtest_repeat, an ASan double free once
// in CI). A callback server that is started once and never stopped holds a reference for good.
// Idempotent; call before the first server or client of a test.
void PinGrpcCallbackQueue();

class IntegrationTest : public ::testing::Test {
 protected:
  void SetUp() override;
  void TearDown() override;

  // Override to start the server with other options.
  virtual ServerOptions Options() const { return TestServerOptions(); }

  // A new client with its own channel.
  std::unique_ptr<client::Client> NewClient() const;

  Server& server() { return *server_; }
  client::Client& client() { return *client_; }
  std::string address() const;

 private:
  std::unique_ptr<Server> server_;
  std::unique_ptr<client::Client> client_;
};

}  // namespace attnd::integration
