// Thin wrappers over the sm_90a instructions the Hopper kernels (prefill, MLA decode) are built
// from: wgmma
// (m64nNk16, fp32 accumulators, A from shared memory or registers, B from shared memory),
// mbarrier phases, cp.async arrivals on them, named barriers, register reallocation and the
// cross-proxy fence. Included only
// from files compiled for sm_90a (-gencode=arch=compute_90a,code=sm_90a). Device-only; no state.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace attnd::cuda {

// --- Shared memory matrix descriptors ---------------------------------------------------------
// Tiles live in 128-byte swizzled blocks: rows of 64 16-bit elements (128 bytes), 16-byte chunk c
// of row r stored at chunk c ^ (r % 8), 8-row atoms of 1024 bytes, every block 1024-byte aligned
// so the hardware's swizzle phase (address bits 7-9) equals the row's.
//
// K-major operand (rows along M or N, 64 contiguous elements along K): stride_bytes is the step
// between 8-row atoms (1024 for densely packed rows); the leading offset is unused (1).
// MN-major operand (V as B of P V: 64 contiguous elements along N per key row): leading_bytes is
// the step between 64-column blocks along N, stride_bytes the step between 8-key atoms along K.
__device__ __forceinline__ uint64_t MatrixDescriptor(uint32_t shared_address, uint32_t leading_bytes,
                                                     uint32_t stride_bytes) {
  uint64_t descriptor = (shared_address & 0x3ffff) >> 4;
  descriptor |= static_cast<uint64_t>((leading_bytes & 0x3ffff) >> 4) << 16;
  descriptor |= static_cast<uint64_t>((stride_bytes & 0x3ffff) >> 4) << 32;
  descriptor |= uint64_t{1} << 62;  // 128-byte swizzle
  return descriptor;
}

// Moves a descriptor's start address by `bytes` (a multiple of 16, staying inside the 256 KB
// window): the address field is the low 14 bits, in 16-byte units, and never carries here.
__device__ __forceinline__ uint64_t AdvanceDescriptor(uint64_t descriptor, uint32_t bytes) {
  return descriptor + (bytes >> 4);
}

// --- wgmma ------------------------------------------------------------------------------------

__device__ __forceinline__ void WgmmaFence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void WgmmaCommit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void WgmmaWait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}

// Ties a register to this point of the instruction stream: accumulators written by an
// asynchronous wgmma must not be read (or their registers reused) before its wait_group, which
// the compiler cannot see on its own.
__device__ __forceinline__ void FenceRegister(float& value) { asm volatile("" : "+f"(value)::"memory"); }
__device__ __forceinline__ void FenceRegister(uint32_t& value) { asm volatile("" : "+r"(value)::"memory"); }
template <int kCount>
__device__ __forceinline__ void FenceRegisters(float (&values)[kCount]) {
#pragma unroll
  for (int i = 0; i < kCount; ++i) FenceRegister(values[i]);
}

#define ATTND_ACC8(i)                                                                                   \
  "+f"(d[(i) + 0]), "+f"(d[(i) + 1]), "+f"(d[(i) + 2]), "+f"(d[(i) + 3]), "+f"(d[(i) + 4]), "+f"(d[(i) + 5]), \
      "+f"(d[(i) + 6]), "+f"(d[(i) + 7])
#define ATTND_ACC32 ATTND_ACC8(0), ATTND_ACC8(8), ATTND_ACC8(16), ATTND_ACC8(24)
#define ATTND_ACC64 ATTND_ACC32, ATTND_ACC8(32), ATTND_ACC8(40), ATTND_ACC8(48), ATTND_ACC8(56)
#define ATTND_ACC128                                                                                 \
  ATTND_ACC64, ATTND_ACC8(64), ATTND_ACC8(72), ATTND_ACC8(80), ATTND_ACC8(88), ATTND_ACC8(96), ATTND_ACC8(104), \
      ATTND_ACC8(112), ATTND_ACC8(120)
#define ATTND_REGS32                                                                                     \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, " \
  "%22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define ATTND_REGS64                                                                                     \
  ATTND_REGS32 ", %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, " \
               "%49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define ATTND_REGS128                                                                                      \
  ATTND_REGS64 ", %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, "   \
               "%81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, " \
               "%99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, "  \
               "%114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"

// d[N/2] (+)= A[64x16] * B[16xN]: A and B K-major in shared memory. accumulate = 0 overwrites d.
template <int kN, typename T>
__device__ __forceinline__ void WgmmaSS(float (&d)[kN / 2], uint64_t a, uint64_t b, int accumulate);
// d[N/2] += A[64x16] * B[16xN]: A in registers (the m16n8k16 A fragment of the warp's 16 rows),
// B MN-major in shared memory (transposed: N contiguous).
template <int kN, typename T>
__device__ __forceinline__ void WgmmaRS(float (&d)[kN / 2], const uint32_t (&a)[4], uint64_t b);

// d[N/2] (+)= A[64x16] * B[16xN]: A K-major in shared memory, B MN-major in shared memory (V as
// the B of P V, with P staged in shared memory). accumulate = 0 overwrites d.
template <int kN, typename T>
__device__ __forceinline__ void WgmmaSSTransposedB(float (&d)[kN / 2], uint64_t a, uint64_t b, int accumulate);

#define ATTND_DEFINE_WGMMA_SS128(TYPE, PTX_TYPE)                                                          \
  template <>                                                                                          \
  __device__ __forceinline__ void WgmmaSS<128, TYPE>(float(&d)[64], uint64_t a, uint64_t b, int accumulate) { \
    asm volatile(                                                                                      \
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"                                                   \
        "wgmma.mma_async.sync.aligned.m64n128k16.f32." PTX_TYPE "." PTX_TYPE " {" ATTND_REGS64          \
        "}, %64, %65, p, 1, 1, 0, 0;\n}\n"                                                             \
        : ATTND_ACC64                                                                                  \
        : "l"(a), "l"(b), "r"(accumulate)                                                              \
        : "memory");                                                                                   \
  }

#define ATTND_DEFINE_WGMMA_RS128(TYPE, PTX_TYPE)                                                          \
  template <>                                                                                          \
  __device__ __forceinline__ void WgmmaRS<128, TYPE>(float(&d)[64], const uint32_t(&a)[4], uint64_t b) { \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"                                        \
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32." PTX_TYPE "." PTX_TYPE " {" ATTND_REGS64    \
                 "}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"                                     \
                 : ATTND_ACC64                                                                         \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1)                          \
                 : "memory");                                                                          \
  }

#define ATTND_DEFINE_WGMMA_RS64(TYPE, PTX_TYPE)                                                           \
  template <>                                                                                          \
  __device__ __forceinline__ void WgmmaRS<64, TYPE>(float(&d)[32], const uint32_t(&a)[4], uint64_t b) {  \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"                                        \
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32." PTX_TYPE "." PTX_TYPE " {" ATTND_REGS32     \
                 "}, {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"                                     \
                 : ATTND_ACC32                                                                         \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1)                          \
                 : "memory");                                                                          \
  }

#define ATTND_DEFINE_WGMMA_SS64(TYPE, PTX_TYPE)                                                           \
  template <>                                                                                          \
  __device__ __forceinline__ void WgmmaSS<64, TYPE>(float(&d)[32], uint64_t a, uint64_t b, int accumulate) { \
    asm volatile(                                                                                      \
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"                                                   \
        "wgmma.mma_async.sync.aligned.m64n64k16.f32." PTX_TYPE "." PTX_TYPE " {" ATTND_REGS32           \
        "}, %32, %33, p, 1, 1, 0, 0;\n}\n"                                                             \
        : ATTND_ACC32                                                                                  \
        : "l"(a), "l"(b), "r"(accumulate)                                                              \
        : "memory");                                                                                   \
  }

#define ATTND_DEFINE_WGMMA_RS256(TYPE, PTX_TYPE)                                                          \
  template <>                                                                                          \
  __device__ __forceinline__ void WgmmaRS<256, TYPE>(float(&d)[128], const uint32_t(&a)[4], uint64_t b) { \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n"                                       \
                 "wgmma.mma_async.sync.aligned.m64n256k16.f32." PTX_TYPE "." PTX_TYPE " {" ATTND_REGS128  \
                 "}, {%128, %129, %130, %131}, %132, p, 1, 1, 1;\n}\n"                                 \
                 : ATTND_ACC128                                                                        \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1)                          \
                 : "memory");                                                                          \
  }

#define ATTND_DEFINE_WGMMA_SST256(TYPE, PTX_TYPE)                                                         \
  template <>                                                                                          \
  __device__ __forceinline__ void WgmmaSSTransposedB<256, TYPE>(float(&d)[128], uint64_t a, uint64_t b,  \
                                                                int accumulate) {                     \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"                                       \
                 "wgmma.mma_async.sync.aligned.m64n256k16.f32." PTX_TYPE "." PTX_TYPE " {" ATTND_REGS128  \
                 "}, %128, %129, p, 1, 1, 0, 1;\n}\n"                                                  \
                 : ATTND_ACC128                                                                        \
                 : "l"(a), "l"(b), "r"(accumulate)                                                     \
                 : "memory");                                                                          \
  }

#define ATTND_DEFINE_WGMMA_SST128(TYPE, PTX_TYPE)                                                         \
  template <>                                                                                          \
  __device__ __forceinline__ void WgmmaSSTransposedB<128, TYPE>(float(&d)[64], uint64_t a, uint64_t b,   \
                                                                int accumulate) {                     \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"                                        \
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32." PTX_TYPE "." PTX_TYPE " {" ATTND_REGS64   \
                 "}, %64, %65, p, 1, 1, 0, 1;\n}\n"                                                    \
                 : ATTND_ACC64                                                                         \
                 : "l"(a), "l"(b), "r"(accumulate)                                                     \
                 : "memory");                                                                          \
  }

ATTND_DEFINE_WGMMA_SS128(__nv_bfloat16, "bf16")
ATTND_DEFINE_WGMMA_SS128(__half, "f16")
ATTND_DEFINE_WGMMA_RS128(__nv_bfloat16, "bf16")
ATTND_DEFINE_WGMMA_RS128(__half, "f16")
ATTND_DEFINE_WGMMA_RS64(__nv_bfloat16, "bf16")
ATTND_DEFINE_WGMMA_RS64(__half, "f16")
ATTND_DEFINE_WGMMA_SS64(__nv_bfloat16, "bf16")
ATTND_DEFINE_WGMMA_SS64(__half, "f16")
ATTND_DEFINE_WGMMA_RS256(__nv_bfloat16, "bf16")
ATTND_DEFINE_WGMMA_RS256(__half, "f16")
ATTND_DEFINE_WGMMA_SST256(__nv_bfloat16, "bf16")
ATTND_DEFINE_WGMMA_SST256(__half, "f16")
ATTND_DEFINE_WGMMA_SST128(__nv_bfloat16, "bf16")
ATTND_DEFINE_WGMMA_SST128(__half, "f16")

#undef ATTND_DEFINE_WGMMA_SS128
#undef ATTND_DEFINE_WGMMA_RS128
#undef ATTND_DEFINE_WGMMA_RS64
#undef ATTND_DEFINE_WGMMA_SS64
#undef ATTND_DEFINE_WGMMA_RS256
#undef ATTND_DEFINE_WGMMA_SST256
#undef ATTND_DEFINE_WGMMA_SST128
#undef ATTND_REGS128
#undef ATTND_ACC128
#undef ATTND_REGS64
#undef ATTND_REGS32
#undef ATTND_ACC64
#undef ATTND_ACC32
#undef ATTND_ACC8

// --- mbarrier ---------------------------------------------------------------------------------

__device__ __forceinline__ void MbarrierInit(uint32_t barrier, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(barrier), "r"(count) : "memory");
}

// Makes the initialised barriers visible to the async proxy (cp.async arrivals) before use.
__device__ __forceinline__ void FenceMbarrierInit() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

__device__ __forceinline__ void MbarrierArrive(uint32_t barrier) {
  asm volatile("{\n.reg .b64 state;\nmbarrier.arrive.shared::cta.b64 state, [%0];\n}\n" ::"r"(barrier) : "memory");
}

// Waits until the phase of parity `parity` has completed. A fresh barrier is in phase 0, so a
// wait on parity 1 returns at once (the "previous" phase counts as complete).
__device__ __forceinline__ void MbarrierWait(uint32_t barrier, uint32_t parity) {
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(barrier), "r"(parity)
        : "memory");
  } while (done == 0);
}

// Whether the phase of parity `parity` has completed, without waiting.
__device__ __forceinline__ bool MbarrierTest(uint32_t barrier, uint32_t parity) {
  uint32_t done;
  asm volatile(
      "{\n.reg .pred p;\nmbarrier.test_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(done)
      : "r"(barrier), "r"(parity)
      : "memory");
  return done != 0;
}

// One arrival on `barrier` that also adds `bytes` to the transaction count its phase waits for
// (the bytes of the TMA loads that complete on it).
__device__ __forceinline__ void MbarrierArriveExpectTx(uint32_t barrier, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(barrier), "r"(bytes) : "memory");
}

// TMA: the box at (x, y) (elements: column, row) of the 2D tensor map `map` (a __grid_constant__
// kernel parameter's address) into shared memory at `destination`, completing `bytes` on `barrier`.
__device__ __forceinline__ void TmaLoad2d(uint32_t destination, const void* map, int x, int y, uint32_t barrier) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(
          destination),
      "l"(map), "r"(x), "r"(y), "r"(barrier)
      : "memory");
}

// The same box into the shared memory of every CTA of the cluster named in `cta_mask` (bit r:
// cluster rank r), at `destination`'s offset in each, completing its bytes on the barrier at
// `barrier`'s offset in each.
__device__ __forceinline__ void TmaLoad2dMulticast(uint32_t destination, const void* map, int x, int y,
                                                   uint32_t barrier, uint16_t cta_mask) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.multicast::cluster"
      " [%0], [%1, {%2, %3}], [%4], %5;\n" ::"r"(destination),
      "l"(map), "r"(x), "r"(y), "r"(barrier), "h"(cta_mask)
      : "memory");
}

// One arrival on `barrier` once every cp.async this thread issued so far has landed. noinc: the
// arrival counts against the barrier's expected count (one per producer thread).
__device__ __forceinline__ void CpAsyncArriveNoinc(uint32_t barrier) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(barrier) : "memory");
}

__device__ __forceinline__ void CpAsyncWaitAll() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }

// Shared memory written through the generic proxy (stores, cp.async) and read next by wgmma
// (the async proxy) needs this fence in between, in the thread that observed the writes.
__device__ __forceinline__ void FenceProxyAsync() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// --- Clusters --------------------------------------------------------------------------------

__device__ __forceinline__ uint32_t ClusterCtaRank() {
  uint32_t rank;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(rank));
  return rank;
}

// One arrival on the barrier at `barrier`'s offset in the shared memory of cluster rank `cta`.
// Default (CTA-scope) release: it signals that this thread's reads of a stage completed (wgmma
// waited on), not data for the other CTA to read; a cluster-scope release would fence this
// thread's every earlier write on the consumers' path.
__device__ __forceinline__ void MbarrierArriveRemote(uint32_t barrier, uint32_t cta) {
  asm volatile(
      "{\n.reg .b32 remote;\nmapa.shared::cluster.u32 remote, %0, %1;\n"
      "mbarrier.arrive.shared::cluster.b64 _, [remote];\n}\n" ::"r"(barrier),
      "r"(cta)
      : "memory");
}

// Every thread of every CTA of the cluster arrives, then waits for all: release/acquire at
// cluster scope.
__device__ __forceinline__ void ClusterArrive() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void ClusterWait() { asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory"); }

// --- Named barriers and registers -------------------------------------------------------------

__device__ __forceinline__ void NamedBarrierSync(uint32_t id, uint32_t threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void NamedBarrierArrive(uint32_t id, uint32_t threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// bar.sync that also ANDs `value` over the `threads` arriving: the same answer in every one of
// them (for choices that must not diverge across a warpgroup, such as which wgmma comes next).
__device__ __forceinline__ bool NamedBarrierAll(uint32_t id, uint32_t threads, bool value) {
  uint32_t all;
  asm volatile(
      "{\n.reg .pred in, out;\nsetp.ne.u32 in, %1, 0;\nbar.red.and.pred out, %2, %3, in;\nselp.u32 %0, 1, 0, out;\n}\n"
      : "=r"(all)
      : "r"(static_cast<uint32_t>(value)), "r"(id), "r"(threads)
      : "memory");
  return all != 0;
}

template <int kRegisters>
__device__ __forceinline__ void ReleaseRegisters() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
}
template <int kRegisters>
__device__ __forceinline__ void ClaimRegisters() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
}

}  // namespace attnd::cuda
