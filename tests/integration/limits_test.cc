// Connection limits: streams per connection (--max_streams_per_connection), and keepalive
// defaults of the client library that stay within the server's ping policy.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "attnd/client/client_options.h"
#include "status_matchers.h"
#include "test_server.h"
#include "test_steps.h"

namespace attnd::integration {
namespace {

using Code = absl::StatusCode;

class StreamsPerConnectionTest : public IntegrationTest {
 protected:
  ServerOptions Options() const override {
    ServerOptions options = TestServerOptions();
    options.limits.max_streams_per_connection = 1;
    return options;
  }
};

TEST_F(StreamsPerConnectionTest, CallsBeyondTheLimitWaitForAFreeStream) {
  ASSERT_OK(client().CreateCache("c", SmallConfig()));
  ASSERT_OK_AND_ASSIGN(auto session, client().OpenStream());
  ASSERT_OK(session->Plan(MakePlan("c", {{1, 1}})));  // the stream is up and holds the slot

  client::ClientOptions options = client().options();
  options.timeout = absl::Milliseconds(500);
  ASSERT_OK_AND_ASSIGN(auto impatient, client::Client::Connect(options));  // same connection
  EXPECT_EQ(impatient->GetServerInfo().status().code(), Code::kDeadlineExceeded)
      << "a second call on a connection limited to one stream has to wait";

  EXPECT_OK(session->Close());
  EXPECT_OK(impatient->GetServerInfo());
}

TEST(KeepaliveTest, ClientDefaultsStayWithinTheServersPingPolicy) {
  const client::KeepaliveOptions client_side;
  const KeepaliveServerOptions server_side;
  EXPECT_GE(client_side.time, server_side.min_ping_interval)
      << "a client pinging faster than the server permits is sent GOAWAY too_many_pings";
  EXPECT_TRUE(!client_side.permit_without_calls || server_side.permit_without_calls)
      << "the client pings idle connections, so the server must permit it";
  EXPECT_LT(client_side.timeout, client_side.time);
}

}  // namespace
}  // namespace attnd::integration
