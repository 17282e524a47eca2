// Minimal timestamped logging to stderr (our Abseil predates absl/log).
#pragma once

#include <string_view>

namespace attnd {

void LogInfo(std::string_view message);
void LogError(std::string_view message);

}  // namespace attnd
