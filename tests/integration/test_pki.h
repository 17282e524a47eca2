// Throwaway certificates for the trust tests, made with the openssl CLI at test time (nothing
// secret is committed): a CA, a server certificate for localhost/127.0.0.1, one for the name
// "attnd.test" only, a client certificate, and a second CA with its own client certificate
// that the server must refuse. EC P-256 keys, valid for a day.
#pragma once

#include <string>

#include "absl/status/statusor.h"

namespace attnd::integration {

struct TestPki {
  std::string dir;  // where the files are

  std::string ca_file;  // PEM
  std::string ca_pem;
  std::string server_cert_file;  // SAN DNS:localhost, IP:127.0.0.1
  std::string server_key_file;
  std::string named_server_cert_file;  // SAN DNS:attnd.test only
  std::string named_server_key_file;
  std::string client_cert_pem;  // signed by the CA
  std::string client_key_pem;
  std::string other_ca_pem;  // an unrelated CA
  std::string rogue_client_cert_pem;  // signed by the unrelated CA
  std::string rogue_client_key_pem;
};

// Made once per process, on first use. Fails (with openssl's output) when openssl is missing
// or refuses; scripts/install-deps.sh installs it.
absl::StatusOr<const TestPki*> GetTestPki();

// Writes `contents` to a new file in a per-process temporary directory and returns its path.
std::string WriteTempFile(const std::string& name, const std::string& contents);

}  // namespace attnd::integration
