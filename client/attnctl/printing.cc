#include "printing.h"

#include <cstdio>

#include <google/protobuf/util/json_util.h>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

namespace attnd::attnctl {
namespace {

// "ROPE_STYLE_NEOX" -> "neox".
std::string EnumSuffix(const std::string& name, const std::string& prefix) {
  std::string suffix = name.rfind(prefix, 0) == 0 ? name.substr(prefix.size()) : name;
  return absl::AsciiStrToLower(suffix);
}

const char* StateName(attnd::v1::CacheState state) {
  switch (state) {
    case attnd::v1::CACHE_STATE_READY:
      return "READY";
    case attnd::v1::CACHE_STATE_FAILED:
      return "FAILED";
    default:
      return "UNKNOWN";
  }
}

}  // namespace

std::string FormatBytes(int64_t bytes) {
  static const char* const kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double value = static_cast<double>(bytes);
  int unit = 0;
  while (value >= 1024.0 && unit < 4) {
    value /= 1024.0;
    ++unit;
  }
  return unit == 0 ? absl::StrCat(bytes, " B") : absl::StrFormat("%.1f %s", value, kUnits[unit]);
}

std::string DTypeShortName(attnd::v1::DType dtype) {
  switch (dtype) {
    case attnd::v1::DTYPE_FLOAT16:
      return "fp16";
    case attnd::v1::DTYPE_BFLOAT16:
      return "bf16";
    case attnd::v1::DTYPE_FLOAT8_E4M3:
      return "fp8_e4m3";
    case attnd::v1::DTYPE_FLOAT32:
      return "fp32";
    default:
      return "unspecified";
  }
}

std::string DescribeRope(const attnd::v1::RopeConfig& rope) {
  if (rope.style() == attnd::v1::ROPE_STYLE_UNSPECIFIED ||
      rope.style() == attnd::v1::ROPE_STYLE_NONE) {
    return "none";
  }
  std::string text = EnumSuffix(attnd::v1::RopeStyle_Name(rope.style()), "ROPE_STYLE_");
  if (rope.theta() != 0) absl::StrAppend(&text, " theta ", rope.theta());
  if (rope.rotary_dim() != 0) absl::StrAppend(&text, " rotary_dim ", rope.rotary_dim());
  if (rope.scaling() == attnd::v1::ROPE_SCALING_LINEAR) {
    absl::StrAppend(&text, " linear x", rope.factor());
  } else if (rope.scaling() == attnd::v1::ROPE_SCALING_LLAMA3) {
    absl::StrAppend(&text, " llama3(factor ", rope.factor(), ", low ", rope.low_freq_factor(),
                    ", high ", rope.high_freq_factor(), ", original ",
                    rope.original_max_position(), ")");
  }
  return text;
}

std::string DescribeConfig(const attnd::v1::CacheConfig& config) {
  std::string text;
  if (config.kind() == attnd::v1::ATTENTION_KIND_MLA) {
    text = absl::StrCat("MLA ", config.num_layers(), " layers, ", config.num_qo_heads(),
                        " heads, kv_lora_rank ", config.kv_lora_rank(), ", rope_dim ",
                        config.rope_dim());
  } else {
    text = absl::StrCat("MHA ", config.num_layers(), " layers, ", config.num_qo_heads(), " q / ",
                        config.num_kv_heads(), " kv heads, head_dim ", config.head_dim());
  }
  absl::StrAppend(&text, ", page ", config.page_size(), ", q ", DTypeShortName(config.q_dtype()),
                  ", kv ", DTypeShortName(config.kv_dtype()));
  if (config.kv_dtype() == attnd::v1::DTYPE_FLOAT8_E4M3) {
    absl::StrAppend(&text, " (k_scale ", config.k_scale(), ", v_scale ", config.v_scale(), ")");
  }
  absl::StrAppend(&text, ", ", EnumSuffix(attnd::v1::KvLayout_Name(config.layout()), "KV_LAYOUT_"),
                  ", rope ", DescribeRope(config.rope()), ", ",
                  EnumSuffix(attnd::v1::PageTableMode_Name(config.page_table_mode()),
                             "PAGE_TABLE_MODE_"));
  if (config.page_table_form() == attnd::v1::PAGE_TABLE_FORM_SEPARATE_KV) {
    absl::StrAppend(&text, " separate_kv");
  }
  if (config.capacity_case() == attnd::v1::CacheConfig::kNumPages) {
    absl::StrAppend(&text, ", ", config.num_pages(), " pages");
  } else if (config.capacity_case() == attnd::v1::CacheConfig::kMemoryBytes) {
    absl::StrAppend(&text, ", ", FormatBytes(config.memory_bytes()));
  }
  return text;
}

void PrintCacheInfo(const attnd::v1::CacheInfo& cache) {
  absl::PrintF("cache %s\n", cache.name());
  absl::PrintF("  state       %s%s\n", StateName(cache.state()),
               cache.failure().empty() ? "" : absl::StrCat(" (", cache.failure(), ")"));
  absl::PrintF("  config      %s\n", DescribeConfig(cache.config()));
  const double used_percent =
      cache.num_pages() > 0 ? 100.0 * cache.used_pages() / cache.num_pages() : 0.0;
  absl::PrintF("  pages       %d used of %d (%.1f%%), %d tokens each\n", cache.used_pages(),
               cache.num_pages(), used_percent, cache.config().page_size());
  if (cache.shared_pages() > 0) {
    absl::PrintF("  shared      %d pages held by more than one sequence (forks)\n",
                 cache.shared_pages());
  }
  absl::PrintF("  pool        %s on device %d\n", FormatBytes(cache.pool_bytes()), cache.device());
  absl::PrintF("  sequences   %d\n", cache.num_sequences());
  absl::PrintF("  open steps  %d\n", cache.open_steps());
}

void PrintCacheTable(const std::vector<attnd::v1::CacheInfo>& caches) {
  if (caches.empty()) {
    absl::PrintF("no caches\n");
    return;
  }
  absl::PrintF("%-24s %-6s %-4s %6s %9s %4s %4s %-8s %9s %9s %5s %10s\n", "NAME", "STATE", "KIND",
               "LAYERS", "HEADS", "DIM", "PAGE", "KV", "PAGES", "USED", "SEQS", "POOL");
  for (const attnd::v1::CacheInfo& cache : caches) {
    const attnd::v1::CacheConfig& config = cache.config();
    const bool mla = config.kind() == attnd::v1::ATTENTION_KIND_MLA;
    const std::string heads = mla ? absl::StrCat(config.num_qo_heads())
                                  : absl::StrCat(config.num_qo_heads(), "/", config.num_kv_heads());
    absl::PrintF("%-24s %-6s %-4s %6d %9s %4d %4d %-8s %9d %9d %5d %10s\n", cache.name(),
                 StateName(cache.state()), mla ? "MLA" : "MHA", config.num_layers(), heads,
                 mla ? config.kv_lora_rank() : config.head_dim(), config.page_size(),
                 DTypeShortName(config.kv_dtype()), cache.num_pages(), cache.used_pages(),
                 cache.num_sequences(), FormatBytes(cache.pool_bytes()));
  }
}

void PrintServerInfo(const attnd::v1::GetServerInfoResponse& info) {
  absl::PrintF("version      %s\n", info.version());
  absl::PrintF("backend      %s\n", info.backend());
  absl::PrintF("device       %s\n", info.device());
  if (info.num_sms() > 0) absl::PrintF("SMs          %d\n", info.num_sms());
  if (info.device_memory_bytes() > 0) {
    absl::PrintF("memory       %s\n", FormatBytes(info.device_memory_bytes()));
  }
  absl::PrintF("kv budget    %s (%s free)\n", FormatBytes(info.kv_budget_bytes()),
               FormatBytes(info.kv_free_bytes()));
  if (info.devices_size() > 1) {
    for (const attnd::v1::DeviceInfo& device : info.devices()) {
      absl::PrintF("device %-5d %s, kv budget %s (%s free)\n", device.ordinal(), device.name(),
                   FormatBytes(device.kv_budget_bytes()), FormatBytes(device.kv_free_bytes()));
    }
  }
  absl::PrintF("extensions   %s\n",
               info.extensions().empty() ? "(none)" : absl::StrJoin(info.extensions(), ", "));
  const attnd::v1::ServerLimits& limits = info.limits();
  absl::PrintF("limits       max message %s, %d plan entries, %d tokens per step, step ttl %gs\n",
               FormatBytes(limits.max_message_bytes()), limits.max_plan_entries(),
               limits.max_step_tokens(), limits.step_ttl_seconds());
}

void PrintStats(const attnd::v1::GetStatsResponse& stats) {
  absl::PrintF("steps        %d committed, %d aborted\n", stats.steps_committed(),
               stats.steps_aborted());
  absl::PrintF("tokens       %d prefill, %d decode\n", stats.tokens_prefill(),
               stats.tokens_decode());
  if (stats.kernels().empty()) {
    absl::PrintF("kernels      (none run yet)\n");
    return;
  }
  absl::PrintF("\n%-12s %-8s %10s %12s %12s\n", "KERNEL", "PHASE", "COUNT", "TOTAL_S", "MEAN_US");
  for (const attnd::v1::KernelStats& kernel : stats.kernels()) {
    const double mean_us = kernel.count() > 0 ? 1e6 * kernel.total_seconds() / kernel.count() : 0;
    absl::PrintF("%-12s %-8s %10d %12.6f %12.1f\n", kernel.kernel(), kernel.phase(),
                 kernel.count(), kernel.total_seconds(), mean_us);
  }
}

void PrintJson(const google::protobuf::Message& message) {
  std::string json;
  google::protobuf::util::JsonPrintOptions options;
  options.add_whitespace = true;
  options.preserve_proto_field_names = true;
  (void)google::protobuf::util::MessageToJsonString(message, &json, options);
  std::fputs(json.c_str(), stdout);
  if (json.empty() || json.back() != '\n') std::fputc('\n', stdout);
}

void PrintError(const std::string& what, const absl::Status& status) {
  std::fprintf(stderr, "attnctl: %s: %s\n", what.c_str(), status.ToString().c_str());
  // The two failures a first call to a secured daemon meets, and what fixes them.
  if (status.code() == absl::StatusCode::kUnavailable) {
    std::fprintf(stderr,
                 "attnctl: hint: is attnd running at --server? A TLS port needs --tls_ca=CA.pem "
                 "(or --tls), mutual TLS also --tls_cert and --tls_key\n");
  } else if (status.code() == absl::StatusCode::kUnauthenticated) {
    std::fprintf(stderr,
                 "attnctl: hint: attnd has --token_file: pass a token with --token_file=FILE or "
                 "$ATTND_TOKEN\n");
  }
}

}  // namespace attnd::attnctl
