#include "global_flags.h"

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>

#include "absl/flags/flag.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "attnd/status_macros.h"

ABSL_FLAG(std::string, server, "localhost:50051", "attnd address (host:port or a gRPC target)");
ABSL_FLAG(absl::Duration, timeout, absl::Seconds(30),
          "deadline of each RPC, e.g. 30s, 500ms ('inf' for none)");
ABSL_FLAG(bool, json, false, "print responses as JSON (info, stats, cache list/get/create)");

ABSL_FLAG(bool, tls, false,
          "connect over TLS, verifying the server against the system roots (implied by "
          "--tls_ca, --tls_cert and --tls_server_name)");
ABSL_FLAG(std::string, tls_ca, "", "PEM file of the CA that signed the server's certificate");
ABSL_FLAG(std::string, tls_cert, "",
          "PEM file of this client's certificate, for servers that require mutual TLS");
ABSL_FLAG(std::string, tls_key, "", "PEM file of --tls_cert's private key");
ABSL_FLAG(std::string, tls_server_name, "",
          "name to verify the server's certificate against instead of --server's host");
ABSL_FLAG(std::string, token, "",
          "bearer token for servers with --token_file (default: $ATTND_TOKEN); prefer "
          "--token_file or the variable, a flag shows in the process list");
ABSL_FLAG(std::string, token_file, "",
          "file holding the bearer token (its first line that is not empty or a # comment)");

ABSL_FLAG(bool, stream, false,
          "demo, bench: run steps over one ForwardStream instead of unary Plan/Forward/EndStep");
ABSL_FLAG(uint64_t, seed, 1, "demo, bench: seed of the random q/k/v");

namespace attnd::attnctl {
namespace {

absl::StatusOr<std::string> ReadFile(absl::string_view flag, const std::string& path) {
  std::ifstream file(path, std::ios::binary);
  if (!file) {
    return absl::InvalidArgumentError(
        absl::StrCat("--", flag, "=", path, ": cannot open: ", std::strerror(errno)));
  }
  std::ostringstream contents;
  contents << file.rdbuf();
  return contents.str();
}

absl::StatusOr<std::string> TokenFromFlags() {
  const std::string token = absl::GetFlag(FLAGS_token);
  const std::string token_file = absl::GetFlag(FLAGS_token_file);
  if (!token.empty() && !token_file.empty()) {
    return absl::InvalidArgumentError("--token and --token_file: give one");
  }
  if (!token.empty()) return token;
  if (!token_file.empty()) {
    ASSIGN_OR_RETURN(const std::string contents, ReadFile("token_file", token_file));
    for (absl::string_view line : absl::StrSplit(contents, '\n')) {
      line = absl::StripAsciiWhitespace(line);
      if (line.empty() || line.front() == '#') continue;
      return std::string(line);
    }
    return absl::InvalidArgumentError(
        absl::StrCat("--token_file=", token_file, ": holds no token"));
  }
  const char* from_environment = std::getenv("ATTND_TOKEN");
  return std::string(from_environment != nullptr ? from_environment : "");
}

absl::StatusOr<client::TlsOptions> TlsFromFlags() {
  client::TlsOptions tls;
  const std::string ca = absl::GetFlag(FLAGS_tls_ca);
  const std::string cert = absl::GetFlag(FLAGS_tls_cert);
  const std::string key = absl::GetFlag(FLAGS_tls_key);
  tls.server_name_override = absl::GetFlag(FLAGS_tls_server_name);
  tls.enabled = absl::GetFlag(FLAGS_tls) || !ca.empty() || !cert.empty() || !key.empty() ||
                !tls.server_name_override.empty();
  if (cert.empty() != key.empty()) {
    return absl::InvalidArgumentError("--tls_cert and --tls_key: give both or neither");
  }
  if (!ca.empty()) {
    ASSIGN_OR_RETURN(tls.root_certs_pem, ReadFile("tls_ca", ca));
  }
  if (!cert.empty()) {
    ASSIGN_OR_RETURN(tls.cert_chain_pem, ReadFile("tls_cert", cert));
    ASSIGN_OR_RETURN(tls.private_key_pem, ReadFile("tls_key", key));
  }
  return tls;
}

}  // namespace

absl::StatusOr<std::unique_ptr<client::Client>> ConnectFromFlags(const std::string& address) {
  client::ClientOptions options;
  options.address = address.empty() ? absl::GetFlag(FLAGS_server) : address;
  options.timeout = absl::GetFlag(FLAGS_timeout);
  ASSIGN_OR_RETURN(options.tls, TlsFromFlags());
  ASSIGN_OR_RETURN(options.bearer_token, TokenFromFlags());
  return client::Client::Connect(options);
}

}  // namespace attnd::attnctl
