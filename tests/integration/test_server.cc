#include "test_server.h"

#include <cstdlib>
#include <cstring>

#include <grpcpp/grpcpp.h>

#include "absl/strings/str_cat.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "status_matchers.h"

namespace attnd::integration {

std::string TestBackendName() {
  const char* backend = std::getenv("ATTND_TEST_BACKEND");
  return backend != nullptr && std::strcmp(backend, "cuda") == 0 ? "cuda" : "cpu";
}

ServerOptions TestServerOptions() {
  ServerOptions options;
  options.listen_address = "127.0.0.1:0";
  // The Prometheus exposer takes about a second to stop; only the metrics test starts it.
  options.metrics_address = "";
  options.backend = TestBackendName() == "cuda" ? BackendKind::kCuda : BackendKind::kCpu;
  options.kv_memory_bytes = kTestKvBudgetBytes;
  options.drain_grace = absl::Milliseconds(200);
  options.exit_grace = absl::Milliseconds(500);
  return options;
}

void PinGrpcCallbackQueue() {
  // Every method of the default CallbackService answers UNIMPLEMENTED; no port: it never serves.
  static grpc::Server* const pinned = [] {
    static grpc::health::v1::Health::CallbackService service;
    grpc::ServerBuilder builder;
    builder.RegisterService(&service);
    return builder.BuildAndStart().release();
  }();
  (void)pinned;
}

void IntegrationTest::SetUp() {
  PinGrpcCallbackQueue();
  ASSERT_OK_AND_ASSIGN(server_, Server::Start(Options()));
  ASSERT_GT(server_->port(), 0);
  client_ = NewClient();
  ASSERT_NE(client_, nullptr);
  ASSERT_OK(client_->WaitForConnected(absl::Seconds(10)));
}

void IntegrationTest::TearDown() {
  client_.reset();
  if (server_ != nullptr) {
    server_->Shutdown();
    server_->Wait();
  }
}

std::string IntegrationTest::address() const {
  return absl::StrCat("127.0.0.1:", server_->port());
}

std::unique_ptr<client::Client> IntegrationTest::NewClient() const {
  client::ClientOptions options;
  options.address = address();
  options.timeout = absl::Seconds(30);
  auto made = client::Client::Connect(options);
  EXPECT_TRUE(made.ok()) << made.status();
  return made.ok() ? *std::move(made) : nullptr;
}

}  // namespace attnd::integration
