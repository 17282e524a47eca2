// A minimal HTTP/1.0 GET over a loopback socket, enough to scrape /metrics in tests.
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace attnd::integration {

// GETs http://127.0.0.1:<port><path>; returns the body of a 200 response.
absl::StatusOr<std::string> HttpGet(int port, const std::string& path);

// Sum of the samples of `name` in a Prometheus text exposition whose label set contains every
// one of `labels` (e.g. {"phase=\"prefill\""}); -1 when there is no such sample. Label values
// compare case-insensitively (a status code may be exported as "OK" or "ok").
double MetricSample(const std::string& exposition, const std::string& name,
                    const std::vector<std::string>& labels = {});

}  // namespace attnd::integration
