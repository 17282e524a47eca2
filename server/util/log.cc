#include "util/log.h"

#include <cstdio>
#include <string>

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace attnd {
namespace {

void Log(char level, std::string_view message) {
  const std::string time =
      absl::FormatTime("%Y-%m-%dT%H:%M:%E3SZ", absl::Now(), absl::UTCTimeZone());
  std::fprintf(stderr, "%c %s attnd: %.*s\n", level, time.c_str(),
               static_cast<int>(message.size()), message.data());
}

}  // namespace

void LogInfo(std::string_view message) { Log('I', message); }
void LogError(std::string_view message) { Log('E', message); }

}  // namespace attnd
