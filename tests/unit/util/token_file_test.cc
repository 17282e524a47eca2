// The token file: what it accepts, what it refuses (naming the line, never the token), and
// how quotas resolve.
#include "util/token_file.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace attnd {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

constexpr int64_t kDefaultQuota = 500;

absl::StatusOr<TokenTable> Parse(absl::string_view contents) {
  return ParseTokenFile(contents, "tokens.txt", kDefaultQuota);
}

TEST(TokenFileTest, ReadsTenantsTokensQuotasAndComments) {
  auto table = Parse(
      "# operators' file\n"
      "\n"
      "alpha   alpha-token-0123456789   # no quota: the default\n"
      "beta\tbeta-token-0123456789\t1000\r\n"
      "beta beta-rotated-0123456789\n"
      "gamma gamma-token-0123456789 unlimited\n");
  ASSERT_TRUE(table.ok()) << table.status();
  ASSERT_EQ(table->entries.size(), 4u);
  EXPECT_EQ(table->num_tenants, 3);
  EXPECT_EQ(table->entries[0].tenant, "alpha");
  EXPECT_EQ(table->entries[0].token, "alpha-token-0123456789");
  EXPECT_EQ(table->entries[0].page_quota, kDefaultQuota);
  EXPECT_EQ(table->entries[1].page_quota, 1000);
  EXPECT_EQ(table->entries[2].page_quota, 1000) << "a tenant's quota holds for all its tokens";
  EXPECT_EQ(table->entries[3].page_quota, kUnlimitedPages);
}

TEST(TokenFileTest, AnEmptyFileHasNoTokens) {
  auto table = Parse("# nobody yet\n");
  ASSERT_TRUE(table.ok()) << table.status();
  EXPECT_TRUE(table->entries.empty());
}

TEST(TokenFileTest, RefusesBadLinesNamingTheLineAndNeverTheToken) {
  struct Case {
    const char* contents;
    const char* expected;
  };
  for (const Case& c : {
           Case{"alpha\n", "tokens.txt:1: expected TENANT TOKEN [PAGE_QUOTA], got 1"},
           Case{"a b c d\n", "got 4 field(s)"},
           Case{"\nal/pha alpha-token-0123456789\n", "tokens.txt:2: tenant"},
           Case{"alpha short-secret\n", "expected 16..4096 printable ASCII characters, got 12"},
           Case{"alpha alpha-token-\x01\x02-0123456789\n", "an unprintable one"},
           Case{"alpha alpha-token-0123456789 0\n", "page quota of tenant 'alpha'"},
           Case{"alpha alpha-token-0123456789 lots\n", "a page count >= 1 or 'unlimited'"},
           Case{"alpha alpha-token-0123456789 10\nalpha alpha-second-0123456789 20\n",
                "tokens.txt:2: page quota of tenant 'alpha' differs from line 1's"},
           Case{"alpha alpha-token-0123456789\nbeta alpha-token-0123456789\n",
                "tokens.txt:2: token of tenant 'beta' repeats line 1's"},
       }) {
    auto table = Parse(c.contents);
    ASSERT_FALSE(table.ok()) << c.contents;
    EXPECT_EQ(table.status().code(), absl::StatusCode::kInvalidArgument);
    const std::string message(table.status().message());
    EXPECT_THAT(message, HasSubstr(c.expected)) << c.contents;
    EXPECT_THAT(message, Not(HasSubstr("0123456789"))) << "a token leaked into: " << message;
    EXPECT_THAT(message, Not(HasSubstr("short-secret"))) << message;
  }
}

TEST(TokenFileTest, ReadingAMissingFileNamesTheFlag) {
  auto table = ReadTokenFile("/nonexistent/tokens.txt", kDefaultQuota);
  ASSERT_FALSE(table.ok());
  EXPECT_THAT(std::string(table.status().message()),
              HasSubstr("--token_file=/nonexistent/tokens.txt: cannot open"));
}

TEST(TokenFileTest, TenantNamesCannotContainTheNamespaceSeparator) {
  EXPECT_TRUE(ValidTenantName("team-a.prod_1"));
  EXPECT_FALSE(ValidTenantName(""));
  EXPECT_FALSE(ValidTenantName("a/b"));
  EXPECT_FALSE(ValidTenantName("a b"));
  EXPECT_FALSE(ValidTenantName(std::string(65, 'a')));
}

}  // namespace
}  // namespace attnd
