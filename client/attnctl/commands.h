// attnctl's commands. Each takes the positional arguments after its name and returns the
// process exit code: 0 success, 1 failure (an RPC error, a failed check, not serving),
// 2 usage error.
#pragma once

#include <string>
#include <vector>

namespace attnd::attnctl {

using Args = std::vector<std::string>;

inline constexpr int kExitOk = 0;
inline constexpr int kExitFailure = 1;
inline constexpr int kExitUsage = 2;

int RunInfo(const Args& args);
int RunHealth(const Args& args);
int RunStats(const Args& args);
int RunCache(const Args& args);  // create | list | get | delete
int RunSeq(const Args& args);    // fork | free | export | import
int RunDemo(const Args& args);
int RunBench(const Args& args);

}  // namespace attnd::attnctl
