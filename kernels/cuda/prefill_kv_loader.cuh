// Loading paged KV tiles into shared memory for the batch prefill kernel (prefill_kernel.cuh):
// the swizzled tile layout, the per-tile table of page offsets, and the cp.async loader that
// also converts caches of another element type in place.
#pragma once

#include <cstdint>
#include <type_traits>

#include "cp_async.cuh"
#include "fp8.cuh"
#include "non_finite.cuh"
#include "prefill_params.h"

namespace attnd::cuda::prefill {

inline constexpr int kThreads = 128;

// Element offset of 16-byte chunk `chunk` of row `row` in a swizzled [rows][D] tile.
template <int kHeadDim>
__device__ __forceinline__ int Swizzle(int row, int chunk) {
  return row * kHeadDim + ((chunk ^ (row & 7)) << 3);
}

// Element offsets, from the KV head's base, of the rows of the next KV tile: page id lookups are
// loaded into registers (LoadIds) before Q K^T and stored as offsets (StoreOffsets) after it, so
// the cp.async issue reads shared memory instead of waiting on a dependent global load.
// Table layout: [2 tiles][2][kTileKv] int64, K rows then V rows; -1 marks a row past the keys.
template <typename Shape>
struct KvOffsetTable {
  static constexpr int kEntries = 2 * Shape::kTileKv;
  static constexpr int kPerThread = (kEntries + kThreads - 1) / kThreads;

  __device__ __forceinline__ static void LoadIds(int32_t (&ids)[kPerThread], const int32_t* k_page_ids,
                                                 const int32_t* v_page_ids, const KernelParams& params,
                                                 int tile_start, int kv_end) {
#pragma unroll
    for (int i = 0; i < kPerThread; ++i) {
      const int entry = threadIdx.x + i * kThreads;
      const int token = tile_start + entry % Shape::kTileKv;
      ids[i] = -1;
      if (entry < kEntries && token < kv_end) {
        ids[i] = (entry < Shape::kTileKv ? k_page_ids : v_page_ids)[token >> params.page_size_log2];
      }
    }
  }

  __device__ __forceinline__ static void StoreOffsets(int64_t* table, const int32_t (&ids)[kPerThread],
                                                      const KernelParams& params, int tile_start) {
    const int page_mask = (1 << params.page_size_log2) - 1;
#pragma unroll
    for (int i = 0; i < kPerThread; ++i) {
      const int entry = threadIdx.x + i * kThreads;
      if (entry < kEntries) {
        const int token = tile_start + entry % Shape::kTileKv;
        table[entry] = ids[i] < 0 ? int64_t{-1}
                                  : static_cast<int64_t>(ids[i]) * params.kv_page_stride +
                                        (token & page_mask) * params.kv_entry_stride;
      }
    }
  }
};

// Loads KV tiles of `Stored` elements into swizzled shared tiles of the MMA type T, always with
// cp.async. A cache of another type lands raw first (16-bit: in place, at the swizzled chunk it
// will occupy; fp8: in a separate raw tile of D bytes per row) and Convert() then rewrites, in
// each thread, exactly the chunks that thread loaded, so its own wait_group is all the
// ordering the conversion needs.
template <typename Shape, typename T, typename Stored>
struct KvTileLoader {
  static constexpr bool kDirect = std::is_same_v<Stored, T>;
  static constexpr bool kNarrow = sizeof(Stored) == 1;
  static constexpr int kStoredPerLoad = 16 / sizeof(Stored);
  static constexpr int kLoadsPerRow = Shape::kHeadDim / kStoredPerLoad;
  static constexpr int kRowsPerPass = kThreads / kLoadsPerRow;
  static constexpr int kPasses = Shape::kTileKv / kRowsPerPass;
  static_assert(kThreads % kLoadsPerRow == 0 && Shape::kTileKv % kRowsPerPass == 0, "loader");
  static_assert(32 % kLoadsPerRow == 0, "a row's lanes sit in one warp (ZeroNonFinite)");

  // Where this thread's 16 raw bytes of `row` land.
  __device__ __forceinline__ static uint8_t* RawChunk(T* tile, uint8_t* raw, int row, int load) {
    if constexpr (kNarrow) return raw + row * Shape::kHeadDim + load * 16;
    return reinterpret_cast<uint8_t*>(tile + Swizzle<Shape::kHeadDim>(row, load));
  }

  // `pool` is this KV head's base, `row_offsets` this tile's rows in the offset table.
  __device__ __forceinline__ static void Issue(T* tile, uint8_t* raw, const Stored* pool,
                                               const int64_t* row_offsets) {
    const int load = threadIdx.x % kLoadsPerRow;
    const int first_row = threadIdx.x / kLoadsPerRow;
#pragma unroll
    for (int pass = 0; pass < kPasses; ++pass) {
      const int row = first_row + pass * kRowsPerPass;
      const int64_t offset = row_offsets[row];
      // Keys past the end are zero-filled: V must be, since P = 0 times stale memory could be NaN.
      const bool valid = offset >= 0;
      const Stored* source = valid ? pool + offset + load * kStoredPerLoad : pool;
      CpAsync16(SharedAddress(RawChunk(tile, raw, row, load)), source, valid);
    }
  }

  __device__ __forceinline__ static void Convert(T* tile, uint8_t* raw) {
    if constexpr (!kDirect) {
      const int load = threadIdx.x % kLoadsPerRow;
      const int first_row = threadIdx.x / kLoadsPerRow;
#pragma unroll
      for (int pass = 0; pass < kPasses; ++pass) {
        const int row = first_row + pass * kRowsPerPass;
        const uint4 bits = *reinterpret_cast<const uint4*>(RawChunk(tile, raw, row, load));
        if constexpr (kNarrow) {
          // 16 fp8 values -> chunks 2 * load and 2 * load + 1.
          uint4 low, high;
          ConvertFp8x16<T, Stored>(bits, low, high);
          *reinterpret_cast<uint4*>(tile + Swizzle<Shape::kHeadDim>(row, 2 * load)) = low;
          *reinterpret_cast<uint4*>(tile + Swizzle<Shape::kHeadDim>(row, 2 * load + 1)) = high;
        } else {
          const uint32_t words[4] = {bits.x, bits.y, bits.z, bits.w};
          *reinterpret_cast<uint4*>(tile + Swizzle<Shape::kHeadDim>(row, load)) =
              make_uint4(ConvertPair<T, Stored>(words[0]), ConvertPair<T, Stored>(words[1]),
                         ConvertPair<T, Stored>(words[2]), ConvertPair<T, Stored>(words[3]));
        }
      }
    }
  }

  // After Convert, in tiles where some row does not see some key: zeroes the non-finite values
  // (exponent all ones) of the chunks this thread loaded, sets flags[row] to 1 where any lane
  // of the row found one, else 0, and returns whether this thread found one. A row's
  // kLoadsPerRow lanes are adjacent in one warp.
  __device__ __forceinline__ static bool ZeroNonFinite(T* tile, uint8_t* flags) {
    constexpr uint32_t kExponent = kNonFiniteExponent2<T>;
    constexpr int kChunksPerLoad = kNarrow ? 2 : 1;
    const int load = threadIdx.x % kLoadsPerRow;
    const int first_row = threadIdx.x / kLoadsPerRow;
    bool found_any = false;
#pragma unroll
    for (int pass = 0; pass < kPasses; ++pass) {
      const int row = first_row + pass * kRowsPerPass;
      uint32_t found = 0;
#pragma unroll
      for (int c = 0; c < kChunksPerLoad; ++c) {
        uint4* chunk = reinterpret_cast<uint4*>(tile + Swizzle<Shape::kHeadDim>(row, kChunksPerLoad * load + c));
        const uint4 bits = *chunk;
        // 0xffff in each 16-bit half that is an inf or a NaN.
        const uint32_t bad[4] = {__vcmpeq2(bits.x & kExponent, kExponent), __vcmpeq2(bits.y & kExponent, kExponent),
                                 __vcmpeq2(bits.z & kExponent, kExponent), __vcmpeq2(bits.w & kExponent, kExponent)};
        const uint32_t any = bad[0] | bad[1] | bad[2] | bad[3];
        if (any != 0) *chunk = make_uint4(bits.x & ~bad[0], bits.y & ~bad[1], bits.z & ~bad[2], bits.w & ~bad[3]);
        found |= any;
      }
      found_any |= found != 0;
#pragma unroll
      for (int offset = kLoadsPerRow / 2; offset >= 1; offset /= 2) found |= __shfl_xor_sync(0xffffffffu, found, offset);
      if (load == 0) flags[row] = found != 0 ? 1 : 0;
    }
    return found_any;
  }
};

}  // namespace attnd::cuda::prefill
