// attnd's flags as the built binary reads them (server/main.cc): values it refuses before
// starting (exit 2, naming the flag), and that an accepted one lets it serve.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "absl/time/time.h"
#include "daemon_process.h"

#ifndef ATTND_BINARY
#error "ATTND_BINARY: the path of the attnd executable"
#endif

namespace attnd::integration {
namespace {

using ::testing::HasSubstr;

std::vector<std::string> CpuFlags(std::vector<std::string> more) {
  std::vector<std::string> flags = {"--backend=cpu", "--kv-memory-bytes=16777216",
                                    "--listen-address=127.0.0.1:0", "--metrics-address=",
                                    "--drain-grace=200ms", "--exit-grace=500ms"};
  flags.insert(flags.end(), more.begin(), more.end());
  return flags;
}

TEST(AttndFlagsTest, ANcclInitTimeoutThatIsNotPositiveIsRefused) {
  for (const std::string value : {"0s", "-5s"}) {
    Daemon daemon(ATTND_BINARY, CpuFlags({"--nccl_init_timeout=" + value}));
    ASSERT_GT(daemon.pid(), 0);
    EXPECT_EQ(daemon.Wait(absl::Seconds(30)), 2) << daemon.log();
    EXPECT_THAT(daemon.log(), HasSubstr("--nccl_init_timeout: expected > 0")) << value;
  }
}

TEST(AttndFlagsTest, ANcclInitTimeoutIsADurationAndDashesWork) {
  Daemon daemon(ATTND_BINARY, CpuFlags({"--nccl-init-timeout=5s"}));
  ASSERT_GT(daemon.pid(), 0);
  EXPECT_FALSE(daemon.AwaitLog("serving attnd.v1.AttentionService", absl::Seconds(30)).empty())
      << daemon.log();
  Daemon malformed(ATTND_BINARY, CpuFlags({"--nccl_init_timeout=soon"}));
  EXPECT_NE(malformed.Wait(absl::Seconds(30)), 0) << malformed.log();
  EXPECT_THAT(malformed.log(), HasSubstr("nccl_init_timeout")) << malformed.log();
}

}  // namespace
}  // namespace attnd::integration
