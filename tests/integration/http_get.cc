#include "http_get.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace attnd::integration {

absl::StatusOr<std::string> HttpGet(int port, const std::string& path) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return absl::InternalError(absl::StrCat("socket: ", std::strerror(errno)));
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(static_cast<uint16_t>(port));
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  timeval timeout{5, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof timeout);
  if (connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof address) != 0) {
    const int error = errno;
    close(fd);
    return absl::UnavailableError(absl::StrCat("connect to port ", port, ": ",
                                               std::strerror(error)));
  }
  const std::string request =
      absl::StrCat("GET ", path, " HTTP/1.0\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n");
  if (send(fd, request.data(), request.size(), 0) != static_cast<ssize_t>(request.size())) {
    close(fd);
    return absl::UnavailableError("send failed");
  }
  std::string response;
  char buffer[16384];
  for (;;) {
    const ssize_t n = recv(fd, buffer, sizeof buffer, 0);
    if (n <= 0) break;
    response.append(buffer, static_cast<size_t>(n));
  }
  close(fd);
  const size_t header_end = response.find("\r\n\r\n");
  if (header_end == std::string::npos) {
    return absl::UnavailableError(absl::StrCat("no HTTP response (", response.size(), " bytes)"));
  }
  const std::string status_line = response.substr(0, response.find("\r\n"));
  if (status_line.find(" 200") == std::string::npos) {
    return absl::UnavailableError(absl::StrCat("HTTP status: ", status_line));
  }
  return response.substr(header_end + 4);
}

double MetricSample(const std::string& exposition, const std::string& name,
                    const std::vector<std::string>& labels) {
  double total = -1;
  std::istringstream lines(exposition);
  std::string line;
  while (std::getline(lines, line)) {
    if (line.empty() || line[0] == '#') continue;
    const size_t name_end = line.find_first_of("{ ");
    if (name_end == std::string::npos || line.compare(0, name_end, name) != 0 ||
        name_end != name.size()) {
      continue;
    }
    const std::string lower_line = absl::AsciiStrToLower(line);
    bool matches = true;
    for (const std::string& label : labels) {
      matches = matches && lower_line.find(absl::AsciiStrToLower(label)) != std::string::npos;
    }
    if (!matches) continue;
    double value = 0;
    if (!absl::SimpleAtod(line.substr(line.rfind(' ') + 1), &value)) continue;
    total = (total < 0 ? 0 : total) + value;
  }
  return total;
}

}  // namespace attnd::integration
