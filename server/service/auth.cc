#include "service/auth.h"

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "attnd/status_macros.h"

namespace attnd {
namespace {

constexpr char kSeparator = '/';
constexpr absl::string_view kBearer = "bearer ";

// Compares in time that depends on the lengths only, so a caller cannot find a token's
// prefix by timing failed attempts.
bool ConstantTimeEquals(absl::string_view presented, absl::string_view known) {
  if (known.empty()) return false;
  unsigned char difference = presented.size() == known.size() ? 0 : 1;
  for (size_t i = 0; i < presented.size(); ++i) {
    difference |= static_cast<unsigned char>(presented[i] ^ known[i % known.size()]);
  }
  return difference == 0;
}

absl::Status Unauthenticated(absl::string_view why) {
  return absl::UnauthenticatedError(absl::StrCat("authorization: ", why));
}

}  // namespace

std::string Tenant::CacheKey(absl::string_view cache) const {
  if (name.empty()) return std::string(cache);
  return absl::StrCat(name, absl::string_view(&kSeparator, 1), cache);
}

bool Tenant::Owns(absl::string_view key) const {
  if (name.empty()) return true;
  return key.size() > name.size() && key[name.size()] == kSeparator &&
         absl::StartsWith(key, name);
}

std::string Tenant::ClientName(absl::string_view key) const {
  if (name.empty() || !Owns(key)) return std::string(key);
  return std::string(key.substr(name.size() + 1));
}

absl::Status Tenant::Scrub(const absl::Status& status) const {
  if (status.ok() || name.empty()) return status;
  const std::string quoted_prefix = absl::StrCat("'", name, absl::string_view(&kSeparator, 1));
  if (!absl::StrContains(status.message(), quoted_prefix)) return status;
  return absl::Status(status.code(),
                      absl::StrReplaceAll(status.message(), {{quoted_prefix, "'"}}));
}

absl::StatusOr<std::unique_ptr<Authenticator>> Authenticator::Create(const AuthOptions& options) {
  std::unique_ptr<Authenticator> authenticator(new Authenticator(options));
  if (authenticator->enabled()) {
    RETURN_IF_ERROR(authenticator->Reload().status());
  }
  return authenticator;
}

absl::StatusOr<Authenticator::Counts> Authenticator::Reload() {
  if (!enabled()) return absl::FailedPreconditionError("no --token_file to reload");
  ASSIGN_OR_RETURN(TokenTable table,
                   ReadTokenFile(options_.token_file, options_.default_page_quota));
  const Counts counts{static_cast<int>(table.entries.size()), table.num_tenants};
  auto shared = std::make_shared<const TokenTable>(std::move(table));
  absl::MutexLock lock(&mu_);
  table_ = std::move(shared);
  return counts;
}

Authenticator::Counts Authenticator::counts() const {
  absl::MutexLock lock(&mu_);
  if (table_ == nullptr) return Counts{};
  return Counts{static_cast<int>(table_->entries.size()), table_->num_tenants};
}

std::string Authenticator::PresentedToken(const grpc::ServerContextBase& ctx) {
  const auto& metadata = ctx.client_metadata();
  const auto it = metadata.find("authorization");
  if (it == metadata.end()) return "";
  const absl::string_view value(it->second.data(), it->second.size());
  // RFC 7235: the scheme is case-insensitive.
  if (value.size() <= kBearer.size() ||
      !absl::EqualsIgnoreCase(value.substr(0, kBearer.size()), kBearer)) {
    return "";
  }
  return std::string(absl::StripAsciiWhitespace(value.substr(kBearer.size())));
}

absl::StatusOr<Tenant> Authenticator::Authenticate(const grpc::ServerContextBase& ctx) const {
  if (!enabled()) return Tenant{};
  const std::string token = PresentedToken(ctx);
  if (token.empty()) {
    return Unauthenticated("expected metadata 'authorization: Bearer <token>'");
  }
  return AuthenticateToken(token);
}

absl::StatusOr<Tenant> Authenticator::AuthenticateToken(absl::string_view token) const {
  if (!enabled()) return Tenant{};
  std::shared_ptr<const TokenTable> table;
  {
    absl::MutexLock lock(&mu_);
    table = table_;
  }
  // Every entry is compared, match or not: the time does not tell which line matched.
  const TokenEntry* match = nullptr;
  for (const TokenEntry& entry : table->entries) {
    if (ConstantTimeEquals(token, entry.token) && match == nullptr) match = &entry;
  }
  if (match == nullptr || token.empty()) return Unauthenticated("unknown or revoked token");
  return Tenant{match->tenant, match->page_quota};
}

}  // namespace attnd
