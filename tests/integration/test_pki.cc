#include "test_pki.h"

#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>

#include <filesystem>
#include <fstream>
#include <memory>
#include <mutex>
#include <sstream>

#include "absl/strings/str_cat.h"

namespace attnd::integration {
namespace {

const std::string& TempDir() {
  static const std::string* dir = [] {
    std::string pattern = "/tmp/attnd-trust-XXXXXX";
    if (mkdtemp(pattern.data()) == nullptr) return new std::string("/tmp");
    atexit([] {
      std::error_code ignored;
      std::filesystem::remove_all(TempDir(), ignored);
    });
    return new std::string(pattern);
  }();
  return *dir;
}

absl::Status Run(const std::string& command) {
  const std::string full = absl::StrCat(command, " 2>&1");
  FILE* pipe = popen(full.c_str(), "r");
  if (pipe == nullptr) return absl::InternalError(absl::StrCat("cannot run: ", command));
  std::string output;
  char buffer[512];
  while (size_t n = fread(buffer, 1, sizeof(buffer), pipe)) output.append(buffer, n);
  const int status = pclose(pipe);
  if (status != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("`", command, "` failed (exit ", WEXITSTATUS(status), "): ", output));
  }
  return absl::OkStatus();
}

std::string ReadFile(const std::string& path) {
  std::ifstream file(path, std::ios::binary);
  std::ostringstream contents;
  contents << file.rdbuf();
  return contents.str();
}

absl::Status MakePki(TestPki& pki) {
  pki.dir = TempDir();
  const std::string& d = pki.dir;
  const std::string ec = "-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes";
  auto self_signed_ca = [&](const std::string& name) {
    return Run(absl::StrCat("openssl req -x509 ", ec, " -keyout ", d, "/", name, ".key -out ", d,
                            "/", name, ".pem -days 1 -subj '/CN=attnd test ", name, "'"));
  };
  // Key and CSR for `name`, signed by `ca` with the extensions in `extensions`.
  auto leaf = [&](const std::string& name, const std::string& ca, const std::string& extensions) {
    const std::string ext_file = absl::StrCat(d, "/", name, ".ext");
    std::ofstream(ext_file) << extensions << "\n";
    if (absl::Status s = Run(absl::StrCat("openssl req ", ec, " -keyout ", d, "/", name,
                                          ".key -out ", d, "/", name, ".csr -subj '/CN=", name,
                                          "'"));
        !s.ok()) {
      return s;
    }
    return Run(absl::StrCat("openssl x509 -req -in ", d, "/", name, ".csr -CA ", d, "/", ca,
                            ".pem -CAkey ", d, "/", ca, ".key -CAcreateserial -out ", d, "/",
                            name, ".pem -days 1 -extfile ", ext_file));
  };
  for (const absl::Status& status : {
           self_signed_ca("ca"),
           self_signed_ca("other-ca"),
           leaf("server", "ca",
                "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth"),
           leaf("named-server", "ca", "subjectAltName=DNS:attnd.test\nextendedKeyUsage=serverAuth"),
           leaf("client", "ca", "extendedKeyUsage=clientAuth"),
           leaf("rogue-client", "other-ca", "extendedKeyUsage=clientAuth"),
       }) {
    if (!status.ok()) return status;
  }
  pki.ca_file = d + "/ca.pem";
  pki.ca_pem = ReadFile(pki.ca_file);
  pki.server_cert_file = d + "/server.pem";
  pki.server_key_file = d + "/server.key";
  pki.named_server_cert_file = d + "/named-server.pem";
  pki.named_server_key_file = d + "/named-server.key";
  pki.client_cert_pem = ReadFile(d + "/client.pem");
  pki.client_key_pem = ReadFile(d + "/client.key");
  pki.other_ca_pem = ReadFile(d + "/other-ca.pem");
  pki.rogue_client_cert_pem = ReadFile(d + "/rogue-client.pem");
  pki.rogue_client_key_pem = ReadFile(d + "/rogue-client.key");
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<const TestPki*> GetTestPki() {
  static std::once_flag once;
  static TestPki* pki = nullptr;
  static absl::Status status;
  std::call_once(once, [] {
    auto made = std::make_unique<TestPki>();
    status = MakePki(*made);
    if (status.ok()) pki = made.release();
  });
  if (!status.ok()) return status;
  return pki;
}

std::string WriteTempFile(const std::string& name, const std::string& contents) {
  const std::string path = absl::StrCat(TempDir(), "/", name);
  std::ofstream(path, std::ios::binary | std::ios::trunc) << contents;
  return path;
}

}  // namespace attnd::integration
