// attnctl cache create | list | get | delete.
#include <string>

#include "absl/flags/flag.h"
#include "absl/strings/str_format.h"
#include "cache_flags.h"
#include "commands.h"
#include "global_flags.h"
#include "printing.h"

ABSL_FLAG(bool, force, false, "cache delete: delete even with open steps (they are aborted)");

namespace attnd::attnctl {
namespace {

constexpr char kUsage[] =
    "usage: attnctl cache create NAME [--layers=N --qo_heads=N --kv_heads=N --head_dim=D\n"
    "                                  --page_size=P --q_dtype=bf16|fp16 --kv_dtype=bf16|fp16|fp8\n"
    "                                  --num_pages=N | --memory_bytes=SIZE --layout=nhd|hnd\n"
    "                                  --rope=none|neox|interleaved --rope_theta=T ...]\n"
    "       attnctl cache list\n"
    "       attnctl cache get NAME\n"
    "       attnctl cache delete NAME [--force]\n";

int Usage() {
  absl::FPrintF(stderr, "%s", kUsage);
  return kExitUsage;
}

int Create(client::Client& client, const std::string& name) {
  auto config = CacheConfigFromFlags(CacheShapeDefaults{});
  if (!config.ok()) {
    PrintError("cache create", config.status());
    return kExitUsage;
  }
  auto cache = client.CreateCache(name, *config);
  if (!cache.ok()) {
    PrintError(absl::StrFormat("cache create '%s'", name), cache.status());
    return kExitFailure;
  }
  if (absl::GetFlag(FLAGS_json)) {
    PrintJson(*cache);
  } else {
    PrintCacheInfo(*cache);
  }
  return kExitOk;
}

int List(client::Client& client) {
  auto caches = client.ListCaches();
  if (!caches.ok()) {
    PrintError("cache list", caches.status());
    return kExitFailure;
  }
  if (absl::GetFlag(FLAGS_json)) {
    attnd::v1::ListCachesResponse response;
    for (auto& cache : *caches) *response.add_caches() = std::move(cache);
    PrintJson(response);
  } else {
    PrintCacheTable(*caches);
  }
  return kExitOk;
}

int Get(client::Client& client, const std::string& name) {
  auto cache = client.GetCache(name);
  if (!cache.ok()) {
    PrintError(absl::StrFormat("cache get '%s'", name), cache.status());
    return kExitFailure;
  }
  if (absl::GetFlag(FLAGS_json)) {
    PrintJson(*cache);
  } else {
    PrintCacheInfo(*cache);
  }
  return kExitOk;
}

int Delete(client::Client& client, const std::string& name) {
  absl::Status status = client.DeleteCache(name, absl::GetFlag(FLAGS_force));
  if (!status.ok()) {
    PrintError(absl::StrFormat("cache delete '%s'", name), status);
    return kExitFailure;
  }
  absl::PrintF("deleted cache %s\n", name);
  return kExitOk;
}

}  // namespace

int RunCache(const Args& args) {
  if (args.empty()) return Usage();
  const std::string& verb = args[0];
  const bool takes_name = verb == "create" || verb == "get" || verb == "delete";
  if (verb != "list" && !takes_name) return Usage();
  if (args.size() != (takes_name ? 2u : 1u)) return Usage();
  auto client = ConnectFromFlags();
  if (!client.ok()) {
    PrintError("connect", client.status());
    return kExitFailure;
  }
  if (verb == "create") return Create(**client, args[1]);
  if (verb == "get") return Get(**client, args[1]);
  if (verb == "delete") return Delete(**client, args[1]);
  return List(**client);
}

}  // namespace attnd::attnctl
