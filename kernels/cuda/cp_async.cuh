// cp.async (sm_80+): asynchronous 16-byte global -> shared copies in commit groups, the load
// path of every tiled kernel (decode, prefill, POD, MLA). Device-only; no state.
#pragma once

#include <cstdint>

namespace attnd::cuda {

__device__ __forceinline__ uint32_t SharedAddress(const void* pointer) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(pointer));
}

// Copies 16 bytes global -> shared, bypassing L1. When `valid` is false nothing is read and the
// 16 destination bytes are zero-filled (the source address must still be a legal pointer value).
__device__ __forceinline__ void CpAsync16(uint32_t shared_address, const void* global, bool valid) {
  const int source_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(shared_address),
               "l"(global), "r"(source_bytes)
               : "memory");
}

// An L2 policy under which the lines a copy brings in are evicted first: for data read once and
// streamed through (the decode's keys and values), so that what others reuse stays in L2 (a
// prefill running beside the decode, DESIGN's side-by-side mixed step).
__device__ __forceinline__ uint64_t EvictFirstPolicy() {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
  return policy;
}

// CpAsync16 under an L2 policy (EvictFirstPolicy).
__device__ __forceinline__ void CpAsync16(uint32_t shared_address, const void* global, bool valid, uint64_t policy) {
  const int source_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2, %3;\n" ::"r"(shared_address),
               "l"(global), "r"(source_bytes), "l"(policy)
               : "memory");
}

// The same copy to a generic pointer into shared memory.
__device__ __forceinline__ void CpAsync16(void* shared, const void* global, bool valid) {
  CpAsync16(SharedAddress(shared), global, valid);
}

// The same 16-byte copy cached in L1 as well (cp.async.ca): for data that is also read through
// global memory right after it lands.
__device__ __forceinline__ void CpAsync16CacheAll(void* shared, const void* global) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 16;\n" ::"r"(SharedAddress(shared)), "l"(global) : "memory");
}

// 16 bytes of shared memory into registers.
__device__ __forceinline__ uint4 LoadShared16(uint32_t shared_address) {
  uint4 value;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(value.x), "=r"(value.y), "=r"(value.z), "=r"(value.w)
               : "r"(shared_address)
               : "memory");
  return value;
}

// 16 bytes from registers into shared memory.
__device__ __forceinline__ void StoreShared16(uint32_t shared_address, uint4 value) {
  asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(shared_address), "r"(value.x), "r"(value.y),
               "r"(value.z), "r"(value.w)
               : "memory");
}

__device__ __forceinline__ void CpAsyncCommit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

// Waits until at most `kPending` of the most recent commit groups are still in flight.
template <int kPending>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

// CpAsyncWait<pending> for a pending count known only after unrolling (0..4; more waits for 4,
// which is stricter).
__device__ __forceinline__ void CpAsyncWaitPending(int pending) {
  switch (pending) {
    case 0: CpAsyncWait<0>(); break;
    case 1: CpAsyncWait<1>(); break;
    case 2: CpAsyncWait<2>(); break;
    case 3: CpAsyncWait<3>(); break;
    default: CpAsyncWait<4>(); break;
  }
}

}  // namespace attnd::cuda
