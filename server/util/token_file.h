// The bearer-token file (--token_file): which token belongs to which tenant, and each tenant's
// page quota. One token per line:
//
//   # comment (also after a line's fields)
//   TENANT TOKEN [PAGE_QUOTA]
//
// TENANT is 1..64 of [A-Za-z0-9._-]; TOKEN is 16..4096 printable ASCII characters without
// spaces or '#'; PAGE_QUOTA is a page count >= 1 or "unlimited", and when absent the default
// quota (--tenant_page_quota) applies. A tenant may have several tokens (rotation), all with
// the same quota; a token belongs to one tenant.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace attnd {

inline constexpr int64_t kUnlimitedPages = 0;

struct TokenEntry {
  std::string tenant;
  std::string token;
  int64_t page_quota = kUnlimitedPages;  // resolved: the line's, the tenant's, or the default
};

struct TokenTable {
  std::vector<TokenEntry> entries;  // in file order
  int num_tenants = 0;
};

// Parses a token file's text. Errors name `path` and the line ("tokens.txt:3: ...") and never
// contain a token. `default_page_quota` applies to tenants with no quota column
// (kUnlimitedPages: none).
absl::StatusOr<TokenTable> ParseTokenFile(absl::string_view contents, absl::string_view path,
                                          int64_t default_page_quota);

// Reads and parses the file at `path`.
absl::StatusOr<TokenTable> ReadTokenFile(const std::string& path, int64_t default_page_quota);

// True when a tenant name is usable (also as the cache-name namespace: it has no '/').
bool ValidTenantName(absl::string_view name);

}  // namespace attnd
