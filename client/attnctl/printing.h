// Human-readable (and JSON) renderings of attnd messages for attnctl.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <google/protobuf/message.h>

#include "absl/status/status.h"
#include "attnd/v1/attnd.pb.h"

namespace attnd::attnctl {

std::string FormatBytes(int64_t bytes);             // "512.0 MiB"
std::string DTypeShortName(attnd::v1::DType dtype);  // "bf16", "fp8_e4m3", ...
// One line: "MHA 4 layers, 8 q / 2 kv heads, head_dim 64, page 16, q bf16, kv bf16, ...".
std::string DescribeConfig(const attnd::v1::CacheConfig& config);
std::string DescribeRope(const attnd::v1::RopeConfig& rope);

// Prints to stdout.
void PrintCacheInfo(const attnd::v1::CacheInfo& cache);
void PrintCacheTable(const std::vector<attnd::v1::CacheInfo>& caches);
void PrintServerInfo(const attnd::v1::GetServerInfoResponse& info);
void PrintStats(const attnd::v1::GetStatsResponse& stats);
void PrintJson(const google::protobuf::Message& message);

// "attnctl: <what>: NOT_FOUND: cache 'x' does not exist" on stderr.
void PrintError(const std::string& what, const absl::Status& status);

}  // namespace attnd::attnctl
