// TLS and mutual TLS on the gRPC port (--tls_cert/--tls_key/--tls_client_ca), with
// certificates made at test time: TLS clients that trust the CA get through, plaintext and
// untrusting clients do not, mutual TLS refuses clients without a certificate from its CA,
// and flags that cannot work stop the server at start with the flag's name.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <random>

#include "absl/strings/str_cat.h"
#include "status_matchers.h"
#include "test_pki.h"
#include "test_server.h"
#include "test_steps.h"

namespace attnd::integration {
namespace {

using Code = absl::StatusCode;
using ::testing::HasSubstr;

class TlsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    PinGrpcCallbackQueue();
    auto pki = GetTestPki();
    ASSERT_TRUE(pki.ok()) << pki.status();
    pki_ = *pki;
  }

  void TearDown() override {
    if (server_ != nullptr) {
      server_->Shutdown();
      server_->Wait();
    }
  }

  ServerOptions TlsOptions(bool mutual = false) const {
    ServerOptions options = TestServerOptions();
    options.tls.cert_file = pki_->server_cert_file;
    options.tls.key_file = pki_->server_key_file;
    if (mutual) options.tls.client_ca_file = pki_->ca_file;
    return options;
  }

  void StartServer(const ServerOptions& options) {
    auto server = Server::Start(options);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
  }

  // A client of the running server; `tls.enabled` false means plaintext.
  std::unique_ptr<client::Client> Connect(client::TlsOptions tls, std::string token = "",
                                          std::string host = "127.0.0.1") const {
    client::ClientOptions options;
    options.address = absl::StrCat(host, ":", server_->port());
    options.timeout = absl::Seconds(10);
    options.tls = std::move(tls);
    options.bearer_token = std::move(token);
    auto made = client::Client::Connect(options);
    EXPECT_TRUE(made.ok()) << made.status();
    return made.ok() ? *std::move(made) : nullptr;
  }

  client::TlsOptions TrustingTheCa() const {
    client::TlsOptions tls;
    tls.enabled = true;
    tls.root_certs_pem = pki_->ca_pem;
    return tls;
  }

  client::TlsOptions WithClientCert() const {
    client::TlsOptions tls = TrustingTheCa();
    tls.cert_chain_pem = pki_->client_cert_pem;
    tls.private_key_pem = pki_->client_key_pem;
    return tls;
  }

  const TestPki* pki_ = nullptr;
  std::unique_ptr<Server> server_;
};

TEST_F(TlsTest, ClientsThatTrustTheCaGetThrough) {
  ASSERT_NO_FATAL_FAILURE(StartServer(TlsOptions()));
  for (const std::string host : {"127.0.0.1", "localhost"}) {
    auto client = Connect(TrustingTheCa(), "", host);
    ASSERT_OK_AND_ASSIGN(auto info, client->GetServerInfo());
    EXPECT_FALSE(info.version().empty());
    ASSERT_OK_AND_ASSIGN(auto health, client->CheckHealth(client::kReadinessService));
    EXPECT_EQ(health, grpc::health::v1::HealthCheckResponse::SERVING);
  }
  // A whole step, unary and streamed, over TLS.
  auto client = Connect(TrustingTheCa());
  ASSERT_OK_AND_ASSIGN(auto cache, client->CreateCache("c", SmallConfig()));
  ASSERT_OK_AND_ASSIGN(auto reference, client::ReferenceCache::Create(cache.config()));
  std::mt19937_64 rng(1);
  RunStepAndCheck(*client, *reference, cache, {{1, 6}, {2, 1}}, rng);
  ASSERT_OK_AND_ASSIGN(auto session, client->OpenStream());
  const auto plan = MakePlan("c", {{1, 1}, {2, 3}});
  ASSERT_OK_AND_ASSIGN(auto step, session->BeginStep(plan));
  ASSERT_OK(reference->BeginStep(plan));
  RunLayersAndCheck(*step, *reference, cache.config(), rng);
  EXPECT_OK(session->Close());
}

TEST_F(TlsTest, PlaintextClientsAreRefused) {
  ASSERT_NO_FATAL_FAILURE(StartServer(TlsOptions()));
  auto plaintext = Connect(client::TlsOptions{});
  EXPECT_EQ(plaintext->GetServerInfo().status().code(), Code::kUnavailable);
  EXPECT_EQ(plaintext->CheckHealth().status().code(), Code::kUnavailable);
}

TEST_F(TlsTest, ClientsThatDoNotTrustTheCaAreRefused) {
  ASSERT_NO_FATAL_FAILURE(StartServer(TlsOptions()));
  client::TlsOptions tls;
  tls.enabled = true;
  tls.root_certs_pem = pki_->other_ca_pem;
  EXPECT_EQ(Connect(tls)->GetServerInfo().status().code(), Code::kUnavailable);
}

TEST_F(TlsTest, ServerNameOverrideChecksTheCertificatesName) {
  ServerOptions options = TlsOptions();
  options.tls.cert_file = pki_->named_server_cert_file;  // DNS:attnd.test only
  options.tls.key_file = pki_->named_server_key_file;
  ASSERT_NO_FATAL_FAILURE(StartServer(options));
  EXPECT_EQ(Connect(TrustingTheCa())->GetServerInfo().status().code(), Code::kUnavailable)
      << "127.0.0.1 is not the certificate's name";
  client::TlsOptions tls = TrustingTheCa();
  tls.server_name_override = "attnd.test";
  EXPECT_OK(Connect(tls)->GetServerInfo());
  tls.server_name_override = "other.test";
  EXPECT_EQ(Connect(tls)->GetServerInfo().status().code(), Code::kUnavailable);
}

TEST_F(TlsTest, MutualTlsRequiresAClientCertificateFromItsCa) {
  ASSERT_NO_FATAL_FAILURE(StartServer(TlsOptions(/*mutual=*/true)));
  EXPECT_EQ(Connect(TrustingTheCa())->GetServerInfo().status().code(), Code::kUnavailable)
      << "no client certificate";
  EXPECT_EQ(Connect(TrustingTheCa())->CheckHealth().status().code(), Code::kUnavailable)
      << "mutual TLS is the transport's: health needs the certificate too";
  client::TlsOptions rogue = TrustingTheCa();
  rogue.cert_chain_pem = pki_->rogue_client_cert_pem;
  rogue.private_key_pem = pki_->rogue_client_key_pem;
  EXPECT_EQ(Connect(rogue)->GetServerInfo().status().code(), Code::kUnavailable)
      << "a certificate from another CA";
  EXPECT_OK(Connect(WithClientCert())->GetServerInfo());
}

TEST_F(TlsTest, TlsAndTokensTogether) {
  ServerOptions options = TlsOptions(/*mutual=*/true);
  options.token_file = WriteTempFile("tls-tokens.txt", "ops ops-token-0123456789abcdef\n");
  ASSERT_NO_FATAL_FAILURE(StartServer(options));
  EXPECT_ERROR(Connect(WithClientCert())->GetServerInfo(), Code::kUnauthenticated,
               "authorization");
  auto client = Connect(WithClientCert(), "ops-token-0123456789abcdef");
  ASSERT_OK_AND_ASSIGN(auto cache, client->CreateCache("c", SmallConfig()));
  ASSERT_OK_AND_ASSIGN(auto reference, client::ReferenceCache::Create(cache.config()));
  std::mt19937_64 rng(2);
  ASSERT_OK_AND_ASSIGN(auto session, client->OpenStream());
  const auto plan = MakePlan("c", {{1, 5}});
  ASSERT_OK_AND_ASSIGN(auto step, session->BeginStep(plan));
  ASSERT_OK(reference->BeginStep(plan));
  RunLayersAndCheck(*step, *reference, cache.config(), rng);
  EXPECT_OK(session->Close());
}

// Server::Start with flags that cannot work fails and names the flag.
void ExpectStartFails(const ServerOptions& options, const std::string& names) {
  auto server = Server::Start(options);
  ASSERT_FALSE(server.ok()) << "started with " << names;
  EXPECT_THAT(std::string(server.status().message()), HasSubstr(names)) << server.status();
}

TEST_F(TlsTest, UnusableTlsFlagsStopTheStartNamingTheFlag) {
  ServerOptions options = TlsOptions();
  options.tls.key_file = "";
  ExpectStartFails(options, "--tls_cert and --tls_key");

  options = TestServerOptions();
  options.tls.client_ca_file = pki_->ca_file;
  ExpectStartFails(options, "--tls_client_ca");

  options = TlsOptions();
  options.tls.cert_file = pki_->dir + "/missing.pem";
  ExpectStartFails(options, "--tls_cert=");

  options = TlsOptions();
  options.tls.key_file = WriteTempFile("not-a-key.pem", "hello\n");
  ExpectStartFails(options, "--tls_key=");

  options = TlsOptions();
  options.tls.key_file = pki_->named_server_key_file;  // not the certificate's key
  ExpectStartFails(options, "--tls_cert/--tls_key");

  options = TestServerOptions();
  options.token_file = pki_->dir + "/no-such-tokens.txt";
  ExpectStartFails(options, "--token_file=");
}

}  // namespace
}  // namespace attnd::integration
