// sm_intake_probe: how many bytes a second one SM takes in from HBM, by way of loading, on N of
// its SMs (one CTA per SM: each claims 200 KB of shared memory), so that a kernel's per-SM rate
// can be told apart from the HBM's. Variants:
//   lsu_<K>KB    cp.async.cg 16-byte copies by 256 threads into a shared-memory ring, K KB in
//                flight per SM (the copies the decode and prefill kernels issue)
//   bulk_<C>     cp.async.bulk (the TMA engine, 1D) copies of C bytes into 32 KB stages, 6
//                stages in flight, completing on an mbarrier per stage
// Each CTA reads its own slice of a 3 GiB buffer (no L2 reuse); every launch then checks bytes
// of the last stage it loaded against the buffer's fill pattern, so a variant that loaded
// nothing cannot report a rate. Median of 5 event-timed launches (bench::MedianMs).
//
// Usage: sm_intake_probe   (CSV on stdout: variant,sms,total_GBps,per_sm_GBps; ~3 s on an H200)
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>

#include "bench_util.h"

namespace {

constexpr int kSmemBytes = 200 * 1024;
constexpr uint8_t kPattern = 0x5A;

__device__ __forceinline__ uint32_t SharedAddress(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Counts bytes of `stage` (`bytes` long) that differ from the fill pattern, at a stride.
__device__ void CheckStage(const uint8_t* stage, int bytes, int* errors) {
  for (int i = threadIdx.x * 61; i < bytes; i += blockDim.x * 61) {
    if (stage[i] != kPattern) atomicAdd(errors, 1);
  }
}

// kGroups groups of 256 x 16 x kPer bytes, kGroups - 1 in flight behind the newest.
template <int kPer, int kGroups>
__global__ void __launch_bounds__(256, 1) LsuRead(const uint8_t* source, int64_t bytes_per_cta, int* errors) {
  extern __shared__ __align__(1024) uint8_t smem[];
  constexpr int kGroupBytes = 256 * 16 * kPer;
  const uint8_t* base = source + blockIdx.x * bytes_per_cta;
  const int64_t groups = bytes_per_cta / kGroupBytes;
  for (int64_t g = 0; g < groups; ++g) {
    uint8_t* stage = smem + (g % kGroups) * kGroupBytes;
    for (int i = 0; i < kPer; ++i) {
      const int offset = (i * 256 + threadIdx.x) * 16;
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(SharedAddress(stage + offset)),
                   "l"(base + g * kGroupBytes + offset)
                   : "memory");
    }
    asm volatile("cp.async.commit_group;\n" ::: "memory");
    asm volatile("cp.async.wait_group %0;\n" ::"n"(kGroups - 1) : "memory");
  }
  asm volatile("cp.async.wait_all;\n" ::: "memory");
  __syncthreads();
  CheckStage(smem + ((groups - 1) % kGroups) * kGroupBytes, kGroupBytes, errors);
}

// Stages of kStageBytes, kStages in flight, each filled by chunk-byte bulk copies issued by
// `issuers` threads and completing on the stage's mbarrier.
constexpr int kStageBytes = 32 * 1024;
constexpr int kStages = 6;

__global__ void __launch_bounds__(128, 1) BulkRead(const uint8_t* source, int64_t bytes_per_cta, int chunk,
                                                   int issuers, int* errors) {
#if __CUDA_ARCH__ >= 900
  extern __shared__ __align__(1024) uint8_t smem[];
  uint64_t* barriers = reinterpret_cast<uint64_t*>(smem + kStages * kStageBytes);
  const uint8_t* base = source + blockIdx.x * bytes_per_cta;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(SharedAddress(&barriers[s])) : "memory");
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  auto wait = [&](int s, uint32_t parity) {
    uint32_t done = 0;
    while (done == 0) {
      asm volatile(
          "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
          : "=r"(done)
          : "r"(SharedAddress(&barriers[s])), "r"(parity)
          : "memory");
    }
  };
  const int64_t stages = bytes_per_cta / kStageBytes;
  for (int64_t t = 0; t < stages; ++t) {
    const int s = static_cast<int>(t % kStages);
    const uint32_t barrier = SharedAddress(&barriers[s]);
    if (t >= kStages) wait(s, static_cast<uint32_t>((t / kStages - 1) & 1));  // the stage's last fill landed
    if (threadIdx.x == 0) {
      asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(barrier), "r"(kStageBytes)
                   : "memory");
    }
    if (static_cast<int>(threadIdx.x) < issuers) {
      for (int c = threadIdx.x; c < kStageBytes / chunk; c += issuers) {
        asm volatile(
            "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                SharedAddress(smem + s * kStageBytes + c * chunk)),
            "l"(base + t * kStageBytes + c * chunk), "r"(chunk), "r"(barrier)
            : "memory");
      }
    }
  }
  for (int64_t t = stages > kStages ? stages - kStages : 0; t < stages; ++t) {
    wait(static_cast<int>(t % kStages), static_cast<uint32_t>((t / kStages) & 1));
  }
  __syncthreads();
  CheckStage(smem + ((stages - 1) % kStages) * kStageBytes, kStageBytes, errors);
#endif
}

}  // namespace

int main() {
  using attnd::bench::DeviceMemory;
  const int64_t total = int64_t{3} << 30;
  DeviceMemory buffer(total);
  DeviceMemory errors(sizeof(int));
  CHECK_CUDA(cudaMemset(buffer.get(), kPattern, total));
  for (const void* kernel : {reinterpret_cast<const void*>(LsuRead<4, 4>), reinterpret_cast<const void*>(LsuRead<8, 4>),
                             reinterpret_cast<const void*>(LsuRead<4, 12>), reinterpret_cast<const void*>(BulkRead)}) {
    CHECK_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
  }
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreate(&stream));
  const uint8_t* source = buffer.get<uint8_t>();
  int* bad = errors.get<int>();
  std::printf("variant,sms,total_GBps,per_sm_GBps\n");
  bool ok = true;
  for (int sms : {8, 16, 32, 56, 76, 100, 132}) {
    const int64_t per_cta = std::min<int64_t>(int64_t{96} << 20, (total / sms) & ~int64_t{(1 << 20) - 1});
    // Median of 5 launches; every launch's loaded bytes checked (the count is over all five).
    auto report = [&](const char* name, auto launch) {
      CHECK_CUDA(cudaMemset(bad, 0, sizeof(int)));
      const float ms = attnd::bench::MedianMs(5, 1, [&](int) { launch(); }, stream);
      CHECK_CUDA(cudaGetLastError());
      int wrong = 0;
      CHECK_CUDA(cudaMemcpy(&wrong, bad, sizeof(int), cudaMemcpyDeviceToHost));
      if (wrong != 0) {
        std::fprintf(stderr, "sm_intake_probe: %s on %d SMs: %d bytes differ from the buffer\n", name, sms, wrong);
        ok = false;
        return;
      }
      const double gbps = static_cast<double>(per_cta) * sms / (ms * 1e-3) / 1e9;
      std::printf("%s,%d,%.1f,%.1f\n", name, sms, gbps, gbps / sms);
    };
    report("lsu_64KB", [&] { LsuRead<4, 4><<<sms, 256, kSmemBytes, stream>>>(source, per_cta, bad); });
    report("lsu_128KB", [&] { LsuRead<8, 4><<<sms, 256, kSmemBytes, stream>>>(source, per_cta, bad); });
    report("lsu_192KB", [&] { LsuRead<4, 12><<<sms, 256, kSmemBytes, stream>>>(source, per_cta, bad); });
    for (int chunk : {32768, 4096, 256}) {
      const int issuers = chunk >= 4096 ? 1 : 128;
      const char* name = chunk == 32768 ? "bulk_32768" : chunk == 4096 ? "bulk_4096" : "bulk_256";
      report(name, [&] { BulkRead<<<sms, 128, kSmemBytes, stream>>>(source, per_cta, chunk, issuers, bad); });
    }
  }
  CHECK_CUDA(cudaStreamDestroy(stream));
  return ok ? 0 : 1;
}
