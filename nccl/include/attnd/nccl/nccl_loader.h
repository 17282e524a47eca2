// NcclLibrary: libnccl.so.2 loaded at run time (issue 19). NCCL is not a Debian package, so
// neither the build nor CI may need it: the few types and functions NCCL channels use (attnd's
// side in server/backend/nccl_channel.cc, the client's in client/src/channel_nccl.cc) are
// declared here (their ABI is stable since NCCL 2.14; ncclConfig_t is versioned by its own
// size/magic/version header, so the 2.14 layout below is valid for every later library), and
// Load() resolves them with dlopen/dlsym. No CUDA header either: a stream is a cudaStream_t
// (struct CUstream_st*), declared as such.
//
// Thread-safety: a loaded NcclLibrary is immutable; NCCL's own rules apply to the calls.
#pragma once

#include <climits>
#include <cstddef>
#include <memory>
#include <string>

#include "absl/status/statusor.h"

struct CUstream_st;

namespace attnd::nccl {

// nccl.h's names, kept so a reader can match them against NCCL's documentation.
enum ncclResult_t : int {
  ncclSuccess = 0,
  ncclUnhandledCudaError = 1,
  ncclSystemError = 2,
  ncclInternalError = 3,
  ncclInvalidArgument = 4,
  ncclInvalidUsage = 5,
  ncclRemoteError = 6,
  ncclInProgress = 7,
};
enum ncclDataType_t : int { ncclUint8 = 1 };
struct ncclComm;
using ncclComm_t = ncclComm*;
inline constexpr size_t kUniqueIdBytes = 128;  // NCCL_UNIQUE_ID_BYTES
struct ncclUniqueId {
  char internal[kUniqueIdBytes];
};
// ncclConfig_t as of NCCL 2.14 (ncclConfig_v21400). Later libraries read only `size` bytes.
struct ncclConfig_t {
  size_t size = sizeof(ncclConfig_t);
  unsigned int magic = 0xcafebeef;
  unsigned int version = 21400;  // NCCL_VERSION(2, 14, 0)
  int blocking = INT_MIN;        // NCCL_CONFIG_UNDEF_INT: the library's default
  int cgaClusterSize = INT_MIN;
  int minCTAs = INT_MIN;
  int maxCTAs = INT_MIN;
  const char* netName = nullptr;
};

// The ranks of a CHANNEL_KIND_NCCL channel's communicator (attnd.proto): attnd creates it as
// rank 0 and hands out its id; the client joins as rank 1.
inline constexpr int kChannelRanks = 2;
inline constexpr int kAttndRank = 0;
inline constexpr int kClientRank = 1;

struct NcclApi {
  ncclResult_t (*GetVersion)(int* version);
  const char* (*GetErrorString)(ncclResult_t result);
  ncclResult_t (*GetUniqueId)(ncclUniqueId* id);
  ncclResult_t (*CommInitRank)(ncclComm_t* comm, int nranks, ncclUniqueId id, int rank);
  // With config.blocking = 0 it returns ncclInProgress at once (poll CommGetAsyncError) and
  // every later group call runs on a thread NCCL starts for it (~90 us of the host each,
  // measured): attnd's channels use blocking communicators (NcclChannel::Join).
  ncclResult_t (*CommInitRankConfig)(ncclComm_t* comm, int nranks, ncclUniqueId id, int rank,
                                     ncclConfig_t* config);
  ncclResult_t (*CommGetAsyncError)(ncclComm_t comm, ncclResult_t* async_error);
  ncclResult_t (*CommDestroy)(ncclComm_t comm);
  ncclResult_t (*CommAbort)(ncclComm_t comm);
  ncclResult_t (*Send)(const void* buffer, size_t count, ncclDataType_t type, int peer,
                       ncclComm_t comm, CUstream_st* stream);
  ncclResult_t (*Recv)(void* buffer, size_t count, ncclDataType_t type, int peer,
                       ncclComm_t comm, CUstream_st* stream);
  ncclResult_t (*GroupStart)();
  ncclResult_t (*GroupEnd)();
};

class NcclLibrary {
 public:
  static constexpr const char* kDefaultPath = "libnccl.so.2";

  // dlopen(path) and every symbol of NcclApi. FAILED_PRECONDITION "NCCL is not available:
  // <path> did not load: <dlerror>" when the library is absent, or "... has no <symbol>"
  // when it is older than 2.14.
  static absl::StatusOr<std::unique_ptr<NcclLibrary>> Load(const std::string& path = kDefaultPath);
  // The process-wide library, loaded once on first use; the same status every time.
  static absl::StatusOr<const NcclLibrary*> Shared();

  ~NcclLibrary();
  NcclLibrary(const NcclLibrary&) = delete;
  NcclLibrary& operator=(const NcclLibrary&) = delete;

  const NcclApi& api() const { return api_; }
  int version() const { return version_; }  // e.g. 22105 for 2.21.5
  // "ncclGroupEnd: unhandled system error (2)": `call` and the library's words for `result`.
  std::string Describe(const char* call, ncclResult_t result) const;

 private:
  NcclLibrary() = default;
  void* handle_ = nullptr;
  NcclApi api_{};
  int version_ = 0;
};

}  // namespace attnd::nccl
