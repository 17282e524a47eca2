// Which client GPUs may open a CUDA_IPC channel (backend/peer_access.h): the refusals name
// client_pci_bus_id and point at HOST_SHM.
#include "backend/peer_access.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <map>
#include <set>
#include <utility>

namespace attnd {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

// Two GPUs with NVLink between them (0 <-> 1) and a third without peer access.
class FakeTopology final : public DeviceTopology {
 public:
  std::optional<int> OrdinalOf(const std::string& pci_bus_id) const override {
    auto it = ordinals_.find(pci_bus_id);
    if (it == ordinals_.end()) return std::nullopt;
    return it->second;
  }
  bool CanAccessPeer(int from, int to) const override { return peers_.count({from, to}) > 0; }

 private:
  std::map<std::string, int> ordinals_ = {
      {"0000:18:00.0", 0}, {"0000:2a:00.0", 1}, {"0000:3b:00.0", 2}};
  std::set<std::pair<int, int>> peers_ = {{0, 1}, {1, 0}};
};

TEST(NormalizePciBusIdTest, AcceptsTheFormsCudaAndNvidiaSmiWrite) {
  EXPECT_EQ(*NormalizePciBusId("0000:3B:00.0", "f"), "0000:3b:00.0");
  EXPECT_EQ(*NormalizePciBusId("3b:00.0", "f"), "0000:3b:00.0");
  EXPECT_EQ(*NormalizePciBusId("00000000:3B:00.0", "f"), "0000:3b:00.0");
  EXPECT_EQ(*NormalizePciBusId("1:3:0.1", "f"), "0001:03:00.1");
}

TEST(NormalizePciBusIdTest, RefusesAnythingElseNamingTheField) {
  for (const char* bad : {"", "gpu0", "3b:00", "0000:3b:00.0.1", "0000:3b:00:00.0", "zz:00.0",
                          "0000:3b:00.10", "0000:3b:00.", "0000:123:00.0", ":3b:00.0"}) {
    absl::StatusOr<std::string> normal = NormalizePciBusId(bad, "client_pci_bus_id");
    ASSERT_FALSE(normal.ok()) << bad;
    EXPECT_EQ(normal.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(normal.status().message(), HasSubstr("client_pci_bus_id")) << bad;
  }
}

TEST(CheckPeerAccessTest, TheRingsOwnGpuAndItsPeersReachIt) {
  const FakeTopology topology;
  EXPECT_TRUE(CheckPeerAccess("0000:18:00.0", 0, "0000:18:00.0", topology).ok());
  EXPECT_TRUE(CheckPeerAccess("0000:2a:00.0", 0, "0000:18:00.0", topology).ok());
}

TEST(CheckPeerAccessTest, AGpuWithoutPeerAccessIsRefusedTowardsHostShm) {
  const absl::Status refused = CheckPeerAccess("0000:3b:00.0", 0, "0000:18:00.0", FakeTopology());
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(refused.message(), AllOf(HasSubstr("client_pci_bus_id"), HasSubstr("0000:3b:00.0"),
                                       HasSubstr("peer access"), HasSubstr("HOST_SHM")));
}

TEST(CheckPeerAccessTest, AGpuAttndDoesNotSeeIsRefusedTowardsHostShm) {
  const absl::Status refused = CheckPeerAccess("0000:99:00.0", 0, "0000:18:00.0", FakeTopology());
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(refused.message(), AllOf(HasSubstr("client_pci_bus_id"), HasSubstr("not visible"),
                                       HasSubstr("HOST_SHM")));
}

}  // namespace
}  // namespace attnd
