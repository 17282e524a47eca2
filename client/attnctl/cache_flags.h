// The flags that describe a cache (shared by `cache create`, `demo` and `bench`) and their
// mapping onto attnd.v1.CacheConfig.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "attnd/v1/attnd.pb.h"

namespace attnd::attnctl {

// Values used where a shape flag is left unset: a small GQA model with NeoX RoPE.
struct CacheShapeDefaults {
  int32_t num_layers = 4;
  int32_t num_qo_heads = 8;
  int32_t num_kv_heads = 2;
  int32_t head_dim = 64;
  int32_t page_size = 16;
  int64_t num_pages = 256;  // when neither --num_pages nor --memory_bytes is given
};

absl::StatusOr<attnd::v1::CacheConfig> CacheConfigFromFlags(const CacheShapeDefaults& defaults);

// True when --num_pages or --memory_bytes was given.
bool CapacityFlagGiven();

// "1073741824", "512MiB", "1G", "64k": K/M/G/T are powers of 1000, Ki/Mi/Gi/Ti (or KiB...)
// powers of 1024; a trailing "B" is allowed.
absl::StatusOr<int64_t> ParseByteSize(const std::string& text);

}  // namespace attnd::attnctl
