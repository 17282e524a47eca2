#include "util/token_file.h"

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace attnd {
namespace {

constexpr size_t kMaxTenantNameBytes = 64;
constexpr size_t kMinTokenBytes = 16;
constexpr size_t kMaxTokenBytes = 4096;

bool ValidToken(absl::string_view token) {
  if (token.size() < kMinTokenBytes || token.size() > kMaxTokenBytes) return false;
  for (const char c : token) {
    if (c < 0x21 || c > 0x7e) return false;  // printable ASCII, no space
  }
  return true;
}

}  // namespace

bool ValidTenantName(absl::string_view name) {
  if (name.empty() || name.size() > kMaxTenantNameBytes) return false;
  for (const char c : name) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '.' || c == '_' || c == '-';
    if (!ok) return false;
  }
  return true;
}

absl::StatusOr<TokenTable> ParseTokenFile(absl::string_view contents, absl::string_view path,
                                          int64_t default_page_quota) {
  struct Line {
    std::string tenant;
    std::string token;
    bool has_quota = false;
    int64_t quota = kUnlimitedPages;
  };
  std::vector<Line> lines;
  // Per tenant: the explicit quota and the line it came from.
  absl::flat_hash_map<std::string, std::pair<int64_t, int>> explicit_quota;
  absl::flat_hash_map<std::string, int> token_line;

  int line_number = 0;
  for (absl::string_view text : absl::StrSplit(contents, '\n')) {
    ++line_number;
    const auto where = [&] { return absl::StrCat(path, ":", line_number, ": "); };
    if (const size_t hash = text.find('#'); hash != absl::string_view::npos) {
      text = text.substr(0, hash);
    }
    std::vector<absl::string_view> fields =
        absl::StrSplit(text, absl::ByAnyChar(" \t\r"), absl::SkipEmpty());
    if (fields.empty()) continue;
    if (fields.size() < 2 || fields.size() > 3) {
      return absl::InvalidArgumentError(absl::StrCat(
          where(), "expected TENANT TOKEN [PAGE_QUOTA], got ", fields.size(), " field(s)"));
    }
    Line line;
    line.tenant = std::string(fields[0]);
    line.token = std::string(fields[1]);
    if (!ValidTenantName(line.tenant)) {
      return absl::InvalidArgumentError(absl::StrCat(
          where(), "tenant: expected 1..", kMaxTenantNameBytes,
          " characters of [A-Za-z0-9._-], got '", absl::CHexEscape(line.tenant), "'"));
    }
    // The token itself never goes into a message.
    if (!ValidToken(line.token)) {
      const bool size_ok =
          line.token.size() >= kMinTokenBytes && line.token.size() <= kMaxTokenBytes;
      return absl::InvalidArgumentError(absl::StrCat(
          where(), "token of tenant '", line.tenant, "': expected ", kMinTokenBytes, "..",
          kMaxTokenBytes, " printable ASCII characters, got ",
          size_ok ? "an unprintable one" : absl::StrCat(line.token.size(), " character(s)")));
    }
    if (fields.size() == 3) {
      line.has_quota = true;
      if (fields[2] == "unlimited") {
        line.quota = kUnlimitedPages;
      } else if (!absl::SimpleAtoi(fields[2], &line.quota) || line.quota < 1) {
        return absl::InvalidArgumentError(absl::StrCat(
            where(), "page quota of tenant '", line.tenant,
            "': expected a page count >= 1 or 'unlimited', got '",
            absl::CHexEscape(fields[2]), "'"));
      }
      auto [it, inserted] =
          explicit_quota.emplace(line.tenant, std::make_pair(line.quota, line_number));
      if (!inserted && it->second.first != line.quota) {
        return absl::InvalidArgumentError(
            absl::StrCat(where(), "page quota of tenant '", line.tenant, "' differs from line ",
                         it->second.second, "'s; give every token of a tenant the same quota"));
      }
    }
    auto [it, inserted] = token_line.emplace(line.token, line_number);
    if (!inserted) {
      return absl::InvalidArgumentError(
          absl::StrCat(where(), "token of tenant '", line.tenant, "' repeats line ", it->second,
                       "'s; a token belongs to one tenant"));
    }
    lines.push_back(std::move(line));
  }

  TokenTable table;
  absl::flat_hash_map<std::string, bool> tenants;
  for (Line& line : lines) {
    TokenEntry entry;
    entry.tenant = std::move(line.tenant);
    entry.token = std::move(line.token);
    const auto quota = explicit_quota.find(entry.tenant);
    entry.page_quota = quota != explicit_quota.end() ? quota->second.first : default_page_quota;
    tenants.emplace(entry.tenant, true);
    table.entries.push_back(std::move(entry));
  }
  table.num_tenants = static_cast<int>(tenants.size());
  return table;
}

absl::StatusOr<TokenTable> ReadTokenFile(const std::string& path, int64_t default_page_quota) {
  std::ifstream file(path, std::ios::binary);
  if (!file) {
    return absl::NotFoundError(
        absl::StrCat("--token_file=", path, ": cannot open: ", std::strerror(errno)));
  }
  std::ostringstream contents;
  contents << file.rdbuf();
  if (file.bad()) {
    return absl::DataLossError(absl::StrCat("--token_file=", path, ": cannot read"));
  }
  return ParseTokenFile(contents.str(), path, default_page_quota);
}

}  // namespace attnd
