// A minimal HTTP/1.0 GET over a loopback socket, enough to scrape /metrics in tests.
#pragma once

#include <string>

#include "absl/status/statusor.h"

namespace attnd::integration {

// GETs http://127.0.0.1:<port><path>; returns the body of a 200 response.
absl::StatusOr<std::string> HttpGet(int port, const std::string& path);

}  // namespace attnd::integration
