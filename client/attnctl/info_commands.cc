// attnctl info | health | stats.
#include <string>

#include "absl/flags/flag.h"
#include "absl/strings/str_format.h"
#include "commands.h"
#include "global_flags.h"
#include "printing.h"

ABSL_FLAG(std::string, service, "",
          "health: the grpc.health.v1 service to check; \"\" = liveness, "
          "attnd.v1.AttentionService = readiness");

namespace attnd::attnctl {

int RunInfo(const Args& args) {
  if (!args.empty()) {
    absl::FPrintF(stderr, "usage: attnctl info\n");
    return kExitUsage;
  }
  auto client = ConnectFromFlags();
  if (!client.ok()) {
    PrintError("connect", client.status());
    return kExitFailure;
  }
  auto info = (*client)->GetServerInfo();
  if (!info.ok()) {
    PrintError("GetServerInfo", info.status());
    return kExitFailure;
  }
  if (absl::GetFlag(FLAGS_json)) {
    PrintJson(*info);
  } else {
    absl::PrintF("server       %s\n", (*client)->options().address);
    PrintServerInfo(*info);
  }
  return kExitOk;
}

int RunHealth(const Args& args) {
  if (!args.empty()) {
    absl::FPrintF(stderr, "usage: attnctl health [--service=NAME]\n");
    return kExitUsage;
  }
  auto client = ConnectFromFlags();
  if (!client.ok()) {
    PrintError("connect", client.status());
    return kExitFailure;
  }
  const std::string service = absl::GetFlag(FLAGS_service);
  auto status = (*client)->CheckHealth(service);
  if (!status.ok()) {
    PrintError(absl::StrFormat("health check of '%s'", service), status.status());
    return kExitFailure;
  }
  absl::PrintF("%s\n", grpc::health::v1::HealthCheckResponse::ServingStatus_Name(*status));
  // Exit 0 only when serving, so this can be a container's HEALTHCHECK.
  return *status == grpc::health::v1::HealthCheckResponse::SERVING ? kExitOk : kExitFailure;
}

int RunStats(const Args& args) {
  if (!args.empty()) {
    absl::FPrintF(stderr, "usage: attnctl stats\n");
    return kExitUsage;
  }
  auto client = ConnectFromFlags();
  if (!client.ok()) {
    PrintError("connect", client.status());
    return kExitFailure;
  }
  auto stats = (*client)->GetStats();
  if (!stats.ok()) {
    PrintError("GetStats", stats.status());
    return kExitFailure;
  }
  if (absl::GetFlag(FLAGS_json)) {
    PrintJson(*stats);
  } else {
    PrintStats(*stats);
  }
  return kExitOk;
}

}  // namespace attnd::attnctl
