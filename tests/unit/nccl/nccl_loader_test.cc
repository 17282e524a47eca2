// The NCCL loader's refusals (attnd/nccl/nccl_loader.h): what GetServerInfo, OpenChannel and
// the client's Channel::Open say on a host without a usable libnccl.so.2.
#include "attnd/nccl/nccl_loader.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>

namespace attnd::nccl {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

TEST(NcclLibraryTest, AnAbsentLibraryIsAFailedPreconditionWithDlerror) {
  absl::StatusOr<std::unique_ptr<NcclLibrary>> loaded = NcclLibrary::Load("libnccl-absent.so.2");
  ASSERT_FALSE(loaded.ok());
  EXPECT_EQ(loaded.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(loaded.status().message()),
              StartsWith("NCCL is not available: libnccl-absent.so.2 did not load: "));
  // dlerror's own words follow (they name the file).
  EXPECT_THAT(std::string(loaded.status().message()), HasSubstr("libnccl-absent.so.2:"));
}

TEST(NcclLibraryTest, ALibraryWithoutNcclsSymbolsNamesTheFirstMissing) {
  absl::StatusOr<std::unique_ptr<NcclLibrary>> loaded = NcclLibrary::Load("libm.so.6");
  ASSERT_FALSE(loaded.ok());
  EXPECT_EQ(loaded.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(loaded.status().message()), HasSubstr("libm.so.6 has no ncclGetVersion"));
  EXPECT_THAT(std::string(loaded.status().message()), HasSubstr("NCCL 2.14 or later"));
}

TEST(NcclLibraryTest, TheSharedLibraryAnswersTheSameEveryTime) {
  const absl::StatusOr<const NcclLibrary*> first = NcclLibrary::Shared();
  const absl::StatusOr<const NcclLibrary*> second = NcclLibrary::Shared();
  ASSERT_EQ(first.ok(), second.ok());
  if (first.ok()) {
    EXPECT_EQ(*first, *second);
    EXPECT_GE((*first)->version(), 21400);
  } else {
    EXPECT_EQ(first.status(), second.status());
    EXPECT_THAT(std::string(first.status().message()), StartsWith("NCCL is not available: libnccl.so.2"));
  }
}

TEST(NcclLibraryTest, DeclaredTypesMatchNcclsAbi) {
  EXPECT_EQ(sizeof(ncclUniqueId), 128u);
  // ncclConfig_v21400: size_t, 2 x unsigned, 4 x int, a pointer.
  EXPECT_EQ(sizeof(ncclConfig_t), 40u);
  EXPECT_EQ(ncclConfig_t().magic, 0xcafebeefu);
}

}  // namespace
}  // namespace attnd::nccl
