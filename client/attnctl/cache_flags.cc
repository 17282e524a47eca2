#include "cache_flags.h"

#include <cctype>
#include <map>
#include <utility>

#include "absl/flags/flag.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

ABSL_FLAG(std::string, kind, "mha", "cache kind: mha (also GQA) or mla");
ABSL_FLAG(int32_t, layers, 0, "layers of the model (0: the command's default)");
ABSL_FLAG(int32_t, qo_heads, 0, "query heads (0: the command's default)");
ABSL_FLAG(int32_t, kv_heads, 0, "K/V heads, MHA (0: the command's default)");
ABSL_FLAG(int32_t, head_dim, 0, "head width, MHA: 64, 128 or 256 (0: the command's default)");
ABSL_FLAG(int32_t, kv_lora_rank, 0, "MLA latent width (0: server default 512)");
ABSL_FLAG(int32_t, rope_dim, 0, "MLA rope width (0: server default 64)");
ABSL_FLAG(int32_t, page_size, 0, "tokens per page, a power of two <= 128 (0: default 16)");
ABSL_FLAG(std::string, q_dtype, "bf16", "dtype of q/k/v/o on the wire: bf16 or fp16");
ABSL_FLAG(std::string, kv_dtype, "", "stored K/V dtype: bf16, fp16 or fp8 (default: q_dtype)");
ABSL_FLAG(float, k_scale, 0, "fp8 caches: K dequantisation scale (0: 1)");
ABSL_FLAG(float, v_scale, 0, "fp8 caches: V dequantisation scale (0: 1)");
ABSL_FLAG(std::string, layout, "nhd", "page layout: nhd or hnd");
ABSL_FLAG(int64_t, num_pages, 0, "capacity in pages per pool");
ABSL_FLAG(std::string, memory_bytes, "", "capacity as a byte budget, e.g. 2GiB");
ABSL_FLAG(std::string, rope, "neox", "rotary embedding: none, neox or interleaved");
ABSL_FLAG(double, rope_theta, 0, "RoPE base (0: 10000)");
ABSL_FLAG(int32_t, rotary_dim, 0, "leading dims that rotate (0: all)");
ABSL_FLAG(std::string, rope_scaling, "none", "RoPE frequency scaling: none, linear or llama3");
ABSL_FLAG(double, rope_factor, 0, "RoPE scaling factor (0: 1)");
ABSL_FLAG(double, rope_low_freq_factor, 0, "llama3 scaling: low_freq_factor (0: 1)");
ABSL_FLAG(double, rope_high_freq_factor, 0, "llama3 scaling: high_freq_factor (0: 4)");
ABSL_FLAG(int64_t, rope_original_max_position, 0, "llama3 scaling: pre-training context (0: 8192)");
ABSL_FLAG(std::string, page_table, "managed", "page table mode: managed or external");
ABSL_FLAG(std::string, page_table_form, "shared", "external page tables: shared or separate_kv");

namespace attnd::attnctl {
namespace {

template <typename Enum>
absl::StatusOr<Enum> Lookup(const std::string& flag, const std::string& value,
                            const std::map<std::string, Enum>& names) {
  auto it = names.find(absl::AsciiStrToLower(value));
  if (it != names.end()) return it->second;
  std::vector<std::string> accepted;
  for (const auto& [name, unused] : names) accepted.push_back(name);
  return absl::InvalidArgumentError(absl::StrCat("--", flag, ": expected one of ",
                                                 absl::StrJoin(accepted, ", "), ", got '",
                                                 value, "'"));
}

absl::StatusOr<attnd::v1::DType> ParseDType(const std::string& flag, const std::string& value) {
  return Lookup<attnd::v1::DType>(flag, value,
                                  {{"bf16", attnd::v1::DTYPE_BFLOAT16},
                                   {"bfloat16", attnd::v1::DTYPE_BFLOAT16},
                                   {"fp16", attnd::v1::DTYPE_FLOAT16},
                                   {"float16", attnd::v1::DTYPE_FLOAT16},
                                   {"fp8", attnd::v1::DTYPE_FLOAT8_E4M3},
                                   {"fp8_e4m3", attnd::v1::DTYPE_FLOAT8_E4M3}});
}

template <typename T>
T Or(T value, T fallback) {
  return value == T{} ? fallback : value;
}

}  // namespace

bool CapacityFlagGiven() {
  return absl::GetFlag(FLAGS_num_pages) != 0 || !absl::GetFlag(FLAGS_memory_bytes).empty();
}

absl::StatusOr<int64_t> ParseByteSize(const std::string& text) {
  std::string digits = text;
  std::string suffix;
  while (!digits.empty() && std::isalpha(static_cast<unsigned char>(digits.back()))) {
    suffix.insert(suffix.begin(), digits.back());
    digits.pop_back();
  }
  suffix = absl::AsciiStrToLower(suffix);
  if (suffix.size() > 1 && suffix.back() == 'b') suffix.pop_back();
  if (suffix == "b") suffix.clear();
  static const std::map<std::string, int64_t> kMultipliers = {
      {"", 1},
      {"k", 1000},
      {"m", 1000 * 1000},
      {"g", 1000 * 1000 * 1000},
      {"t", int64_t{1000} * 1000 * 1000 * 1000},
      {"ki", int64_t{1} << 10},
      {"mi", int64_t{1} << 20},
      {"gi", int64_t{1} << 30},
      {"ti", int64_t{1} << 40}};
  auto multiplier = kMultipliers.find(suffix);
  double number = 0;
  if (multiplier == kMultipliers.end() || !absl::SimpleAtod(digits, &number) || number < 0 ||
      number * multiplier->second > 9.2e18) {
    return absl::InvalidArgumentError(
        absl::StrCat("expected a byte size such as 1073741824, 512MiB or 2G, got '", text, "'"));
  }
  return static_cast<int64_t>(number * multiplier->second);
}

absl::StatusOr<attnd::v1::CacheConfig> CacheConfigFromFlags(const CacheShapeDefaults& defaults) {
  attnd::v1::CacheConfig config;
  auto kind = Lookup<attnd::v1::AttentionKind>(
      "kind", absl::GetFlag(FLAGS_kind),
      {{"mha", attnd::v1::ATTENTION_KIND_MHA}, {"gqa", attnd::v1::ATTENTION_KIND_MHA},
       {"mla", attnd::v1::ATTENTION_KIND_MLA}});
  if (!kind.ok()) return kind.status();
  config.set_kind(*kind);
  config.set_num_layers(Or(absl::GetFlag(FLAGS_layers), defaults.num_layers));
  config.set_num_qo_heads(Or(absl::GetFlag(FLAGS_qo_heads), defaults.num_qo_heads));
  if (*kind == attnd::v1::ATTENTION_KIND_MLA) {
    config.set_kv_lora_rank(absl::GetFlag(FLAGS_kv_lora_rank));
    config.set_rope_dim(absl::GetFlag(FLAGS_rope_dim));
  } else {
    config.set_num_kv_heads(Or(absl::GetFlag(FLAGS_kv_heads), defaults.num_kv_heads));
    config.set_head_dim(Or(absl::GetFlag(FLAGS_head_dim), defaults.head_dim));
  }
  config.set_page_size(Or(absl::GetFlag(FLAGS_page_size), defaults.page_size));

  auto q_dtype = ParseDType("q_dtype", absl::GetFlag(FLAGS_q_dtype));
  if (!q_dtype.ok()) return q_dtype.status();
  config.set_q_dtype(*q_dtype);
  if (absl::GetFlag(FLAGS_kv_dtype).empty()) {
    config.set_kv_dtype(*q_dtype);
  } else {
    auto kv_dtype = ParseDType("kv_dtype", absl::GetFlag(FLAGS_kv_dtype));
    if (!kv_dtype.ok()) return kv_dtype.status();
    config.set_kv_dtype(*kv_dtype);
  }
  config.set_k_scale(absl::GetFlag(FLAGS_k_scale));
  config.set_v_scale(absl::GetFlag(FLAGS_v_scale));

  auto layout = Lookup<attnd::v1::KvLayout>(
      "layout", absl::GetFlag(FLAGS_layout),
      {{"nhd", attnd::v1::KV_LAYOUT_NHD}, {"hnd", attnd::v1::KV_LAYOUT_HND}});
  if (!layout.ok()) return layout.status();
  config.set_layout(*layout);

  if (absl::GetFlag(FLAGS_num_pages) != 0 && !absl::GetFlag(FLAGS_memory_bytes).empty()) {
    return absl::InvalidArgumentError("--num_pages and --memory_bytes: give one of them");
  }
  if (!absl::GetFlag(FLAGS_memory_bytes).empty()) {
    auto bytes = ParseByteSize(absl::GetFlag(FLAGS_memory_bytes));
    if (!bytes.ok()) return absl::InvalidArgumentError(absl::StrCat("--memory_bytes: ",
                                                                    bytes.status().message()));
    config.set_memory_bytes(*bytes);
  } else {
    config.set_num_pages(Or(absl::GetFlag(FLAGS_num_pages), defaults.num_pages));
  }

  attnd::v1::RopeConfig* rope = config.mutable_rope();
  auto style = Lookup<attnd::v1::RopeStyle>(
      "rope", absl::GetFlag(FLAGS_rope),
      {{"none", attnd::v1::ROPE_STYLE_NONE}, {"neox", attnd::v1::ROPE_STYLE_NEOX},
       {"interleaved", attnd::v1::ROPE_STYLE_INTERLEAVED}, {"gptj", attnd::v1::ROPE_STYLE_INTERLEAVED}});
  if (!style.ok()) return style.status();
  rope->set_style(*style);
  if (*style != attnd::v1::ROPE_STYLE_NONE) {
    rope->set_theta(absl::GetFlag(FLAGS_rope_theta));
    rope->set_rotary_dim(absl::GetFlag(FLAGS_rotary_dim));
    auto scaling = Lookup<attnd::v1::RopeScaling>(
        "rope_scaling", absl::GetFlag(FLAGS_rope_scaling),
        {{"none", attnd::v1::ROPE_SCALING_NONE}, {"linear", attnd::v1::ROPE_SCALING_LINEAR},
         {"llama3", attnd::v1::ROPE_SCALING_LLAMA3}});
    if (!scaling.ok()) return scaling.status();
    rope->set_scaling(*scaling);
    rope->set_factor(absl::GetFlag(FLAGS_rope_factor));
    rope->set_low_freq_factor(absl::GetFlag(FLAGS_rope_low_freq_factor));
    rope->set_high_freq_factor(absl::GetFlag(FLAGS_rope_high_freq_factor));
    rope->set_original_max_position(absl::GetFlag(FLAGS_rope_original_max_position));
  }

  auto mode = Lookup<attnd::v1::PageTableMode>(
      "page_table", absl::GetFlag(FLAGS_page_table),
      {{"managed", attnd::v1::PAGE_TABLE_MODE_MANAGED},
       {"external", attnd::v1::PAGE_TABLE_MODE_EXTERNAL}});
  if (!mode.ok()) return mode.status();
  config.set_page_table_mode(*mode);
  auto form = Lookup<attnd::v1::PageTableForm>(
      "page_table_form", absl::GetFlag(FLAGS_page_table_form),
      {{"shared", attnd::v1::PAGE_TABLE_FORM_SHARED},
       {"separate_kv", attnd::v1::PAGE_TABLE_FORM_SEPARATE_KV}});
  if (!form.ok()) return form.status();
  config.set_page_table_form(*form);
  return config;
}

}  // namespace attnd::attnctl
