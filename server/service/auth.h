// Who a call comes from. With a token file (--token_file) every AttentionService call carries
// "authorization: Bearer <token>" metadata and the token names a tenant; without one, every
// call is the anonymous tenant "" and nothing is checked. The health and reflection services
// never ask.
//
// Tenants are namespaces: the engine stores tenant "a"'s cache "llama" as "a/llama" (neither
// a tenant nor a cache name can contain '/'), so another tenant's cache is simply not found
// and two tenants may use one name. Everything a client sees speaks its own names: Tenant
// maps names both ways and scrubs the namespace out of error messages.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include <grpcpp/server_context.h>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "util/token_file.h"

namespace attnd {

struct Tenant {
  std::string name;  // "" when the server has no token file
  int64_t page_quota = kUnlimitedPages;

  // The engine's name of this tenant's cache `cache`.
  std::string CacheKey(absl::string_view cache) const;
  // Whether the engine's cache name `key` is one of this tenant's.
  bool Owns(absl::string_view key) const;
  // The client's name of an engine cache name this tenant owns.
  std::string ClientName(absl::string_view key) const;
  // `status` with this tenant's namespace removed from the cache names in its message (the
  // engine quotes every cache name it mentions: 'a/llama' -> 'llama').
  absl::Status Scrub(const absl::Status& status) const;
};

struct AuthOptions {
  std::string token_file;  // "" disables authentication
  // Quota of tenants whose line has no quota column (kUnlimitedPages: none).
  int64_t default_page_quota = kUnlimitedPages;
};

// Thread-safe: Reload may run while calls authenticate; a call sees the old or the new tokens.
class Authenticator {
 public:
  // Reads the token file (when set); fails when it cannot be read or parsed.
  static absl::StatusOr<std::unique_ptr<Authenticator>> Create(const AuthOptions& options);

  bool enabled() const { return !options_.token_file.empty(); }
  const std::string& token_file() const { return options_.token_file; }

  // Re-reads the token file. On error the current tokens stay in force. Returns the new
  // table's size for the log.
  struct Counts {
    int tokens = 0;
    int tenants = 0;
  };
  absl::StatusOr<Counts> Reload();
  Counts counts() const;

  // The tenant of a call, from its metadata: UNAUTHENTICATED when the token is missing,
  // malformed or unknown (the message never says more, nor echoes the token).
  absl::StatusOr<Tenant> Authenticate(const grpc::ServerContextBase& ctx) const;
  // The token a call presented ("" when none), for callers that re-check it later (streams).
  static std::string PresentedToken(const grpc::ServerContextBase& ctx);
  absl::StatusOr<Tenant> AuthenticateToken(absl::string_view token) const;

 private:
  explicit Authenticator(const AuthOptions& options) : options_(options) {}

  const AuthOptions options_;
  mutable absl::Mutex mu_;
  std::shared_ptr<const TokenTable> table_ ABSL_GUARDED_BY(mu_);
};

}  // namespace attnd
