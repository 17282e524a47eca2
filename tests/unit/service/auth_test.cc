// Tenant namespaces: engine names and client names map both ways, ownership is by whole
// namespace, and errors are scrubbed of the namespace.
#include "service/auth.h"

#include <gtest/gtest.h>

namespace attnd {
namespace {

TEST(TenantTest, NamespacesCacheNames) {
  const Tenant alpha{"alpha", kUnlimitedPages};
  EXPECT_EQ(alpha.CacheKey("llama"), "alpha/llama");
  EXPECT_EQ(alpha.ClientName("alpha/llama"), "llama");
  EXPECT_TRUE(alpha.Owns("alpha/llama"));
  EXPECT_FALSE(alpha.Owns("alphabet/llama")) << "a prefix of another tenant's name";
  EXPECT_FALSE(alpha.Owns("beta/llama"));
  EXPECT_FALSE(alpha.Owns("alpha"));
  EXPECT_FALSE(alpha.Owns("llama"));
}

TEST(TenantTest, WithoutTenantsNamesAreAsSent) {
  const Tenant anonymous;
  EXPECT_EQ(anonymous.CacheKey("llama"), "llama");
  EXPECT_EQ(anonymous.ClientName("llama"), "llama");
  EXPECT_TRUE(anonymous.Owns("llama"));
  const absl::Status status = absl::NotFoundError("name: no cache named 'llama'");
  EXPECT_EQ(anonymous.Scrub(status), status);
}

TEST(TenantTest, ScrubsTheNamespaceFromQuotedNames) {
  const Tenant alpha{"alpha", kUnlimitedPages};
  const absl::Status scrubbed = alpha.Scrub(absl::ResourceExhaustedError(
      "entries: the step needs 3 new pages but cache 'alpha/llama' has 1 free of 2"));
  EXPECT_EQ(scrubbed.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(scrubbed.message(),
            "entries: the step needs 3 new pages but cache 'llama' has 1 free of 2");
  EXPECT_TRUE(alpha.Scrub(absl::OkStatus()).ok());
}

}  // namespace
}  // namespace attnd
