// Batch prefill attention over the paged KV cache on Hopper (sm_90a), DESIGN 4.3: the kernel
// template. Same work items, masks, outputs and partials as the mma.sync kernel
// (prefill_kernel.cuh); a CTA computes 128 packed query rows (token, head-in-group) of one
// request against one KV head, streaming the keys in tiles of 128 (64 at head_dim 256:
// HopperShape::kTileKv; N below).
//
// Warp specialisation, three warpgroups:
//   producer (warpgroup 0, 56 registers after setmaxnreg; at 40 its address math spilled):
//     loads K and V tiles with cp.async, row by row through the page table (any page size
//     1..128, NHD or HND, rows past the keys zero-filled; TMA boxes cannot follow a page table
//     of 1-row pages), into a ring of kStages stages each for K and V; a stage is full when every
//     producer thread's copies landed (cp.async.mbarrier.arrive.noinc; a V tile that hides keys
//     once the thread also scanned it for non-finite values, after issuing the next load:
//     PendingScan) and empty when every consumer warp released it (mbarrier.arrive after its
//     wgmma reads completed). From the
//     CTA's second work on it also loads each work's Q rows, into the Q buffer the consumers
//     left two works before, early in the work before (after that work's first K/V loads), and
//     stores the work decoded beside them, so that no consumer reads the work item's global
//     memory between works (Q full / Q empty mbarriers; one Q buffer at head_dim 256: once the
//     consumers are done with the work before).
//   consumers (warpgroups 1 and 2, 224 registers): 64 query rows each. Per KV tile j:
//     S = Q K_j^T (wgmma m64nNk16, Q and K from shared memory), online softmax in registers
//     (log2 domain), O += P_{j-1} V_{j-1} (wgmma m64nDk16, P from registers, V transposed from
//     shared memory).
// Overlap: inside a warpgroup, Q K_j^T is issued together with P_{j-1} V_{j-1}, so the softmax of
// tile j runs while P_{j-1} V_{j-1} is still on the tensor cores; across the two warpgroups, a
// pair of named barriers makes them take turns issuing (ping-pong), so one's softmax overlaps the
// other's matrix products. Where every work has one KV tile, also across works (ConsumeWorks).
//
// Shared memory (1024-byte aligned blocks, 128-byte swizzle, see hopper_ptx.cuh; shapes
// and the producer in prefill_hopper_pipeline.cuh):
//   Q  [2 buffers (1 at D256)][2 consumers][D/64 blocks][64 rows][128 B]  (work k: buffer k % 2)
//   K  [kStages][D/64 blocks][N rows][128 B]
//   V  [kStages][D/64 blocks][N rows][128 B]
//   mbarriers: K full, K empty, V full, V empty, one per stage each; Q full, Q empty per buffer.
// HopperPrefillOnDemandKernel (at the end): the same, each CTA taking its next work from a
// counter as it gets there (works on demand, for a prefill beside a decode and a tail grid).
// O goes from the accumulators to global memory directly (a transpose within each quad gives
// every thread whole 16-byte chunks), so the epilogue needs no barrier and no shared memory.
#pragma once

#include <cstdint>

#include "hopper_ptx.cuh"
#include "math.cuh"
#include "mma.cuh"
#include "prefill_hopper_pipeline.cuh"
#include "prefill_keys.cuh"
#include "prefill_params.h"
#include "softmax.cuh"
#include "vec.cuh"

namespace attnd::cuda::prefill::hopper {

// --- Consumers --------------------------------------------------------------------------------



// Non-finite inputs (q, or a key's k) make a score NaN or +-inf: s * 0 + s turns both into NaN
// (finite s unchanged) before the cap could make inf finite or -inf could read as masked; the
// mask then overwrites the scores of keys a row does not see. A NaN left makes p, the row's sum
// and o NaN (NaN in, NaN out, reported by the epilogue).
// Soft cap, before the mask: capping after it would turn a masked -inf into -cap.
// kSoftCap: the launch has a cap (sp.soft_cap); a kernel of its own, so that the kernels without
// one carry none of its ~700 instructions in their tile loop.
template <bool kSoftCap, int kN>
__device__ __forceinline__ void SoftCap(float (&s)[kN], const SoftmaxParams& sp) {
#pragma unroll
  for (int i = 0; i < kN; ++i) s[i] = fmaf(s[i], 0.0f, s[i]);
  // (The kernel with a cap still tests it at run time: with the test gone, ptxas scheduled the cap
  // into the loop differently and spilled 72 bytes.)
  if (kSoftCap && sp.soft_cap) {
#pragma unroll
    for (int i = 0; i < kN; ++i) s[i] = SoftCapLog2(s[i], sp.cap_input_scale, sp.cap_log2);
  }
}

// Online softmax over one S tile (kN = N / 2 fp32 per thread: rows g and g + 8 of the warp's 16,
// keys 8j + 2t + e), already capped and masked: updates the running max and sum (log2 domain),
// turns S into P in place and returns the factor the accumulated O must be scaled by.
template <int kN>
__device__ __forceinline__ void Softmax(float (&s)[kN], float (&row_max)[2], float (&row_sum)[2], float (&rescale)[2],
                                        const SoftmaxParams& sp) {
  constexpr int kKeyBlocks = kN / 4;  // 8-key blocks of the tile
  float subtract[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    // Tree-shaped maximum: short dependency chains.
    float block_max[kKeyBlocks];
#pragma unroll
    for (int j = 0; j < kKeyBlocks; ++j) block_max[j] = fmaxf(s[4 * j + 2 * h], s[4 * j + 2 * h + 1]);
#pragma unroll
    for (int stride = 1; stride < kKeyBlocks; stride *= 2) {
#pragma unroll
      for (int j = 0; j + stride < kKeyBlocks; j += 2 * stride) block_max[j] = fmaxf(block_max[j], block_max[j + stride]);
    }
    float tile_max = block_max[0];
    tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
    tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
    const float new_max = fmaxf(row_max[h], tile_max * sp.scale_log2);
    // A row with no visible key yet keeps m = -inf; subtract 0 so exp2 gives 0, not NaN.
    subtract[h] = new_max == -INFINITY ? 0.0f : new_max;
    rescale[h] = FastExp2(row_max[h] - subtract[h]);
    row_max[h] = new_max;
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float block_sum[kKeyBlocks];
#pragma unroll
    for (int j = 0; j < kKeyBlocks; ++j) {
      const float p0 = FastExp2(fmaf(s[4 * j + 2 * h], sp.scale_log2, -subtract[h]));
      const float p1 = FastExp2(fmaf(s[4 * j + 2 * h + 1], sp.scale_log2, -subtract[h]));
      s[4 * j + 2 * h] = p0;
      s[4 * j + 2 * h + 1] = p1;
      block_sum[j] = p0 + p1;
    }
#pragma unroll
    for (int stride = 1; stride < kKeyBlocks; stride *= 2) {
#pragma unroll
      for (int j = 0; j + stride < kKeyBlocks; j += 2 * stride) block_sum[j] += block_sum[j + stride];
    }
    row_sum[h] = row_sum[h] * rescale[h] + block_sum[0];
  }
}

// What a work's epilogue needs once its tile loop is over: ConsumeWorks keeps it while the next
// work's first tile runs (the Q buffer that held the work's record may be the producer's again).
struct FinishedWork {
  int index;
  int kv_head;
  int qo_start;
  int row_start;  // this consumer's first packed row
  int row_end;
  float row_max[2];
  float row_sum[2];
};

// A finished work's epilogue: o normalised into the output or, for a split item, fp32 partials for
// MergeStates. Its last P V has completed.
template <typename Shape, typename T>
__device__ __forceinline__ void StoreOutputs(const KernelParams& params, const FinishedWork& work,
                                             float (&o)[Shape::kHeadDim / 2]) {
  constexpr int kHeadDim = Shape::kHeadDim;
  constexpr int kOut = kHeadDim / 2;
  const int thread = threadIdx.x % 128;
  const int warp = thread / 32;
  const int lane = thread % 32;
  const int group = params.group_size;
  const int consumer_row_start = work.row_start;
  float row_sum[2] = {work.row_sum[0], work.row_sum[1]};
  const float row_max[2] = {work.row_max[0], work.row_max[1]};
  // A split item writes fp32 partials (normalised by its own sum) for MergeStates. Read here (no
  // register holds it through the tile loop), before the row sums, which hide its latency.
  const WorkItem* my_item = params.items + work.index;
  const int partial_first = __ldcg(&my_item->partial_first);
  const int partial_stride = __ldcg(&my_item->partial_stride);

  // --- Epilogue. A non-finite v of a key a row saw left a NaN or inf in its o: o * 0 adds NaN
  // to the row's sum then, exactly 0 otherwise. From here on a NaN sum means the row read a
  // non-finite input (o and lse NaN); 0 means it saw no key.
#pragma unroll
  for (int i = 0; i < kOut; ++i) row_sum[(i / 2) % 2] = fmaf(o[i], 0.0f, row_sum[(i / 2) % 2]);
  // Row sums over the quad, in a fixed order.
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    row_sum[h] += __shfl_xor_sync(0xffffffffu, row_sum[h], 1);
    row_sum[h] += __shfl_xor_sync(0xffffffffu, row_sum[h], 2);
  }
  // A row that saw no key has d = 0 and o = 0: it stores 0 and lse = -inf.
  float inverse[2];
  float lse[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    inverse[h] = row_sum[h] != 0.0f ? params.v_scale / row_sum[h] : 0.0f;
    lse[h] = row_sum[h] != 0.0f ? (row_max[h] + FastLog2(row_sum[h])) * kLn2 : -INFINITY;
  }
  const int thread_row0 = 16 * warp + lane / 4;  // consumer-local rows thread_row0 and + 8

  if (partial_first >= 0) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int packed = consumer_row_start + thread_row0 + 8 * h;
      if (packed < work.row_end) {
        const int token = DivideByGroup(params, packed);
        const int head = work.kv_head * group + (packed - token * group);
        const int64_t slot_row =
            (static_cast<int64_t>(partial_first) + static_cast<int64_t>(token) * partial_stride) * params.num_qo_heads +
            head;
        float* out = params.partial_o + slot_row * kHeadDim + 2 * (lane % 4);
#pragma unroll
        for (int j = 0; j < kHeadDim / 8; ++j) {
          *reinterpret_cast<float2*>(out + 8 * j) =
              make_float2(o[4 * j + 2 * h] * inverse[h], o[4 * j + 2 * h + 1] * inverse[h]);
        }
        if (lane % 4 == 0) params.partial_lse[slot_row] = lse[h];
      }
    }
    return;
  }

  // O from registers to global memory. A quad's 4 threads hold 4 bytes of each 16-byte chunk of
  // a row (columns 8j + 2t, + 1 of chunk j); a 4 x 4 transpose over the quad (two exchanges)
  // gives thread t all of chunk 4k + t, one 16-byte store each. No shared memory: the Q buffer
  // is the producer's again already.
  T* o_out = static_cast<T*>(params.o);
  const bool odd = (lane & 1) != 0;
  const bool high = (lane & 2) != 0;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int packed_row = consumer_row_start + thread_row0 + 8 * h;
    const int token = DivideByGroup(params, packed_row);
    const int head = work.kv_head * group + (packed_row - token * group);
    const int64_t row_offset = static_cast<int64_t>(work.qo_start + token) * params.num_qo_heads + head;
    const bool store = packed_row < work.row_end;
#pragma unroll
    for (int k = 0; k < kHeadDim / 32; ++k) {
      uint32_t a[4];  // a[c]: columns 8 (4k + c) + 2t, + 1
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int j = 4 * k + c;
        a[c] = PackFloat2<T>(o[4 * j + 2 * h] * inverse[h], o[4 * j + 2 * h + 1] * inverse[h]);
      }
      // With lane ^ 1: the pieces whose chunk parity differs from the thread's.
      uint32_t r0 = __shfl_xor_sync(0xffffffffu, odd ? a[0] : a[1], 1);
      uint32_t r1 = __shfl_xor_sync(0xffffffffu, odd ? a[2] : a[3], 1);
      a[0] = odd ? r0 : a[0];
      a[1] = odd ? a[1] : r0;
      a[2] = odd ? r1 : a[2];
      a[3] = odd ? a[3] : r1;
      // With lane ^ 2: the 2 x 2 blocks off the diagonal. a[c] now holds thread c's 4 bytes.
      r0 = __shfl_xor_sync(0xffffffffu, high ? a[0] : a[2], 2);
      r1 = __shfl_xor_sync(0xffffffffu, high ? a[1] : a[3], 2);
      a[0] = high ? r0 : a[0];
      a[1] = high ? r1 : a[1];
      a[2] = high ? a[2] : r0;
      a[3] = high ? a[3] : r1;
      if (store) {
        *reinterpret_cast<uint4*>(o_out + row_offset * kHeadDim + (4 * k + lane % 4) * 8) =
            make_uint4(a[0], a[1], a[2], a[3]);
      }
    }
    if (params.lse != nullptr && lane % 4 == 0 && store) params.lse[row_offset] = lse[h];
  }
}

// Programmatic dependent launch (launch.cuh): the kernel after this one may be scheduled once
// every CTA of this one ran this; and this thread waits until the kernel before completed and
// its writes are visible (at once after an ordinary launch).
__device__ __forceinline__ void LaunchDependentGrids() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void WaitForPrecedingGrid() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// A consumer warpgroup's part of the CTA: its 64 rows of every work the CTA gets, in order.
// `next_work(round, work)` stores the CTA's round-th work in `work` and says whether there is
// one; from the second round on it has waited for that round's Q full (which also brought the
// work's record). Returns the CTA's KV tiles (the producer's `first` after its last work).
//
// kAcrossWorks: the tile loop does not drain between works. A work's last P V is issued in the
// next work's first turn, just before that work's first Q K^T, and the work's epilogue runs while
// Q K_0^T is on the tensor cores, instead of the last P V, the epilogue and the first Q K^T each
// waiting for the one before. Every work's arithmetic is unchanged, so are the bits. On an H100
// (docs/benchmarks.md) this took 5-7% off prompts of 64 and 128 tokens (works of one KV tile),
// 0.7% slower at two tiles and 1.3% at long works (the same tile loop, compiled differently), so
// the launch takes it only where every work has one tile (plan::PrefillLaunch::short_works).
template <typename Shape, typename T, bool kSoftCap, bool kAcrossWorks, typename NextWork>
__device__ __forceinline__ int ConsumeWorks(const KernelParams& params, uint32_t smem, uint8_t* smem_generic,
                                            NextWork&& next_work) {
  constexpr int kHeadDim = Shape::kHeadDim;
  constexpr int kStages = Shape::kStages;
  constexpr int kTileKv = Shape::kTileKv;
  constexpr int kOut = kHeadDim / 2;  // O accumulators per thread
  constexpr int kScores = kTileKv / 2;  // S accumulators per thread
  const int consumer = threadIdx.x / 128 - 1;
  const int thread = threadIdx.x % 128;
  const int warp = thread / 32;
  const int lane = thread % 32;
  const uint32_t barriers = smem + Shape::kBarrierOffset;
  const SoftmaxParams sp = SoftmaxParams::Of(params.score_scale, params.soft_cap);

  float o[kOut];
#pragma unroll
  for (int i = 0; i < kOut; ++i) o[i] = 0.0f;
  float row_max[2] = {-INFINITY, -INFINITY};
  float row_sum[2] = {0.0f, 0.0f};
  float rescale[2] = {1.0f, 1.0f};
  float s[kScores];  // the first k-step of every Q K^T overwrites it; zeroed so it is never undefined
#pragma unroll
  for (int i = 0; i < kScores; ++i) s[i] = 0.0f;
  uint32_t p[kTileKv / 16][4];  // P of the previous tile as the A operand of m64nDk16, 16 keys per step

  auto issue_pv = [&](int stage) {
    const uint64_t v_descriptor =
        MatrixDescriptor(smem + Shape::kVOffset + stage * Shape::kKvBytes, Shape::kKvBlockBytes, 1024);
    WgmmaFence();
#pragma unroll
    for (int step = 0; step < kTileKv / 16; ++step) {
      WgmmaRS<kHeadDim, T>(o, p[step], AdvanceDescriptor(v_descriptor, step * 16 * 128));
    }
    WgmmaCommit();
  };
  auto convert_p = [&] {
#pragma unroll
    for (int step = 0; step < kTileKv / 16; ++step) {
#pragma unroll
      for (int i = 0; i < 4; ++i) p[step][i] = PackFloat2<T>(s[8 * step + 2 * i], s[8 * step + 2 * i + 1]);
    }
  };
  auto fence_p = [&] {
#pragma unroll
    for (int step = 0; step < kTileKv / 16; ++step) {
#pragma unroll
      for (int i = 0; i < 4; ++i) FenceRegister(p[step][i]);
    }
  };
  // Once the running maxima settle, most tiles move none of the warp's rows: skip multiplying
  // every accumulator by exactly 1 (bitwise the same result, 64 instructions fewer per tile).
  auto rescale_o = [&] {
    if (__any_sync(0xffffffffu, rescale[0] != 1.0f || rescale[1] != 1.0f)) {
#pragma unroll
      for (int i = 0; i < kOut; ++i) o[i] *= rescale[(i / 2) % 2];
    }
  };
  // Releases a stage once this warp's wgmma reads of it have completed (8 arrivals empty it).
  auto release = [&](uint32_t empty) {
    __syncwarp();
    if (lane == 0) MbarrierArrive(empty);
  };
  // Stages and phases by the CTA's tile index g (every work's tiles, in order).
  auto k_full_at = [&](int g) { return barriers + 8 * (g % kStages); };
  auto k_empty_at = [&](int g) { return barriers + 8 * (kStages + g % kStages); };
  auto v_full_at = [&](int g) { return barriers + 8 * (2 * kStages + g % kStages); };
  auto v_empty_at = [&](int g) { return barriers + 8 * (3 * kStages + g % kStages); };
  auto parity_at = [&](int g) { return static_cast<uint32_t>((g / kStages) & 1); };
  // Turn-taking: each consumer waits on its own barrier before issuing and then opens the
  // other's, over the CTA's whole sequence of tiles (every work's, in order), not per work.
  // Consumer 0 opens its own turn once, before the CTA's first tile, and takes the turn consumer
  // 1 opens after the CTA's last tile once its works are done (HopperPrefillKernel), so every
  // phase of both barriers completes and none is left half-arrived. (Per work, with consumer 0
  // reopening itself at each work, a work of one tile let consumer 0 run a whole work ahead: two
  // of its arrivals on consumer 1's barrier then made a phase without consumer 1, whose next sync
  // waited forever: an intermittent hang at 64-token requests, found by the e2e bench on an
  // H100.) Consumer 1 used to skip that last opening instead, which needed the CTA's tile count
  // up front: every work decoded once more before the first.
  const uint32_t my_turn = kTurnBarrier + consumer;
  const uint32_t other_turn = kTurnBarrier + (1 - consumer);

  // The work whose tile loop is over but whose last P V (tile first - 1, V full already waited
  // for) and epilogue are not done yet.
  FinishedWork pending;
  bool has_pending = false;
  auto zero_o = [&] {
#pragma unroll
    for (int i = 0; i < kOut; ++i) o[i] = 0.0f;
  };
  int first = 0;  // the CTA's tiles before this work
  // The pending work's last P V alone, then its epilogue (before a work of no tiles, and at the end).
  auto drain = [&] {
    rescale_o();
    issue_pv((first - 1) % kStages);
    WgmmaWait<0>();
    FenceRegisters(o);
    fence_p();
    release(v_empty_at(first - 1));
    StoreOutputs<Shape, T>(params, pending, o);
    zero_o();
    has_pending = false;
  };

  for (int round = 0;; ++round) {
    CtaWork work;
    if (!next_work(round, work)) break;
    if (first == 0) WaitForPrecedingGrid();
    const int buffer = round % Shape::kQBuffers;
    const uint32_t q_smem = QSmem<Shape>(smem, buffer, consumer);
    const int consumer_row_start = work.row_start + 64 * consumer;

    // --- Q: this consumer's 64 rows. The CTA's first work loads them here, beside the producer's
    // first K tile; the producer loads every later work's into the other buffer early in the one
    // before (ProduceQ), and next_work waited for them.
    if (round == 0) {
      CopyQRows<Shape, T, 64>(params, work, smem, buffer, 64 * consumer, thread);
      CpAsyncWaitAll();
      FenceProxyAsync();  // the copies were generic-proxy writes; wgmma reads through the async proxy
      NamedBarrierSync(kConsumerBarrier + consumer, 128);
    } else {
      FenceProxyAsync();  // as above, for the producer's copies
    }

    // Rows of this thread: g and g + 8 of its warp's 16 (the wgmma accumulator layout).
    int row_position[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int packed = consumer_row_start + 16 * warp + 8 * h + lane / 4;
      row_position[h] = work.position_offset + DivideByGroup(params, packed);
    }

    const uint64_t q_descriptor = MatrixDescriptor(q_smem, 16, 1024);
    auto issue_qk = [&](int stage) {
      const uint64_t k_descriptor = MatrixDescriptor(smem + Shape::kKOffset + stage * Shape::kKvBytes, 16, 1024);
      WgmmaFence();
#pragma unroll
      for (int step = 0; step < kHeadDim / 16; ++step) {
        const uint32_t q_bytes = (step / 4) * Shape::kQBlockBytes + (step % 4) * 32;
        const uint32_t k_bytes = (step / 4) * Shape::kKvBlockBytes + (step % 4) * 32;
        WgmmaSS<kTileKv, T>(s, AdvanceDescriptor(q_descriptor, q_bytes), AdvanceDescriptor(k_descriptor, k_bytes),
                            step > 0 ? 1 : 0);
      }
      WgmmaCommit();
    };
    auto mask = [&](int tile) {
      const int tile_start = work.kv_begin + tile * kTileKv;
      const int tile_end = tile_start + kTileKv;
      // Per-element masking only where some row of the tile can see a masked key.
      const bool needs_mask = tile_end > work.kv_end || (params.causal && tile_end - 1 > work.first_position) ||
                              (params.window_left >= 0 && tile_start < work.last_position - params.window_left);
      if (!needs_mask) return;
      // Per row the keys it sees (VisibleKeys), as offsets from this thread's first key: two
      // compares with constants per element.
      const int base = tile_start + 2 * (lane % 4);
      const KeyRange rows[2] = {VisibleKeys(params, work.kv_end, row_position[0], base),
                                VisibleKeys(params, work.kv_end, row_position[1], base)};
#pragma unroll
      for (int j = 0; j < kTileKv / 8; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int offset = 8 * j + (e % 2);
          if (offset >= rows[e / 2].high || offset < rows[e / 2].low) s[4 * j + e] = -INFINITY;
        }
      }
    };
    // After V of `tile` is full: in a tile that hides keys the producer zeroed V's non-finite
    // values and set their rows' bits (ProduceKv); a row that sees a flagged key gets a NaN sum.
    // Almost always no bit is set: one 16-byte read (8 bytes with 64-key tiles).
    auto mark_bad_v = [&](int tile) {
      const int tile_start = work.kv_begin + tile * kTileKv;
      const bool hides_keys = (params.causal && min(tile_start + kTileKv, work.kv_end) - 1 > work.first_position) ||
                              (params.window_left >= 0 && tile_start < work.last_position - params.window_left);
      if (!hides_keys) return;
      constexpr int kWords = kTileKv / 32;
      const uint8_t* flag_bytes = smem_generic + Shape::kFlagOffset + ((first + tile) % kStages) * Shape::kFlagBytes;
      uint32_t words[kWords];
      if constexpr (kWords == 4) {
        const uint4 bad = *reinterpret_cast<const uint4*>(flag_bytes);
        if ((bad.x | bad.y | bad.z | bad.w) == 0) return;
        words[0] = bad.x;
        words[1] = bad.y;
        words[2] = bad.z;
        words[3] = bad.w;
      } else {
        static_assert(kWords == 2, "flag words");
        const uint2 bad = *reinterpret_cast<const uint2*>(flag_bytes);
        if ((bad.x | bad.y) == 0) return;
        words[0] = bad.x;
        words[1] = bad.y;
      }
      // This thread's keys in word w (offsets 32w + 8i + 2t + e, i < 4, e < 2, t = lane % 4), and a
      // row's visible ones [low, high) as a mask per word.
      const uint32_t mine = 0x03030303u << (2 * (lane % 4));
      auto below = [](int n) { return n <= 0 ? 0u : n >= 32 ? ~0u : (1u << n) - 1u; };  // bits [0, n)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const KeyRange row = VisibleKeys(params, work.kv_end, row_position[h], tile_start);
        uint32_t seen = 0;
#pragma unroll
        for (int w = 0; w < kWords; ++w) seen |= words[w] & mine & below(row.high - 32 * w) & ~below(row.low - 32 * w);
        if (seen != 0) row_sum[h] = NAN;
      }
    };
    auto k_full = [&](int tile) { return k_full_at(first + tile); };
    auto k_empty = [&](int tile) { return k_empty_at(first + tile); };
    auto v_full = [&](int tile) { return v_full_at(first + tile); };
    auto v_empty = [&](int tile) { return v_empty_at(first + tile); };
    auto parity = [&](int tile) { return parity_at(first + tile); };
    auto stage_of = [&](int tile) { return (first + tile) % kStages; };
    auto finished = [&] {
      FinishedWork done;
      done.index = work.index;
      done.kv_head = work.kv_head;
      done.qo_start = work.qo_start;
      done.row_start = consumer_row_start;
      done.row_end = work.row_end;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        done.row_max[h] = row_max[h];
        done.row_sum[h] = row_sum[h];
      }
      return done;
    };

    const int n = work.num_kv_tiles;
    if (n == 0) {
      // No keys: o = 0, lse = -inf (row_max and row_sum are fresh). A pending work stays pending
      // (no wgmma here: a drain in this branch made ptxas serialize every wgmma of the kernel).
      release(QEmpty<Shape>(smem, buffer));
      float no_keys[kOut];
#pragma unroll
      for (int i = 0; i < kOut; ++i) no_keys[i] = 0.0f;
      StoreOutputs<Shape, T>(params, finished(), no_keys);
      continue;
    }
    if (consumer == 0 && first == 0) NamedBarrierArrive(my_turn, 256);
    MbarrierWait(k_full(0), parity(0));
    FenceProxyAsync();
    NamedBarrierSync(my_turn, 256);
    // Each branch waits for its own wgmma groups.
    if (kAcrossWorks && has_pending) {
      // The pending work's last P V first, so that its epilogue can run while Q K_0^T does.
      rescale_o();  // by the pending work's last factor
      issue_pv(stage_of(-1));
      issue_qk(stage_of(0));
      NamedBarrierArrive(other_turn, 256);
      WgmmaWait<1>();  // the pending work's last P V has completed; Q K_0^T may still run
      FenceRegisters(o);
      fence_p();
      release(v_empty(-1));
      StoreOutputs<Shape, T>(params, pending, o);
      zero_o();
      has_pending = false;
      WgmmaWait<0>();
    } else {
      issue_qk(stage_of(0));
      NamedBarrierArrive(other_turn, 256);
      WgmmaWait<0>();
    }
    FenceRegisters(s);
    release(k_empty(0));
    SoftCap<kSoftCap>(s, sp);
    mask(0);
    Softmax(s, row_max, row_sum, rescale, sp);
    convert_p();

    for (int tile = 1; tile < n; ++tile) {
      MbarrierWait(k_full(tile), parity(tile));
      FenceProxyAsync();
      NamedBarrierSync(my_turn, 256);
      issue_qk(stage_of(tile));
      rescale_o();  // by the previous tile's factor, before P_{j-1} V_{j-1} adds to O
      MbarrierWait(v_full(tile - 1), parity(tile - 1));
      FenceProxyAsync();
      issue_pv(stage_of(tile - 1));
      mark_bad_v(tile - 1);
      NamedBarrierArrive(other_turn, 256);
      WgmmaWait<1>();  // Q K_j^T has completed; P_{j-1} V_{j-1} may still run
      FenceRegisters(s);
      release(k_empty(tile));
      SoftCap<kSoftCap>(s, sp);
      mask(tile);
      Softmax(s, row_max, row_sum, rescale, sp);
      WgmmaWait<0>();
      FenceRegisters(o);
      fence_p();
      release(v_empty(tile - 1));
      convert_p();
    }

    // The last tile's V and its bad-value marks now; its P V goes with the next work's first Q K^T.
    MbarrierWait(v_full(n - 1), parity(n - 1));
    FenceProxyAsync();
    mark_bad_v(n - 1);
    // This warp's Q K^T products have completed: the producer may load work round + kQBuffers's
    // rows here (and its record: `pending` keeps what the epilogue needs).
    release(QEmpty<Shape>(smem, buffer));
    pending = finished();
    has_pending = true;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      row_max[h] = -INFINITY;
      row_sum[h] = 0.0f;
    }
    first += n;
    if constexpr (!kAcrossWorks) drain();
  }
  if (kAcrossWorks && has_pending) drain();
  return first;
}

// The kernel's mbarriers (thread 0; SetUpSharedMemory syncs the CTA after).
template <typename Shape>
__device__ __forceinline__ void InitBarriers(uint32_t smem) {
  if (threadIdx.x != 0) return;
  const uint32_t barriers = smem + Shape::kBarrierOffset;
  for (int stage = 0; stage < Shape::kStages; ++stage) {
    MbarrierInit(barriers + 8 * stage, 128);                                    // K full: producer threads
    MbarrierInit(barriers + 8 * (Shape::kStages + stage), 4 * kConsumers);      // K empty: consumer warps
    MbarrierInit(barriers + 8 * (2 * Shape::kStages + stage), 128);             // V full
    MbarrierInit(barriers + 8 * (3 * Shape::kStages + stage), 4 * kConsumers);  // V empty
  }
  for (int buffer = 0; buffer < Shape::kQBuffers; ++buffer) {
    MbarrierInit(QFull<Shape>(smem, buffer), kQFullArrivals);   // producer threads + the record
    MbarrierInit(QEmpty<Shape>(smem, buffer), 4 * kConsumers);  // consumer warps
  }
  FenceMbarrierInit();
}

// The CTA's shared memory from its first 1024-byte boundary (the swizzle phase follows address
// bits 7-9, so every block must sit on one), as a shared-space address and a generic pointer,
// once its mbarriers are initialised and every thread of the CTA sees them.
struct CtaSharedMemory {
  uint32_t smem;
  uint8_t* generic;
};
template <typename Shape>
__device__ __forceinline__ CtaSharedMemory SetUpSharedMemory(uint8_t* shared_bytes) {
  const uint32_t raw = SharedAddress(shared_bytes);
  const uint32_t smem = (raw + 1023) & ~1023u;
  InitBarriers<Shape>(smem);
  __syncthreads();
  return {smem, shared_bytes + (smem - raw)};
}

// T: the type of q, o and the cache (one 16-bit type).
// kAcrossWorks: ConsumeWorks's.
template <typename Shape, typename T, bool kSoftCap, bool kAcrossWorks>
__global__ void __launch_bounds__(kThreads, 1) HopperPrefillKernel(const __grid_constant__ KernelParams params) {
  extern __shared__ __align__(1024) uint8_t shared_bytes[];
  const CtaSharedMemory shared = SetUpSharedMemory<Shape>(shared_bytes);
  const uint32_t smem = shared.smem;
  uint8_t* smem_generic = shared.generic;

  // The role is uniform per warpgroup; the shuffle lets the compiler see that.
  const int warpgroup = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x / 128), 0);
  // Persistent: the CTA walks the launch's work in rounds of the grid size, so the producer loads
  // the next work's keys while the consumers finish the current one. On the grid the planner
  // balanced the items for (params.balanced_grid), CTA b's r-th work is item r * G + b (each
  // round's heaviest to the CTA with the least so far, prefill_plan.cc). On another grid (a
  // caller's max_persistent_ctas, or items the step planner dropped) the layout's rounds are
  // heaviest first by and large, and odd rounds run backwards (CTA b takes the (G-1-b)-th of the
  // round): a plain stride would hand CTA 0 the heaviest of every round; snaking pairs heavy with
  // light. Every work item runs the same code wherever it lands, so the order changes no bits.
  const bool snake = static_cast<int>(gridDim.x) != params.balanced_grid;
  auto work_index = [&](int round) {
    const int b = snake && (round & 1) ? static_cast<int>(gridDim.x) - 1 - static_cast<int>(blockIdx.x)
                                       : static_cast<int>(blockIdx.x);
    return round * static_cast<int>(gridDim.x) + b;
  };
  // Launched as a programmatic dependent of the kernel before it on the stream (the append that
  // wrote q and the new keys, LaunchPrefillHopper): this grid's CTAs may start while that one
  // finishes. Everything up to the first read of q or of the cache (barriers, the work item,
  // which the plan upload wrote before that kernel ran) overlaps its tail; griddepcontrol.wait
  // returns once it completed and its writes are visible (at once after an ordinary launch).
  // Nothing here is written before that wait. The kernel after this one (a merge) may be
  // scheduled once every CTA of this one runs; it waits for this grid's results itself.
  LaunchDependentGrids();
  constexpr bool kQAhead = Shape::kQBuffers > 1;
  if (warpgroup == 0) {
    ReleaseRegisters<kProducerRegisters>();
    int first = 0;
    PendingScan pending;
    for (int round = 0, index = work_index(0); index < params.num_work; index = work_index(++round)) {
      // With two Q buffers, each later work was decoded a work early, its Q rows loaded and its
      // record stored (ProduceQ below): read back here. With one, the work before must release the
      // buffer first: decoded and loaded now.
      const CtaWork work = !kQAhead || round == 0 ? DecodeWork<Shape>(params, index)
                                                  : LoadWork<Shape>(smem_generic, round % Shape::kQBuffers);
      if (first == 0) WaitForPrecedingGrid();
      if (!kQAhead && round > 0) ProduceQ<Shape, T>(params, work, smem, smem_generic, round, pending);
      // The next work's decode (dependent global reads) and Q rows go after this work's first
      // two steps (K_0, then K_1 and V_0): the consumers are then still on the work before, or on this
      // one's first tile, and the stage K_2 waits for is not free yet. Q is in shared memory long
      // before the consumers reach that work.
      const int n = work.num_kv_tiles;
      const int early_steps = min(n + 1, 2);
      ProduceKv<Shape, T>(params, work, smem, first, 0, early_steps, pending, round);
      if constexpr (kQAhead) {
        const int next_index = work_index(round + 1);
        if (next_index < params.num_work) {
          ProduceQ<Shape, T>(params, DecodeWork<Shape>(params, next_index), smem, smem_generic, round + 1, pending);
        }
      }
      ProduceKv<Shape, T>(params, work, smem, first, early_steps, n + 1, pending, round);
      first += n;
    }
    FlushScan<Shape, T>(pending);
    CpAsyncWaitAll();
  } else {
    ClaimRegisters<kConsumerRegisters>();
    // The first work decoded here; every later one read from the record the producer stored
    // with its Q rows.
    const int first = ConsumeWorks<Shape, T, kSoftCap, kAcrossWorks>(params, smem, smem_generic, [&](int round, CtaWork& work) {
      const int index = work_index(round);
      if (index >= params.num_work) return false;
      if (round == 0) {
        work = DecodeWork<Shape>(params, index);
      } else {
        // Fill (round - 1) / kQBuffers of the buffer (the first work's rows are the consumers'
        // own, in buffer 0).
        MbarrierWait(QFull<Shape>(smem, round % Shape::kQBuffers), ((round - 1) / Shape::kQBuffers) & 1);
        work = LoadWork<Shape>(smem_generic, round % Shape::kQBuffers);
      }
      return true;
    });
    // Consumer 1 opened consumer 0's turn after the CTA's last tile: consumer 0 takes it, so
    // that phase completes (see ConsumeWorks's turn-taking).
    if (first > 0 && threadIdx.x / 128 == 1) NamedBarrierSync(kTurnBarrier, 256);
  }
}

// Works on demand (KernelParams::work_counter; BatchPrefillArgs::works_on_demand): the same
// roles, tiles and work items as HopperPrefillKernel, but each CTA takes its next work as it gets
// there, the counter's next index, so that several grids can share a launch's works (a prefill
// beside a decode, then a tail grid on the decode's SMs once it is done) and a CTA that finishes
// early takes more. The main grid's CTA b starts on work b (counter_base is that grid's size);
// a tail grid's CTAs take their first from the counter too (first_from_counter). A kernel of its
// own, so that the fixed layout's kernel carries none of this.
template <typename Shape, typename T, bool kSoftCap>
__global__ void __launch_bounds__(kThreads, 1) HopperPrefillOnDemandKernel(const __grid_constant__ KernelParams params) {
  extern __shared__ __align__(1024) uint8_t shared_bytes[];
  const CtaSharedMemory shared = SetUpSharedMemory<Shape>(shared_bytes);
  const uint32_t smem = shared.smem;
  uint8_t* smem_generic = shared.generic;
  const int warpgroup = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x / 128), 0);
  // A programmatic dependent launch, as HopperPrefillKernel's; here the counter too is read only
  // after the wait (the launch before on it, which resets it as it ends, completed before the
  // preceding grid did).
  LaunchDependentGrids();
  constexpr bool kQAhead = Shape::kQBuffers > 1;
  int first_index = static_cast<int>(blockIdx.x);
  if (params.first_from_counter) {
    // Record 0, first stored for round kWorkRecords.
    int* slot = reinterpret_cast<int*>(smem_generic + Shape::kWorkOffset);
    WaitForPrecedingGrid();
    if (threadIdx.x == 0) *slot = params.counter_base + atomicAdd(params.work_counter, 1);
    __syncthreads();
    first_index = *slot;
    __syncthreads();  // every thread read it before a record may reuse the slot
  }
  if (warpgroup == 0) {
    ReleaseRegisters<kProducerRegisters>();
    int first = 0;
    int next_index = params.num_work;  // thread 0's, taken a round ahead (PublishWork)
    PendingScan pending;
    CtaWork work;
    work.index = -1;
    if (first_index < params.num_work) work = DecodeWork<Shape>(params, first_index);
    for (int round = 0;; ++round) {
      // Read back from the record PublishWork stored in the round before.
      if (round > 0) work = LoadWork<Shape>(smem_generic, round % Shape::kWorkRecords);
      if (work.index < 0) break;
      if (first == 0) WaitForPrecedingGrid();
      if (round == 0 && threadIdx.x == 0) next_index = params.counter_base + atomicAdd(params.work_counter, 1);
      const int n = work.num_kv_tiles;
      if constexpr (kQAhead) {
        // As HopperPrefillKernel: the next work after this one's first two steps.
        const int early_steps = min(n + 1, 2);
        ProduceKv<Shape, T>(params, work, smem, first, 0, early_steps, pending, round);
        PublishWork<Shape, T>(params, next_index, smem, smem_generic, round + 1, pending);
        ProduceKv<Shape, T>(params, work, smem, first, early_steps, n + 1, pending, round);
      } else {
        ProduceKv<Shape, T>(params, work, smem, first, 0, n + 1, pending, round);
        PublishWork<Shape, T>(params, next_index, smem, smem_generic, round + 1, pending);
      }
      first += n;
    }
    FlushScan<Shape, T>(pending);
    FinishWorkCounter(params);
    CpAsyncWaitAll();
  } else {
    ClaimRegisters<kConsumerRegisters>();
    const int first = ConsumeWorks<Shape, T, kSoftCap, false>(params, smem, smem_generic, [&](int round, CtaWork& work) {
      if (round == 0) {
        if (first_index >= params.num_work) return false;
        work = DecodeWork<Shape>(params, first_index);
        return true;
      }
      MbarrierWait(QFull<Shape>(smem, round % Shape::kQBuffers), ((round - 1) / Shape::kQBuffers) & 1);
      work = LoadWork<Shape>(smem_generic, round % Shape::kWorkRecords);
      return work.index >= 0;  // none left
    });
    // As HopperPrefillKernel: consumer 0 takes the turn consumer 1 opened after the last tile.
    if (first > 0 && threadIdx.x / 128 == 1) NamedBarrierSync(kTurnBarrier, 256);
  }
}

}  // namespace attnd::cuda::prefill::hopper
