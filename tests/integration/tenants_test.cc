// Bearer tokens and tenants (--token_file): every AttentionService call needs a known token;
// a tenant sees and touches only its own caches and steps (others' are NOT_FOUND, so names do
// not leak), two tenants may use one cache name, page quotas and open-step limits hold per
// tenant, and a reload (SIGHUP) swaps the tokens without a restart.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <random>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "attnd/client/channel.h"
#include "attnd/client/sequence.h"
#include "http_get.h"
#include "status_matchers.h"
#include "test_pki.h"
#include "test_server.h"
#include "test_steps.h"

namespace attnd::integration {
namespace {

using Code = absl::StatusCode;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Not;

constexpr char kAlphaToken[] = "alpha-token-0123456789";
constexpr char kBetaToken[] = "beta-token-0123456789";
constexpr char kGammaToken[] = "gamma-token-0123456789";  // quota: 100 pages
constexpr char kTokenFile[] =
    "# tenants of the integration tests\n"
    "alpha alpha-token-0123456789\n"
    "beta  beta-token-0123456789   # default quota\n"
    "gamma gamma-token-0123456789 100\n";

std::vector<std::string> Names(const std::vector<attnd::v1::CacheInfo>& caches) {
  std::vector<std::string> names;
  for (const auto& cache : caches) names.push_back(cache.name());
  return names;
}

class TenantsTest : public IntegrationTest {
 protected:
  ServerOptions Options() const override {
    ServerOptions options = TestServerOptions();
    options.token_file = token_file_;
    options.limits.max_open_steps_per_tenant = 2;
    return options;
  }

  std::unique_ptr<client::Client> ClientWithToken(const std::string& token) const {
    client::ClientOptions options;
    options.address = address();
    options.timeout = absl::Seconds(30);
    options.bearer_token = token;
    auto made = client::Client::Connect(options);
    EXPECT_TRUE(made.ok()) << made.status();
    return made.ok() ? *std::move(made) : nullptr;
  }

  // Rewrites the token file (then call server().ReloadTokens()).
  void RewriteTokenFile(const std::string& contents) const {
    WriteTempFile(token_file_name_, contents);
  }

 private:
  static std::string NextTokenFileName() {
    static std::atomic<int> next{0};
    return absl::StrCat("tokens-", next.fetch_add(1), ".txt");
  }

  // One file per test: a test may rewrite it and reload.
  const std::string token_file_name_ = NextTokenFileName();
  const std::string token_file_ = WriteTempFile(token_file_name_, kTokenFile);
};

TEST_F(TenantsTest, CallsWithoutATokenAreUnauthenticated) {
  client::Client& anonymous = client();  // IntegrationTest's client sends no token
  EXPECT_ERROR(anonymous.GetServerInfo(), Code::kUnauthenticated, "authorization");
  EXPECT_ERROR(anonymous.CreateCache("c", SmallConfig()), Code::kUnauthenticated,
               "authorization");
  EXPECT_ERROR(anonymous.GetCache("c"), Code::kUnauthenticated, "authorization");
  EXPECT_ERROR(anonymous.ListCaches(), Code::kUnauthenticated, "authorization");
  EXPECT_ERROR(anonymous.DeleteCache("c"), Code::kUnauthenticated, "authorization");
  const uint64_t ids[] = {1};
  EXPECT_ERROR(anonymous.FreeSequences("c", ids), Code::kUnauthenticated, "authorization");
  EXPECT_ERROR(anonymous.Plan(MakePlan("c", {{1, 1}})), Code::kUnauthenticated, "authorization");
  attnd::v1::ForwardRequest forward;
  forward.set_step_id(1);
  EXPECT_ERROR(anonymous.Forward(forward), Code::kUnauthenticated, "authorization");
  EXPECT_ERROR(anonymous.EndStep(1, true), Code::kUnauthenticated, "authorization");
  EXPECT_ERROR(anonymous.GetStats(), Code::kUnauthenticated, "authorization");

  ASSERT_OK_AND_ASSIGN(auto session, anonymous.OpenStream());
  EXPECT_ERROR(session->Plan(MakePlan("c", {{1, 1}})), Code::kUnauthenticated, "authorization");
}

TEST_F(TenantsTest, UnknownTokensAreUnauthenticatedAndNeverEchoed) {
  for (const std::string token : {"not-a-known-token-at-all", "alpha-token-012345678",
                                   "alpha-token-0123456789x", "x"}) {
    auto stranger = ClientWithToken(token);
    auto info = stranger->GetServerInfo();
    EXPECT_ERROR(info, Code::kUnauthenticated, "authorization");
    EXPECT_THAT(std::string(info.status().message()), Not(HasSubstr(token)));
    EXPECT_ERROR(stranger->ListCaches(), Code::kUnauthenticated, "authorization");
  }
  // The scheme is case-insensitive; a bare token (no scheme) is not accepted.
  auto alpha = ClientWithToken(kAlphaToken);
  auto context = std::make_unique<grpc::ClientContext>();
  context->AddMetadata("authorization", absl::StrCat("bearer ", kAlphaToken));
  attnd::v1::ListCachesResponse list;
  EXPECT_TRUE(alpha->stub().ListCaches(context.get(), {}, &list).ok());
  context = std::make_unique<grpc::ClientContext>();
  context->AddMetadata("authorization", kAlphaToken);
  EXPECT_EQ(alpha->stub().ListCaches(context.get(), {}, &list).error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
}

TEST_F(TenantsTest, HealthNeedsNoToken) {
  ASSERT_OK_AND_ASSIGN(auto live, client().CheckHealth(""));
  EXPECT_EQ(live, grpc::health::v1::HealthCheckResponse::SERVING);
  ASSERT_OK_AND_ASSIGN(auto ready, client().CheckHealth(client::kReadinessService));
  EXPECT_EQ(ready, grpc::health::v1::HealthCheckResponse::SERVING);
}

TEST_F(TenantsTest, ATenantSeesAndTouchesOnlyItsOwnCaches) {
  auto alpha = ClientWithToken(kAlphaToken);
  auto beta = ClientWithToken(kBetaToken);
  ASSERT_OK(alpha->CreateCache("private", SmallConfig()));
  ASSERT_OK(alpha->CreateCache("model", SmallConfig()));
  ASSERT_OK(beta->CreateCache("zeta", SmallConfig()));
  std::mt19937_64 rng(1);
  ASSERT_OK_AND_ASSIGN(auto step, alpha->BeginStep(MakePlan("private", {{7, 5}})));
  for (int32_t layer = 0; layer < 2; ++layer) {
    ASSERT_OK(step->Forward(RandomLayer(rng, SmallConfig(), 5, layer)));
  }

  ASSERT_OK_AND_ASSIGN(auto alpha_caches, alpha->ListCaches());
  EXPECT_THAT(Names(alpha_caches), ElementsAre("model", "private"));
  ASSERT_OK_AND_ASSIGN(auto beta_caches, beta->ListCaches());
  EXPECT_THAT(Names(beta_caches), ElementsAre("zeta"));

  // Every way beta could reach alpha's cache answers as if it did not exist.
  EXPECT_ERROR(beta->GetCache("private"), Code::kNotFound, "private");
  EXPECT_ERROR(beta->DeleteCache("private", /*force=*/true), Code::kNotFound, "private");
  const uint64_t ids[] = {7};
  EXPECT_ERROR(beta->FreeSequences("private", ids), Code::kNotFound, "private");
  EXPECT_ERROR(beta->Plan(MakePlan("private", {{7, 1}})), Code::kNotFound, "private");
  ASSERT_OK(beta->CreateCache("private", SmallConfig(8)));

  // Alpha's cache is untouched: its sequence, its pages, its name.
  ASSERT_OK_AND_ASSIGN(auto info, alpha->GetCache("private"));
  EXPECT_EQ(info.name(), "private");
  EXPECT_EQ(info.num_sequences(), 1);
  EXPECT_EQ(ProbeLength(*alpha, "private", 7), 5);
  ASSERT_OK_AND_ASSIGN(auto beta_private, beta->GetCache("private"));
  EXPECT_EQ(beta_private.num_pages(), 8) << "beta's own 'private' is a different cache";
  EXPECT_EQ(beta_private.num_sequences(), 0);
}

TEST_F(TenantsTest, TwoTenantsUseOneNameWithoutClashing) {
  auto alpha = ClientWithToken(kAlphaToken);
  auto beta = ClientWithToken(kBetaToken);
  ASSERT_OK_AND_ASSIGN(auto alpha_cache, alpha->CreateCache("llama", SmallConfig(32)));
  ASSERT_OK_AND_ASSIGN(auto beta_cache, beta->CreateCache("llama", SmallConfig(48)));
  EXPECT_EQ(alpha_cache.name(), "llama");
  EXPECT_EQ(beta_cache.name(), "llama");
  EXPECT_ERROR(alpha->CreateCache("llama", SmallConfig()), Code::kAlreadyExists, "llama");

  // Both run steps on their own "llama", checked against their own reference.
  ASSERT_OK_AND_ASSIGN(auto alpha_reference, client::ReferenceCache::Create(alpha_cache.config()));
  ASSERT_OK_AND_ASSIGN(auto beta_reference, client::ReferenceCache::Create(beta_cache.config()));
  std::mt19937_64 rng(2);
  RunStepAndCheck(*alpha, *alpha_reference, alpha_cache, {{1, 9}, {2, 3}}, rng);
  RunStepAndCheck(*beta, *beta_reference, beta_cache, {{1, 2}}, rng);
  RunStepAndCheck(*alpha, *alpha_reference, alpha_cache, {{1, 1}, {2, 1}}, rng);
  EXPECT_EQ(ProbeLength(*alpha, "llama", 1), 10);
  EXPECT_EQ(ProbeLength(*beta, "llama", 1), 2);
  EXPECT_EQ(ProbeLength(*beta, "llama", 2), 0);

  // Deleting one leaves the other.
  ASSERT_OK(beta->DeleteCache("llama"));
  ASSERT_OK_AND_ASSIGN(auto info, alpha->GetCache("llama"));
  EXPECT_EQ(info.num_pages(), 32);
  EXPECT_ERROR(beta->GetCache("llama"), Code::kNotFound, "llama");
}

TEST_F(TenantsTest, ErrorsSpeakTheTenantsOwnNames) {
  auto alpha = ClientWithToken(kAlphaToken);
  ASSERT_OK(alpha->CreateCache("tiny", SmallConfig(2)));
  auto plan = alpha->Plan(MakePlan("tiny", {{1, 40}}));  // 10 pages into 2
  EXPECT_ERROR(plan, Code::kResourceExhausted, "cache 'tiny'");
  EXPECT_THAT(std::string(plan.status().message()), Not(HasSubstr("alpha")));
  auto missing = alpha->GetCache("nope");
  EXPECT_ERROR(missing, Code::kNotFound, "'nope'");
  EXPECT_THAT(std::string(missing.status().message()), Not(HasSubstr("alpha")));
}

TEST_F(TenantsTest, StepsOfAnotherTenantAreNotFound) {
  auto alpha = ClientWithToken(kAlphaToken);
  auto beta = ClientWithToken(kBetaToken);
  ASSERT_OK_AND_ASSIGN(auto cache, alpha->CreateCache("c", SmallConfig()));
  ASSERT_OK(beta->CreateCache("c", SmallConfig()));
  ASSERT_OK_AND_ASSIGN(auto plan, alpha->Plan(MakePlan("c", {{1, 3}})));
  std::mt19937_64 rng(3);

  attnd::v1::ForwardRequest layer0 = RandomLayer(rng, cache.config(), 3, 0);
  layer0.set_step_id(plan.step_id());
  EXPECT_ERROR(beta->Forward(layer0), Code::kNotFound, "step_id");
  EXPECT_ERROR(beta->EndStep(plan.step_id(), /*abort=*/true), Code::kNotFound, "step_id");
  EXPECT_ERROR(beta->EndStep(plan.step_id(), /*abort=*/false), Code::kNotFound, "step_id");
  ASSERT_OK_AND_ASSIGN(auto beta_stream, beta->OpenStream());
  EXPECT_ERROR(beta_stream->Forward(layer0), Code::kNotFound, "step_id");
  EXPECT_ERROR(beta_stream->EndStep(plan.step_id(), true), Code::kNotFound, "step_id");
  EXPECT_OK(beta_stream->Close());

  // Beta's attempts changed nothing: alpha's step runs and commits.
  ASSERT_OK(alpha->Forward(layer0));
  attnd::v1::ForwardRequest layer1 = RandomLayer(rng, cache.config(), 3, 1);
  layer1.set_step_id(plan.step_id());
  ASSERT_OK_AND_ASSIGN(auto last, alpha->Forward(layer1));
  EXPECT_TRUE(last.step_committed());
  EXPECT_EQ(ProbeLength(*alpha, "c", 1), 3);

  // Once it ended, alpha hears its outcome and beta still hears nothing.
  ASSERT_OK_AND_ASSIGN(auto ended, alpha->EndStep(plan.step_id(), false));
  EXPECT_ERROR(beta->EndStep(plan.step_id(), false), Code::kNotFound, "step_id");
  EXPECT_ERROR(beta->Forward(layer1), Code::kNotFound, "step_id");
  EXPECT_ERROR(alpha->Forward(layer1), Code::kFailedPrecondition, "committed");
}

TEST_F(TenantsTest, OpenStepsAreLimitedPerTenant) {
  auto alpha = ClientWithToken(kAlphaToken);
  auto beta = ClientWithToken(kBetaToken);
  ASSERT_OK(alpha->CreateCache("c", SmallConfig()));
  ASSERT_OK(beta->CreateCache("c", SmallConfig()));

  ASSERT_OK_AND_ASSIGN(auto first, alpha->BeginStep(MakePlan("c", {{1, 1}})));
  ASSERT_OK_AND_ASSIGN(auto session, alpha->OpenStream());
  ASSERT_OK_AND_ASSIGN(auto second, session->BeginStep(MakePlan("c", {{2, 1}})));
  EXPECT_ERROR(alpha->Plan(MakePlan("c", {{3, 1}})), Code::kResourceExhausted,
               "--max_open_steps_per_tenant");
  EXPECT_ERROR(session->Plan(MakePlan("c", {{3, 1}})), Code::kResourceExhausted,
               "--max_open_steps_per_tenant");

  // Another tenant is not held back by alpha's steps.
  ASSERT_OK_AND_ASSIGN(auto beta_step, beta->BeginStep(MakePlan("c", {{1, 1}})));

  // Ending a step (here: aborting, and a stream that closes) frees its slot.
  ASSERT_OK(first->Abort());
  ASSERT_OK_AND_ASSIGN(auto third, alpha->BeginStep(MakePlan("c", {{3, 1}})));
  EXPECT_ERROR(alpha->Plan(MakePlan("c", {{4, 1}})), Code::kResourceExhausted,
               "--max_open_steps_per_tenant");
  session->Cancel();
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  absl::StatusOr<attnd::v1::PlanResponse> fourth;
  do {
    fourth = alpha->Plan(MakePlan("c", {{4, 1}}));
    if (fourth.ok()) break;
    absl::SleepFor(absl::Milliseconds(20));
  } while (absl::Now() < deadline);
  ASSERT_OK(fourth);
  EXPECT_OK(alpha->EndStep(fourth->step_id(), true));
  EXPECT_OK(third->Abort());
  EXPECT_OK(beta_step->Abort());
}

TEST_F(TenantsTest, PageQuotaIsEnforcedAndNamed) {
  auto gamma = ClientWithToken(kGammaToken);  // 100 pages
  ASSERT_OK(gamma->CreateCache("a", SmallConfig(60)));
  auto over = gamma->CreateCache("b", SmallConfig(41));
  EXPECT_ERROR(over, Code::kResourceExhausted, "quota");
  EXPECT_THAT(std::string(over.status().message()), HasSubstr("100 pages"));
  ASSERT_OK_AND_ASSIGN(auto caches, gamma->ListCaches());
  EXPECT_THAT(Names(caches), ElementsAre("a")) << "a refused create leaves nothing behind";

  ASSERT_OK(gamma->CreateCache("b", SmallConfig(40)));  // exactly the quota
  EXPECT_ERROR(gamma->CreateCache("c", SmallConfig(1)), Code::kResourceExhausted, "quota");
  // Other tenants' pages do not count against gamma, nor gamma's against them.
  auto alpha = ClientWithToken(kAlphaToken);
  ASSERT_OK(alpha->CreateCache("big", SmallConfig(500)));
  // Deleting a cache gives its pages back to the quota.
  ASSERT_OK(gamma->DeleteCache("a"));
  EXPECT_OK(gamma->CreateCache("c", SmallConfig(60)));
}

class DefaultQuotaTest : public TenantsTest {
 protected:
  ServerOptions Options() const override {
    ServerOptions options = TenantsTest::Options();
    options.tenant_page_quota = 50;
    return options;
  }
};

TEST_F(DefaultQuotaTest, TenantsWithoutAQuotaColumnGetTheDefault) {
  auto beta = ClientWithToken(kBetaToken);
  EXPECT_ERROR(beta->CreateCache("c", SmallConfig(51)), Code::kResourceExhausted,
               "--tenant_page_quota");
  EXPECT_OK(beta->CreateCache("c", SmallConfig(50)));
  auto gamma = ClientWithToken(kGammaToken);  // its own column (100) wins over the default
  EXPECT_OK(gamma->CreateCache("c", SmallConfig(100)));
}

TEST_F(TenantsTest, ReloadSwapsTokensAndKeepsCaches) {
  auto alpha = ClientWithToken(kAlphaToken);
  auto beta = ClientWithToken(kBetaToken);
  ASSERT_OK(beta->CreateCache("kept", SmallConfig()));
  ASSERT_OK_AND_ASSIGN(auto beta_stream, beta->OpenStream());
  ASSERT_OK(beta_stream->Plan(MakePlan("kept", {{1, 1}})));

  // Beta's token is rotated: the old one goes, a new one names the same tenant; delta joins.
  RewriteTokenFile(
      "alpha alpha-token-0123456789\n"
      "beta beta-rotated-0123456789\n"
      "delta delta-token-0123456789\n");
  ASSERT_OK(server().ReloadTokens());
  EXPECT_ERROR(beta->ListCaches(), Code::kUnauthenticated, "authorization");
  // An open stream's token is re-checked per message.
  EXPECT_ERROR(beta_stream->Plan(MakePlan("kept", {{2, 1}})), Code::kUnauthenticated,
               "authorization");
  EXPECT_OK(alpha->ListCaches());
  auto rotated = ClientWithToken("beta-rotated-0123456789");
  ASSERT_OK_AND_ASSIGN(auto kept, rotated->ListCaches());
  EXPECT_THAT(Names(kept), ElementsAre("kept")) << "caches belong to the tenant, not the token";
  auto delta = ClientWithToken("delta-token-0123456789");
  ASSERT_OK_AND_ASSIGN(auto none, delta->ListCaches());
  EXPECT_TRUE(none.empty());

  // A broken file is refused and the tokens in force stay.
  RewriteTokenFile("alpha too-short\n");
  const absl::Status broken = server().ReloadTokens();
  EXPECT_FALSE(broken.ok());
  EXPECT_THAT(std::string(broken.message()), HasSubstr(":1:"));
  EXPECT_THAT(std::string(broken.message()), Not(HasSubstr("too-short")));
  EXPECT_OK(alpha->ListCaches());
  EXPECT_OK(delta->ListCaches());
  beta_stream->Cancel();
}

class TenantMetricsTest : public TenantsTest {
 protected:
  ServerOptions Options() const override {
    ServerOptions options = TenantsTest::Options();
    options.metrics_address = "127.0.0.1:0";
    return options;
  }
};

TEST_F(TenantMetricsTest, MetricsNameNoCacheByDefaultWithTenants) {
  auto alpha = ClientWithToken(kAlphaToken);
  auto beta = ClientWithToken(kBetaToken);
  ASSERT_OK(alpha->CreateCache("secret-alpha-model", SmallConfig(30)));
  ASSERT_OK(beta->CreateCache("secret-beta-model", SmallConfig(20)));
  ASSERT_OK(alpha->Plan(MakePlan("secret-alpha-model", {{1, 9}})));  // 3 pages
  ASSERT_OK_AND_ASSIGN(const std::string exposition, HttpGet(server().metrics_port(), "/metrics"));
  EXPECT_THAT(exposition, Not(HasSubstr("secret")));
  EXPECT_THAT(exposition, HasSubstr("attnd_kv_pages{cache=\"\",state=\"used\"} 3"));
  EXPECT_THAT(exposition, HasSubstr("attnd_kv_pages{cache=\"\",state=\"free\"} 47"));
}

}  // namespace
}  // namespace attnd::integration

namespace attnd::integration {
namespace {

// Fork, export and import speak the tenant's names: another tenant's cache is NOT_FOUND (never
// PERMISSION_DENIED), errors do not name the namespace, and a sequence crosses tenants only
// through a client holding both tokens.
TEST_F(TenantsTest, SequenceLifecycleStaysWithinATenant) {
  auto alpha = ClientWithToken(kAlphaToken);
  auto beta = ClientWithToken(kBetaToken);
  ASSERT_OK(alpha->CreateCache("model", SmallConfig()));
  ASSERT_OK(beta->CreateCache("model", SmallConfig()));
  std::mt19937_64 rng(2);
  ASSERT_OK_AND_ASSIGN(auto step, alpha->BeginStep(MakePlan("model", {{7, 5}})));
  for (int32_t layer = 0; layer < 2; ++layer) {
    ASSERT_OK(step->Forward(RandomLayer(rng, SmallConfig(), 5, layer)));
  }
  ASSERT_OK(client::ForkSequence(*alpha, "model", 7, 8).status());
  // Beta's cache of the same name has no sequence 7; beta cannot reach alpha's.
  auto forked = client::ForkSequence(*beta, "model", 7, 9);
  EXPECT_ERROR(forked, Code::kNotFound, "source_id");
  EXPECT_THAT(std::string(forked.status().message()), Not(HasSubstr("alpha")));
  absl::Status exported = client::ExportSequence(
      *beta, "model", 7, [](const attnd::v1::ExportSequenceResponse&) { return absl::OkStatus(); });
  EXPECT_EQ(exported.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(exported.message()), Not(HasSubstr("alpha")));
  // Alpha's sequence copied into beta's cache by a client with both tokens.
  ASSERT_OK_AND_ASSIGN(auto copied, client::CopySequence(*alpha, "model", 8, *beta, "model"));
  EXPECT_EQ(copied.num_tokens(), 5);
  ASSERT_OK_AND_ASSIGN(auto beta_model, beta->GetCache("model"));
  EXPECT_EQ(beta_model.num_sequences(), 1);
  // Importing into a cache beta does not have.
  auto nowhere = client::CopySequence(*alpha, "model", 8, *beta, "private");
  EXPECT_ERROR(nowhere, Code::kNotFound, "private");
  EXPECT_THAT(std::string(nowhere.status().message()), Not(HasSubstr("beta/")));
  ASSERT_OK_AND_ASSIGN(auto alpha_model, alpha->GetCache("model"));
  EXPECT_EQ(alpha_model.num_sequences(), 2);
  EXPECT_EQ(alpha_model.shared_pages(), 2);
}

TEST_F(TenantsTest, AnotherTenantsChannelCarriesNoTransferOfMine) {
  auto alpha = ClientWithToken(kAlphaToken);
  auto beta = ClientWithToken(kBetaToken);
  ASSERT_OK(alpha->CreateCache("model", SmallConfig()));
  ASSERT_OK(beta->CreateCache("model", SmallConfig()));
  std::mt19937_64 rng(4);
  ASSERT_OK_AND_ASSIGN(auto step, beta->BeginStep(MakePlan("model", {{3, 5}})));
  for (int32_t layer = 0; layer < 2; ++layer) {
    ASSERT_OK(step->Forward(RandomLayer(rng, SmallConfig(), 5, layer)));
  }
  client::ChannelOptions options;
  options.kind = attnd::v1::CHANNEL_KIND_HOST_SHM;
  options.max_tokens = 4;
  ASSERT_OK_AND_ASSIGN(auto alphas, client::Channel::Open(*alpha, "model", options));
  // Beta names alpha's channel: NOT_FOUND, as an id that does not exist.
  auto context = beta->NewContext();
  attnd::v1::ExportSequenceRequest request;
  request.set_cache("model");
  request.set_sequence_id(3);
  request.set_channel_id(alphas->id());
  auto reader = beta->stub().ExportSequence(context.get(), request);
  attnd::v1::ExportSequenceResponse message;
  while (reader->Read(&message)) {
  }
  const grpc::Status exported = reader->Finish();
  EXPECT_EQ(exported.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_THAT(exported.error_message(), HasSubstr("channel_id"));
  EXPECT_THAT(exported.error_message(), Not(HasSubstr("alpha")));
  std::vector<attnd::v1::ExportSequenceResponse> messages;
  ASSERT_OK(client::ExportSequence(*beta, "model", 3, [&](const auto& m) {
    messages.push_back(m);
    return absl::OkStatus();
  }));
  auto import_context = beta->NewContext();
  attnd::v1::ImportSequenceResponse response;
  auto writer = beta->stub().ImportSequence(import_context.get(), &response);
  attnd::v1::ImportSequenceRequest first;
  first.set_cache("model");
  first.set_sequence_id(4);
  first.set_channel_id(alphas->id());
  *first.mutable_header() = messages[0].header();
  writer->Write(first);
  writer->WritesDone();
  const grpc::Status imported = writer->Finish();
  EXPECT_EQ(imported.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_THAT(imported.error_message(), HasSubstr("channel_id"));
  ASSERT_OK_AND_ASSIGN(auto beta_model, beta->GetCache("model"));
  EXPECT_EQ(beta_model.num_sequences(), 1);
  EXPECT_EQ(beta_model.shared_pages(), 0);
  // Alpha's own transfers go through it.
  ASSERT_OK(client::ImportSequenceThroughChannel(*alpha, "model", 3, *alphas, [&, next = size_t{0}](
      attnd::v1::ExportSequenceResponse& m) mutable -> absl::StatusOr<bool> {
    if (next == messages.size()) return false;
    m = messages[next++];
    return true;
  }).status());
}

}  // namespace
}  // namespace attnd::integration
