#include "attnd/nccl/nccl_loader.h"

#include <dlfcn.h>

#include "absl/strings/str_cat.h"

namespace attnd::nccl {
namespace {

template <typename Function>
bool Resolve(void* handle, const char* name, Function*& function, std::string& missing) {
  function = reinterpret_cast<Function*>(dlsym(handle, name));
  if (function == nullptr && missing.empty()) missing = name;
  return function != nullptr;
}

}  // namespace

absl::StatusOr<std::unique_ptr<NcclLibrary>> NcclLibrary::Load(const std::string& path) {
  // RTLD_LOCAL: NCCL's symbols stay out of the global namespace (a client library linked
  // into the same process may bring its own NCCL).
  void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    const char* error = dlerror();
    return absl::FailedPreconditionError(absl::StrCat("NCCL is not available: ", path,
                                                      " did not load: ",
                                                      error != nullptr ? error : "(no dlerror)"));
  }
  std::unique_ptr<NcclLibrary> library(new NcclLibrary());
  library->handle_ = handle;
  NcclApi& api = library->api_;
  std::string missing;
  Resolve(handle, "ncclGetVersion", api.GetVersion, missing);
  Resolve(handle, "ncclGetErrorString", api.GetErrorString, missing);
  Resolve(handle, "ncclGetUniqueId", api.GetUniqueId, missing);
  Resolve(handle, "ncclCommInitRank", api.CommInitRank, missing);
  Resolve(handle, "ncclCommInitRankConfig", api.CommInitRankConfig, missing);
  Resolve(handle, "ncclCommGetAsyncError", api.CommGetAsyncError, missing);
  Resolve(handle, "ncclCommDestroy", api.CommDestroy, missing);
  Resolve(handle, "ncclCommAbort", api.CommAbort, missing);
  Resolve(handle, "ncclSend", api.Send, missing);
  Resolve(handle, "ncclRecv", api.Recv, missing);
  Resolve(handle, "ncclGroupStart", api.GroupStart, missing);
  Resolve(handle, "ncclGroupEnd", api.GroupEnd, missing);
  if (!missing.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "NCCL is not available: ", path, " has no ", missing, " (attnd needs NCCL 2.14 or later)"));
  }
  if (api.GetVersion(&library->version_) != ncclSuccess || library->version_ < 21400) {
    return absl::FailedPreconditionError(absl::StrCat(
        "NCCL is not available: ", path, " is version ", library->version_,
        " (attnd needs NCCL 2.14 or later)"));
  }
  return library;
}

absl::StatusOr<const NcclLibrary*> NcclLibrary::Shared() {
  // Never unloaded: communicators may outlive any owner but the process.
  static const absl::StatusOr<std::unique_ptr<NcclLibrary>>* const loaded =
      new absl::StatusOr<std::unique_ptr<NcclLibrary>>(Load());
  if (!loaded->ok()) return loaded->status();
  return loaded->value().get();
}

NcclLibrary::~NcclLibrary() {
  if (handle_ != nullptr) dlclose(handle_);
}

std::string NcclLibrary::Describe(const char* call, ncclResult_t result) const {
  const char* words = api_.GetErrorString != nullptr ? api_.GetErrorString(result) : nullptr;
  return absl::StrCat(call, ": ", words != nullptr ? words : "NCCL error", " (",
                      static_cast<int>(result), ")");
}

}  // namespace attnd::nccl
