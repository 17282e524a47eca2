// Fused RoPE + quantise + paged append (DESIGN 4.1). A CTA takes 1 to kTokensPerCta tokens. A
// launch runs up to three "jobs" over them, one after another: MHA q (dense, rotated), k (paged,
// rotated), v (paged); MLA q_pe (dense, rotated), ckv (paged), kpe (paged, rotated). A job's
// rows are walked as 8-element units (one 16-byte input vector each); consecutive lanes take
// consecutive units, so every warp load and store is 512 contiguous bytes. A thread takes its
// units in rounds of kUnitsInFlight, and where a job has no rotation or neox over the whole head
// a round's units run one branch-free path, so the compiler interleaves them. A neox partner
// vector comes from the lane that loaded it (a row of up to 32 units lies in one warp, and the
// partner unit is rope_pairs / 8 lanes away), by shuffles rather than a second load. The CTA
// looks up each token's slot and computes its rotary cos/sin once (shared by every head), in
// float (rope_angles.h), while the first loads are out.
// Each thread's rounds are double-buffered in shared memory (the ring: the next round's copies are
// out while this one is transformed). Up to 1024 tokens each CTA runs one job of its tokens;
// beyond, every job.
#include <cuda_runtime.h>

#include "absl/strings/str_cat.h"
#include "attnd/kernels/cuda/append.h"
#include "attnd/kernels/cuda/cuda_check.h"
#include "attnd/status_macros.h"
#include "cp_async.cuh"
#include "rope_angles.h"
#include "vec.cuh"

namespace attnd::cuda {
namespace {

constexpr int kAppendThreads = 256;
constexpr int kTokensPerCta = 4;  // at most (AppendParams::tokens_per_cta)
constexpr int kMaxRopePairs = 128;  // rotary_dim <= 256
constexpr int kUnit = 8;            // elements of one unit
constexpr int kUnitsInFlight = 4;   // units a thread loads before transforming them
constexpr int kMaxJobs = 3;
struct AppendJob {
  const void* in;           // [T][num_heads][width], the input dtype; null: job absent
  void* out;                // dense: [T][num_heads][width] (input dtype); paged: the pool
  const int32_t* page_ids;  // paged: the K or V page ids; null: dense output
  // Paged: element strides of (page, entry, head) in the pool.
  int64_t page_stride;
  int64_t entry_stride;
  int64_t head_stride;
  int32_t num_heads;
  int32_t width;
  int32_t log2_units_per_row;  // width / 8 is a power of two (widths 16..512)
  int32_t units_per_token;     // 0: job absent
  bool rotate;
  float scale;          // paged: stores value / scale ...
  float inverse_scale;  // ... computed as a correctly rounded quotient from 1 / scale
};

struct AppendParams {
  AppendJob jobs[kMaxJobs];
  int64_t num_tokens;
  const int32_t* batch_indices;
  const int32_t* positions;
  const int32_t* page_indptr;
  int32_t log2_page_size;
  const float* inv_freq;
  int32_t rope_pairs;  // 0: no rotation
  bool interleaved;
  // Small steps (decode): each CTA runs one job (blockIdx.y) of its tokens, so q, k and v run
  // side by side instead of one after another in a few CTAs.
  bool split_jobs;
  // Tokens a CTA takes: 1, 2 or kTokensPerCta (small steps: more CTAs, each shorter).
  int32_t tokens_per_cta;
};

// Whether a rotated job's neox partners come by shuffle: the half rotary width a whole number of
// units (so a unit's partner is one unit), and a row within one warp (at most 32 units, rows
// start at multiples of their power-of-two unit count).
__host__ __device__ __forceinline__ bool ShufflePartners(const AppendParams& params, const AppendJob& job) {
  return job.rotate && !params.interleaved && params.rope_pairs > 0 && params.rope_pairs % 8 == 0 &&
         job.log2_units_per_row <= 5;
}

template <typename T>
__device__ __forceinline__ float LoadOne(const T* source) {
  return static_cast<float>(*source);
}

// value / scale, correctly rounded, from the reciprocal: q = value * (1/scale) is within an ulp,
// the residual value - q * scale is exact in one FMA, and one correction step rounds correctly
// (Markstein): three instructions instead of a full division.
__device__ __forceinline__ float DivideByScale(float value, float scale, float inverse_scale) {
  const float quotient = value * inverse_scale;
  const float residual = fmaf(-quotient, scale, value);
  return fmaf(residual, inverse_scale, quotient);
}

// Where unit `index` of a job's units in a CTA lies: token in the CTA, head, first dim.
struct Unit {
  int token;
  int head;
  int first_dim;
};

__device__ __forceinline__ Unit Locate(const AppendJob& job, int index) {
  // index < kTokensPerCta * units_per_token: the token by comparisons, not a division.
  const int per_token = job.units_per_token;
  Unit unit;
  unit.token = 0;
#pragma unroll
  for (int t = 1; t < kTokensPerCta; ++t) unit.token += index >= t * per_token;
  const int in_token = index - unit.token * per_token;
  unit.head = in_token >> job.log2_units_per_row;
  unit.first_dim = (in_token - (unit.head << job.log2_units_per_row)) * kUnit;
  return unit;
}

template <typename InT>
__device__ __forceinline__ const InT* InputRow(const AppendJob& job, const Unit& unit, int64_t first_token) {
  return static_cast<const InT*>(job.in) +
         ((first_token + unit.token) * job.num_heads + unit.head) * static_cast<int64_t>(job.width);
}

// The neox partner of a unit is one aligned vector when the half rotary width is a multiple of 8.
__device__ __forceinline__ bool HasVectorPartner(const AppendParams& params, const Unit& unit) {
  return !params.interleaved && params.rope_pairs % kUnit == 0 &&
         unit.first_dim + kUnit <= 2 * params.rope_pairs;
}

// Neox rotation of a unit lying wholly in one half of the rotary range: x[k] pairs with
// partner[k], at the angles of `unit_angles` (the unit's 8 (cos, sin) pairs, four 16-byte loads).
// Products and sums are rounded separately (no FMA contraction), as the reference's float
// arithmetic does, so both store the same bits for the same cos/sin.
__device__ __forceinline__ void RotateNeoxUnit(float* x, const float* partner, const float4* unit_angles,
                                               bool first_half) {
#pragma unroll
  for (int k = 0; k < kUnit; k += 2) {
    const float4 two = unit_angles[k / 2];
    const float cosines[2] = {two.x, two.z};
    const float sines[2] = {two.y, two.w};
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float product_cos = __fmul_rn(x[k + h], cosines[h]);
      const float product_sin = __fmul_rn(partner[k + h], sines[h]);
      x[k + h] = first_half ? __fsub_rn(product_cos, product_sin) : __fadd_rn(product_sin, product_cos);
    }
  }
}

// The 16-byte unit of lane `source`.
__device__ __forceinline__ uint4 ShuffleUnit(const uint4& value, int source) {
  return make_uint4(__shfl_sync(0xffffffffu, value.x, source), __shfl_sync(0xffffffffu, value.y, source),
                    __shfl_sync(0xffffffffu, value.z, source), __shfl_sync(0xffffffffu, value.w, source));
}

// Rotates the elements of x (dims [first_dim, first_dim + 8) of `row`) in the rotary range.
// Products and sums are rounded separately (no FMA contraction), as the reference's float
// arithmetic does, so both store the same bits for the same cos/sin.
// partner_raw: the unit's neox partner vector when ShufflePartners holds (else unused; the
// partner is read from `row`).
template <typename InT>
__device__ __forceinline__ void Rotate8(float* x, const AppendParams& params, const Unit& unit,
                                        const InT* row, const float2* angles, bool shuffled,
                                        const uint4& partner_raw) {
  const int pairs = params.rope_pairs;
  const int rotary_dim = 2 * pairs;
  const int first_dim = unit.first_dim;
  if (params.interleaved) {
    if (first_dim + kUnit <= rotary_dim) {
      // The whole unit rotates: its 4 pairs' angles are two 16-byte loads.
      const float4* pair_angles = reinterpret_cast<const float4*>(angles + first_dim / 2);
#pragma unroll
      for (int k = 0; k < kUnit; k += 4) {
        const float4 two = pair_angles[k / 4];
        const float cosines[2] = {two.x, two.z};
        const float sines[2] = {two.y, two.w};
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const float first = x[k + 2 * h];
          const float second = x[k + 2 * h + 1];
          x[k + 2 * h] = __fsub_rn(__fmul_rn(first, cosines[h]), __fmul_rn(second, sines[h]));
          x[k + 2 * h + 1] = __fadd_rn(__fmul_rn(first, sines[h]), __fmul_rn(second, cosines[h]));
        }
      }
      return;
    }
#pragma unroll
    for (int k = 0; k < kUnit; k += 2) {
      const int dim = first_dim + k;
      if (dim < rotary_dim) {
        const float2 angle = angles[dim / 2];
        const float first = x[k];
        const float second = x[k + 1];
        x[k] = __fsub_rn(__fmul_rn(first, angle.x), __fmul_rn(second, angle.y));
        x[k + 1] = __fadd_rn(__fmul_rn(first, angle.y), __fmul_rn(second, angle.x));
      }
    }
    return;
  }
  // Neox: dim pairs (i, i + pairs).
  float partner[kUnit];
  if (HasVectorPartner(params, unit)) {
    // The unit lies wholly in one half: its 8 angles are four 16-byte loads, no per-dim tests.
    // The partner vector came by shuffle, or (rows wider than a warp) is part of a row this warp
    // has just loaded: an L1 hit.
    const int partner_dim = first_dim < pairs ? first_dim + pairs : first_dim - pairs;
    Raw8ToFloat<InT>(shuffled ? partner_raw : *reinterpret_cast<const uint4*>(row + partner_dim), partner);
    const bool first_half = first_dim < pairs;
    RotateNeoxUnit(x, partner, reinterpret_cast<const float4*>(angles + (first_half ? first_dim : first_dim - pairs)),
                   first_half);
    return;
  }
  // General case (the half width not a multiple of 8, or a unit across the rotary end):
  // partners one by one.
#pragma unroll
  for (int k = 0; k < kUnit; ++k) {
    const int dim = first_dim + k;
    partner[k] = dim < rotary_dim ? LoadOne(row + (dim < pairs ? dim + pairs : dim - pairs)) : 0.0f;
  }
#pragma unroll
  for (int k = 0; k < kUnit; ++k) {
    const int dim = first_dim + k;
    if (dim < pairs) {
      const float2 angle = angles[dim];
      x[k] = __fsub_rn(__fmul_rn(x[k], angle.x), __fmul_rn(partner[k], angle.y));
    } else if (dim < rotary_dim) {
      const float2 angle = angles[dim - pairs];
      x[k] = __fadd_rn(__fmul_rn(partner[k], angle.y), __fmul_rn(x[k], angle.x));
    }
  }
}

// Per-CTA state shared by the jobs.
struct AppendShared {
  float2 angles[kTokensPerCta][kMaxRopePairs];  // (cos, sin) per token and pair
  // Per job and token: paged jobs, the element offset of the token's slot in the pool (page *
  // page_stride + entry * entry_stride); -1: padding, nothing to write.
  int64_t slot_offset[kMaxJobs][kTokensPerCta];
};

// Quantises (paged jobs) and stores the 8 values `x` of one unit of job kJob; `active` says whether
// the lane's unit is written. Only the stores depend on it, so a caller's units need no branch
// around it.
template <int kJob, typename InT, typename CacheT>
__device__ __forceinline__ void WriteUnit(const AppendParams& params, int64_t first_token, const Unit& unit,
                                          int64_t slot_offset, bool active, float (&x)[kUnit]) {
  constexpr bool kFp8Cache = sizeof(CacheT) == 1;
  const AppendJob& job = params.jobs[kJob];
  if (kJob == 0 || job.page_ids == nullptr) {  // job 0 is dense (LaunchAppend)
    if (active) {
      *reinterpret_cast<uint4*>(static_cast<InT*>(job.out) +
                                ((first_token + unit.token) * job.num_heads + unit.head) *
                                    static_cast<int64_t>(job.width) +
                                unit.first_dim) = FloatToRaw8<InT>(x);
    }
    return;
  }
  if (job.scale != 1.0f) {
#pragma unroll
    for (int k = 0; k < kUnit; ++k) x[k] = DivideByScale(x[k], job.scale, job.inverse_scale);
  }
  CacheT* const destination =
      static_cast<CacheT*>(job.out) + slot_offset + unit.head * job.head_stride + unit.first_dim;
  if constexpr (kFp8Cache) {
    // 8 bytes a lane: a warp's units of a row are still one contiguous range, and pairing lanes
    // into 16-byte stores by shuffle cost more than it saved (f16 -> fp8 at 4096 tokens on an
    // H100: 80.1% of copy paired, 81.3% not).
    if (active) *reinterpret_cast<uint2*>(destination) = FloatToRaw8<CacheT>(x);
  } else {
    if (active) *reinterpret_cast<uint4*>(destination) = FloatToRaw8<CacheT>(x);
  }
}

// Rotates (where the job does), quantises and stores one unit of job kJob. Every lane of the warp
// calls it; `active` says whether the lane's unit is written. `row()`: the unit's input row, where
// a partner that did not come by shuffle is read; only evaluated where it is needed, so it holds
// no registers otherwise.
template <int kJob, typename InT, typename CacheT, typename RowFn>
__device__ __forceinline__ void StoreUnit(const AppendParams& params, const AppendShared& shared,
                                          int64_t first_token, const Unit& unit, int64_t slot_offset,
                                          bool active, const uint4& raw, RowFn row, bool shuffled,
                                          const uint4& partner_raw) {
  const AppendJob& job = params.jobs[kJob];
  float x[kUnit];
  Raw8ToFloat<InT>(raw, x);
  if (active && job.rotate && unit.first_dim < 2 * params.rope_pairs) {
    Rotate8<InT>(x, params, unit, row(), shared.angles[unit.token], shuffled, partner_raw);
  }
  WriteUnit<kJob, InT, CacheT>(params, first_token, unit, slot_offset, active, x);
}

// Calls fetch(r, source) for each unit of this thread in job kJob's round `base` that holds input:
// r, the unit's slot in the round; source, its 16 input bytes.
template <int kJob, typename InT, typename Fetch>
__device__ __forceinline__ void ForRoundUnits(const AppendParams& params, int base, int64_t first_token,
                                              int tokens_here, Fetch fetch) {
  const AppendJob& job = params.jobs[kJob];
  const int units = tokens_here * job.units_per_token;
#pragma unroll
  for (int r = 0; r < kUnitsInFlight; ++r) {
    const int index = base + r * kAppendThreads + threadIdx.x;
    if (index >= units) continue;
    const Unit unit = Locate(job, index);
    fetch(r, InputRow<InT>(job, unit, first_token) + unit.first_dim);
  }
}

// The register kernel's ring: per thread, two rounds of units in shared memory, so that
// the next round's loads (cp.async) are out while this one is rotated and stored. Copies are
// cached in L1 too: partners not shuffled are read through global memory right after.
struct UnitRing {
  uint4 units[2][kUnitsInFlight][kAppendThreads];
};

template <int kJob, typename InT>
__device__ __forceinline__ void CopyUnits(const AppendParams& params, int base, int64_t first_token,
                                          int tokens_here, UnitRing& ring, int stage) {
  ForRoundUnits<kJob, InT>(params, base, first_token, tokens_here, [&](int r, const InT* source) {
    CpAsync16CacheAll(&ring.units[stage][r][threadIdx.x], source);
  });
}

// Issues round (job, base)'s copies into `stage` as one commit group (empty for job kMaxJobs).
template <typename InT>
__device__ __forceinline__ void IssueRound(const AppendParams& params, int job, int base, int64_t first_token,
                                           int tokens_here, UnitRing& ring, int stage) {
  if (job == 0) {
    CopyUnits<0, InT>(params, base, first_token, tokens_here, ring, stage);
  } else if (job == 1) {
    CopyUnits<1, InT>(params, base, first_token, tokens_here, ring, stage);
  } else if (job == 2) {
    CopyUnits<2, InT>(params, base, first_token, tokens_here, ring, stage);
  }
  CpAsyncCommit();
}

// The first job at or after `job` with units; kMaxJobs if none.
__device__ __forceinline__ int PresentJob(const AppendParams& params, int job) {
  while (job < kMaxJobs && params.jobs[job].units_per_token == 0) ++job;
  return job;
}

// Unit `index` of job kJob's `units` in a round (every lane calls it, the lanes past `units` too):
// where it lies, its slot (paged jobs) and whether it is written.
struct RoundUnit {
  Unit unit;
  int64_t slot_offset;
  bool active;
};

template <int kJob>
__device__ __forceinline__ RoundUnit LocateRoundUnit(const AppendParams& params, const AppendShared& shared,
                                                     int units, int index) {
  RoundUnit round_unit;
  round_unit.unit = Locate(params.jobs[kJob], index < units ? index : 0);
  round_unit.slot_offset = shared.slot_offset[kJob][round_unit.unit.token];
  round_unit.active = index < units && round_unit.slot_offset >= 0;
  return round_unit;
}

// Whether job kJob's rounds can take TransformRoundUniform: no rotation, or neox over the whole
// head with partners by shuffle (the models' usual RoPE). Uniform across the CTA.
template <int kJob>
__device__ __forceinline__ bool UniformRounds(const AppendParams& params) {
  const AppendJob& job = params.jobs[kJob];
  return !job.rotate || (ShufflePartners(params, job) && 2 * params.rope_pairs == job.width);
}

// One round of job kJob's units (those of `value`, from unit `base` on) where UniformRounds holds:
// every unit of the round takes the same path, and nothing but the stores depends on whether a
// lane's unit exists, so the compiler can interleave the round's units (each unit's own chain of
// slot lookup, shuffles, angle loads, products and store is long; in the general path each unit
// is a branch of its own, and the units of a round ran one after another).
template <int kJob, typename InT, typename CacheT>
__device__ __forceinline__ void TransformRoundUniform(const AppendParams& params, const AppendShared& shared,
                                                      int64_t first_token, int tokens_here, int base,
                                                      const uint4 (&value)[kUnitsInFlight]) {
  const AppendJob& job = params.jobs[kJob];
  const int units = tokens_here * job.units_per_token;  // of the tokens present
  const int pairs = params.rope_pairs;
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int r = 0; r < kUnitsInFlight; ++r) {
    // Uniform across the CTA, so the shuffles have every lane.
    if (base + r * kAppendThreads >= units) break;
    const int index = base + r * kAppendThreads + threadIdx.x;
    const RoundUnit at = LocateRoundUnit<kJob>(params, shared, units, index);
    const Unit& unit = at.unit;
    float x[kUnit];
    Raw8ToFloat<InT>(value[r], x);
    if (job.rotate) {
      // Neox over the whole row: the partner unit is pairs / 8 lanes away, in the same warp.
      const bool first_half = unit.first_dim < pairs;
      const int source = first_half ? lane + pairs / kUnit : lane - pairs / kUnit;
      float partner[kUnit];
      Raw8ToFloat<InT>(ShuffleUnit(value[r], source), partner);
      const int first_pair = first_half ? unit.first_dim : unit.first_dim - pairs;
      RotateNeoxUnit(x, partner, reinterpret_cast<const float4*>(shared.angles[unit.token] + first_pair), first_half);
    }
    WriteUnit<kJob, InT, CacheT>(params, first_token, unit, at.slot_offset, at.active, x);
  }
}

// Transforms and stores job kJob's units of the CTA's tokens; the job index is a template
// parameter so every job field is a constant-bank operand, not a computed load. Each round's units
// come from the ring (`stage` is this round's half), and the round after it, this job's next or
// the next job's first (none where each CTA runs one job), is issued into the other half first.
template <int kJob, typename InT, typename CacheT>
__device__ __forceinline__ void RunJob(const AppendParams& params, const AppendShared& shared,
                                       int64_t first_token, int tokens_here, UnitRing& ring, int& stage) {
  constexpr bool kFp8Cache = sizeof(CacheT) == 1;
  const AppendJob& job = params.jobs[kJob];
  // The units of the tokens present: rounds and units past them (a step's last CTA) are not run.
  const int units = tokens_here * job.units_per_token;
  for (int base = 0; base < units; base += kUnitsInFlight * kAppendThreads) {
    int next_job = kJob, next_base = base + kUnitsInFlight * kAppendThreads;
    if (next_base >= units) {
      next_base = 0;
      next_job = params.split_jobs ? kMaxJobs : PresentJob(params, kJob + 1);
    }
    IssueRound<InT>(params, next_job, next_base, first_token, tokens_here, ring, stage ^ 1);
    CpAsyncWait<1>();
    uint4 value[kUnitsInFlight];
#pragma unroll
    for (int r = 0; r < kUnitsInFlight; ++r) value[r] = ring.units[stage][r][threadIdx.x];
    stage ^= 1;
    if (UniformRounds<kJob>(params)) {
      TransformRoundUniform<kJob, InT, CacheT>(params, shared, first_token, tokens_here, base, value);
      continue;
    }
#pragma unroll
    for (int r = 0; r < kUnitsInFlight; ++r) {
      // Uniform across the CTA, so the shuffle below has every lane.
      if (base + r * kAppendThreads >= units) break;
      const int index = base + r * kAppendThreads + threadIdx.x;
      const RoundUnit at = LocateRoundUnit<kJob>(params, shared, units, index);
      const Unit& unit = at.unit;
      // Uniform across the CTA (a job's fields), so every lane takes part in the shuffles. The
      // paged jobs of FP8 caches keep the L1 partner load here (by shuffle too, f16 -> fp8 steps
      // of 1024-16384 tokens ran 0.3-1% slower on an H100).
      const bool shuffled = (!kFp8Cache || kJob == 0) && ShufflePartners(params, job);
      uint4 partner_raw = make_uint4(0, 0, 0, 0);
      if (shuffled) {
        // Lanes of units outside the rotary range (or of the rotary end) read themselves.
        const int partner_units = params.rope_pairs / kUnit;
        const int first_units = unit.first_dim / kUnit;
        const int lane = threadIdx.x % 32;
        const int source = index >= units                     ? lane
                           : first_units < partner_units       ? lane + partner_units
                           : first_units < 2 * partner_units ? lane - partner_units
                                                              : lane;
        partner_raw = ShuffleUnit(value[r], source);
      }
      StoreUnit<kJob, InT, CacheT>(
          params, shared, first_token, unit, at.slot_offset, at.active, value[r],
          [&] { return InputRow<InT>(job, unit, first_token); }, shuffled, partner_raw);
    }
  }
}

// The CTA's per-token state: each token's slot offset per job (threads 0..3) and its rotary cos/sin
// per pair, into `shared`; the caller syncs before reading them. `only_job`: the one job of a
// split-jobs CTA, or -1 for all; a CTA of one unrotated job (v) needs no angles.
__device__ __forceinline__ void PrepareTokens(const AppendParams& params, AppendShared& shared,
                                              int64_t first_token, int tokens_here, int only_job) {
  if (threadIdx.x < kTokensPerCta) {
    int32_t slot = -1;
    int32_t entry = 0;
    if (static_cast<int>(threadIdx.x) < tokens_here) {
      const int32_t request = params.batch_indices[first_token + threadIdx.x];
      if (request >= 0) {  // -1 is a padding slot: no byte of it is touched
        const int32_t position = params.positions[first_token + threadIdx.x];
        slot = params.page_indptr[request] + (position >> params.log2_page_size);
        entry = position & ((1 << params.log2_page_size) - 1);
      }
    }
#pragma unroll
    for (int j = 0; j < kMaxJobs; ++j) {
      const AppendJob& job = params.jobs[j];
      int64_t offset = slot < 0 ? -1 : 0;
      if (slot >= 0 && job.page_ids != nullptr) {
        offset = int64_t{job.page_ids[slot]} * job.page_stride + entry * job.entry_stride;
      }
      shared.slot_offset[j][threadIdx.x] = offset;
    }
  }
  const int angle_pairs = only_job >= 0 && !params.jobs[only_job].rotate ? 0 : params.rope_pairs;
  for (int i = threadIdx.x; i < kTokensPerCta * angle_pairs; i += kAppendThreads) {
    const int t = i / params.rope_pairs;
    const int pair = i - t * params.rope_pairs;
    if (t < tokens_here && params.batch_indices[first_token + t] >= 0) {
      // Angle in float32 as the reference computes it, float(position) * inv_freq; cos and sin
      // within 2^-23 of the exact values (rope_angles.h; the reference's are correctly rounded).
      const float angle = __fmul_rn(static_cast<float>(params.positions[first_token + t]), params.inv_freq[pair]);
      const rope::CosSin value = rope::RopeCosSin(angle);
      shared.angles[t][pair] = make_float2(value.cos, value.sin);
    }
  }
}

template <typename InT, typename CacheT>
__global__ void __launch_bounds__(kAppendThreads, 4) AppendKvKernel(const AppendParams params) {
  __shared__ __align__(16) AppendShared shared;
  __shared__ __align__(16) UnitRing ring;

  // The attention kernel after it (decode) may be scheduled once every CTA of this grid runs;
  // it waits (griddepcontrol.wait) for this grid's results before it reads them.
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
  const int64_t first_token = static_cast<int64_t>(blockIdx.x) * params.tokens_per_cta;
  const int tokens_here =
      static_cast<int>(min(static_cast<int64_t>(params.tokens_per_cta), params.num_tokens - first_token));

  // The first round's copies go out before the CTA waits for its tokens' slots and angles.
  const int first_job = params.split_jobs ? static_cast<int>(blockIdx.y) : PresentJob(params, 0);
  IssueRound<InT>(params, params.split_jobs && params.jobs[first_job].units_per_token == 0 ? kMaxJobs : first_job, 0,
                  first_token, tokens_here, ring, 0);
  PrepareTokens(params, shared, first_token, tokens_here, params.split_jobs ? first_job : -1);
  __syncthreads();

  int stage = 0;
  if (!params.split_jobs) {
    RunJob<0, InT, CacheT>(params, shared, first_token, tokens_here, ring, stage);
    RunJob<1, InT, CacheT>(params, shared, first_token, tokens_here, ring, stage);
    RunJob<2, InT, CacheT>(params, shared, first_token, tokens_here, ring, stage);
  } else if (first_job == 0) {
    RunJob<0, InT, CacheT>(params, shared, first_token, tokens_here, ring, stage);
  } else if (first_job == 1) {
    RunJob<1, InT, CacheT>(params, shared, first_token, tokens_here, ring, stage);
  } else {
    RunJob<2, InT, CacheT>(params, shared, first_token, tokens_here, ring, stage);
  }
  CpAsyncWait<0>();
}

using AppendKernelFn = void (*)(AppendParams);

template <typename InT>
AppendKernelFn PickCache(DType cache_dtype) {
  switch (cache_dtype) {
    case DType::kFloat16:
      return &AppendKvKernel<InT, __half>;
    case DType::kBFloat16:
      return &AppendKvKernel<InT, __nv_bfloat16>;
    case DType::kFloat8E4M3:
      return &AppendKvKernel<InT, __nv_fp8_e4m3>;
    case DType::kFloat32:
      return nullptr;
  }
  return nullptr;
}

AppendKernelFn PickAppendKernel(DType in_dtype, DType cache_dtype) {
  if (in_dtype == DType::kFloat16) return PickCache<__half>(cache_dtype);
  if (in_dtype == DType::kBFloat16) return PickCache<__nv_bfloat16>(cache_dtype);
  return nullptr;
}

bool Aligned16(const void* pointer) { return reinterpret_cast<uintptr_t>(pointer) % 16 == 0; }

absl::Status CheckInput(const char* name, const TokenHeadsView& view, int64_t num_tokens,
                        DType dtype) {
  if (view.data == nullptr) return absl::InvalidArgumentError(absl::StrCat(name, ": null data"));
  if (view.num_tokens != num_tokens) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": ", view.num_tokens,
                                                   " tokens, expected ", num_tokens));
  }
  if (view.dtype != dtype) {
    return absl::InvalidArgumentError(absl::StrCat(name, ".dtype: expected ", DTypeName(dtype),
                                                   ", got ", DTypeName(view.dtype)));
  }
  const int32_t units_per_row = view.head_dim / kUnit;
  if (view.num_heads <= 0 || view.head_dim < 2 * kUnit || view.head_dim % kUnit != 0 ||
      (units_per_row & (units_per_row - 1)) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": heads ", view.num_heads,
                                                   ", head_dim ", view.head_dim,
                                                   " (8 times a power of two, at least 16)"));
  }
  if (!Aligned16(view.data)) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": not 16-byte aligned"));
  }
  return absl::OkStatus();
}

absl::Status CheckPool(const char* name, const PagedKvView& pool, const TokenHeadsView& in,
                       DType cache_dtype, int32_t page_size) {
  if (pool.data == nullptr || !Aligned16(pool.data)) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": null or not 16-byte aligned"));
  }
  if (pool.dtype != cache_dtype || pool.page_size != page_size) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": dtype ", DTypeName(pool.dtype),
                                                   " page_size ", pool.page_size, ", expected ",
                                                   DTypeName(cache_dtype), " and ", page_size));
  }
  if (pool.num_heads != in.num_heads || pool.head_dim != in.head_dim) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": [", pool.num_heads, "][",
                                                   pool.head_dim, "] per token, input has [",
                                                   in.num_heads, "][", in.head_dim, "]"));
  }
  return absl::OkStatus();
}

AppendJob DenseJob(const TokenHeadsView& in, const TokenHeadsView& out, bool rotate) {
  AppendJob job{};
  job.in = in.data;
  job.out = out.data;
  job.num_heads = in.num_heads;
  job.width = in.head_dim;
  const int32_t units_per_row = in.head_dim / kUnit;
  while ((1 << job.log2_units_per_row) < units_per_row) ++job.log2_units_per_row;
  job.units_per_token = in.num_heads * units_per_row;
  job.rotate = rotate;
  job.scale = 1.0f;
  job.inverse_scale = 1.0f;
  return job;
}

AppendJob PagedJob(const TokenHeadsView& in, const PagedKvView& pool, const int32_t* page_ids,
                   bool rotate, float scale) {
  AppendJob job = DenseJob(in, TokenHeadsView{}, rotate);
  job.out = pool.data;
  job.page_ids = page_ids;
  job.page_stride = pool.PageElements();
  if (pool.layout == KvLayout::kNHD) {
    job.entry_stride = int64_t{pool.num_heads} * pool.head_dim;
    job.head_stride = pool.head_dim;
  } else {
    job.entry_stride = pool.head_dim;
    job.head_stride = int64_t{pool.page_size} * pool.head_dim;
  }
  job.scale = scale;
  job.inverse_scale = 1.0f / scale;
  return job;
}

// Shared checks and launch of both entry points.
absl::Status LaunchAppend(AppendParams& params, const AppendIndexView& tokens,
                          const PageTableView& pages, RopeStyle rope_style,
                          const float* inv_freq, int32_t rotary_dim, DType in_dtype,
                          DType cache_dtype, cudaStream_t stream) {
  if (tokens.num_tokens == 0) return absl::OkStatus();
  if (tokens.batch_indices == nullptr || tokens.positions == nullptr || pages.indptr == nullptr ||
      pages.k_indices == nullptr || pages.v_indices == nullptr) {
    return absl::InvalidArgumentError("append: null token list or page table");
  }
  const int32_t page_size = pages.page_size;
  if (page_size <= 0 || (page_size & (page_size - 1)) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("page_size: expected a power of two, got ", page_size));
  }
  if (rope_style != RopeStyle::kNone) {
    if (rotary_dim <= 0 || rotary_dim % 2 != 0 || rotary_dim > 2 * kMaxRopePairs ||
        inv_freq == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(
          "rotary_dim: expected an even 2..256 with its inv_freq table, got ", rotary_dim));
    }
    for (const AppendJob& job : params.jobs) {
      if (job.in != nullptr && job.rotate && rotary_dim > job.width) {
        return absl::InvalidArgumentError(absl::StrCat("rotary_dim ", rotary_dim,
                                                       " exceeds a rotated head of ", job.width));
      }
    }
    params.inv_freq = inv_freq;
    params.rope_pairs = rotary_dim / 2;
    params.interleaved = rope_style == RopeStyle::kInterleaved;
  } else {
    for (AppendJob& job : params.jobs) job.rotate = false;
  }
  if (params.jobs[0].page_ids != nullptr) return absl::InternalError("append: job 0 must be dense");
  for (const AppendJob& job : params.jobs) {
    if (job.page_ids != nullptr && !(job.scale > 0.0f)) {
      return absl::InvalidArgumentError(absl::StrCat("scale: expected > 0, got ", job.scale));
    }
  }
  params.num_tokens = tokens.num_tokens;
  params.batch_indices = tokens.batch_indices;
  params.positions = tokens.positions;
  params.page_indptr = pages.indptr;
  params.log2_page_size = 0;
  while ((1 << params.log2_page_size) < page_size) ++params.log2_page_size;

  // Small steps run short CTAs, more of them (H100, 2026-11-27, f16 -> fp8 against 4 tokens a CTA:
  // 16 tokens 6.18 -> 3.73 us, 128 tokens 6.96 -> 5.15, 512 tokens 10.64 -> 10.23; 2 tokens a CTA
  // lost at 1024 and beyond).
  params.tokens_per_cta = tokens.num_tokens <= 128 ? 1 : tokens.num_tokens <= 512 ? 2 : kTokensPerCta;
  const int64_t num_ctas = (tokens.num_tokens + params.tokens_per_cta - 1) / params.tokens_per_cta;
  // Up to 1024 tokens the grid is too small to hide a CTA's dependent phases (slot lookup,
  // angles, then each job's loads and stores): one job per CTA.
  params.split_jobs = tokens.num_tokens <= 1024;
  // Every step size runs this one kernel (H100, 2026-11-27, against the kernel with its own
  // shared memory stage of each CTA's whole rows it replaced past 8192 tokens: 16384 tokens
  // f16 -> fp8 93% of copy against 83%, bf16 99% against 87%).
  const AppendKernelFn kernel = PickAppendKernel(in_dtype, cache_dtype);
  if (kernel == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("append: no kernel for ", DTypeName(in_dtype),
                                                   " -> ", DTypeName(cache_dtype)));
  }
  void* kernel_args[] = {&params};
  const dim3 grid(static_cast<unsigned>(num_ctas), params.split_jobs ? kMaxJobs : 1);
  CUDA_RETURN_IF_ERROR(cudaLaunchKernel(reinterpret_cast<const void*>(kernel), grid,
                                        dim3(kAppendThreads), kernel_args, 0, stream));
  return absl::OkStatus();
}

}  // namespace

absl::Status AppendKv(const AppendKvArgs& args, cudaStream_t stream) {
  const int64_t num_tokens = args.tokens.num_tokens;
  if (num_tokens == 0) return absl::OkStatus();
  const DType in_dtype = args.k_in.dtype;
  if (in_dtype != DType::kFloat16 && in_dtype != DType::kBFloat16) {
    return absl::InvalidArgumentError(absl::StrCat("k_in.dtype: expected float16 or bfloat16, got ",
                                                   DTypeName(in_dtype)));
  }
  RETURN_IF_ERROR(CheckInput("k_in", args.k_in, num_tokens, in_dtype));
  RETURN_IF_ERROR(CheckInput("v_in", args.v_in, num_tokens, in_dtype));
  RETURN_IF_ERROR(
      CheckPool("k_cache", args.k_cache, args.k_in, args.k_cache.dtype, args.pages.page_size));
  RETURN_IF_ERROR(
      CheckPool("v_cache", args.v_cache, args.v_in, args.k_cache.dtype, args.pages.page_size));
  if (args.v_cache.layout != args.k_cache.layout) {
    return absl::InvalidArgumentError("v_cache: layout differs from k_cache");
  }
  const bool rotate = args.rope_style != RopeStyle::kNone;
  AppendParams params{};
  if (args.q_in.data != nullptr) {
    RETURN_IF_ERROR(CheckInput("q_in", args.q_in, num_tokens, in_dtype));
    RETURN_IF_ERROR(CheckInput("q_out", args.q_out, num_tokens, in_dtype));
    if (args.q_out.num_heads != args.q_in.num_heads || args.q_out.head_dim != args.q_in.head_dim) {
      return absl::InvalidArgumentError("q_out: shape differs from q_in");
    }
    params.jobs[0] = DenseJob(args.q_in, args.q_out, rotate);
  }
  params.jobs[1] = PagedJob(args.k_in, args.k_cache, args.pages.k_indices, rotate, args.k_scale);
  params.jobs[2] = PagedJob(args.v_in, args.v_cache, args.pages.v_indices, false, args.v_scale);
  return LaunchAppend(params, args.tokens, args.pages, args.rope_style, args.rope_inv_freq,
                      args.rotary_dim, in_dtype, args.k_cache.dtype, stream);
}

absl::Status AppendMla(const AppendMlaArgs& args, cudaStream_t stream) {
  const int64_t num_tokens = args.tokens.num_tokens;
  if (num_tokens == 0) return absl::OkStatus();
  const DType in_dtype = args.ckv_in.dtype;
  if (in_dtype != DType::kFloat16 && in_dtype != DType::kBFloat16) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ckv_in.dtype: expected float16 or bfloat16, got ", DTypeName(in_dtype)));
  }
  RETURN_IF_ERROR(CheckInput("ckv_in", args.ckv_in, num_tokens, in_dtype));
  RETURN_IF_ERROR(CheckInput("kpe_in", args.kpe_in, num_tokens, in_dtype));
  if (args.ckv_in.num_heads != 1 || args.kpe_in.num_heads != 1) {
    return absl::InvalidArgumentError("MLA: ckv and kpe have one head");
  }
  RETURN_IF_ERROR(CheckPool("ckv_cache", args.ckv_cache, args.ckv_in, args.ckv_cache.dtype,
                                   args.pages.page_size));
  RETURN_IF_ERROR(CheckPool("kpe_cache", args.kpe_cache, args.kpe_in, args.ckv_cache.dtype,
                                   args.pages.page_size));
  const bool rotate = args.rope_style != RopeStyle::kNone;
  const int32_t rope_dim = args.kpe_in.head_dim;
  AppendParams params{};
  if (args.q_pe_in.data != nullptr) {
    RETURN_IF_ERROR(CheckInput("q_pe_in", args.q_pe_in, num_tokens, in_dtype));
    RETURN_IF_ERROR(CheckInput("q_pe_out", args.q_pe_out, num_tokens, in_dtype));
    if (args.q_pe_in.head_dim != rope_dim || args.q_pe_out.head_dim != rope_dim ||
        args.q_pe_out.num_heads != args.q_pe_in.num_heads) {
      return absl::InvalidArgumentError("q_pe_in/q_pe_out: expected [T][H][rope_dim] each");
    }
    params.jobs[0] = DenseJob(args.q_pe_in, args.q_pe_out, rotate);
  }
  params.jobs[1] =
      PagedJob(args.ckv_in, args.ckv_cache, args.pages.k_indices, false, args.ckv_scale);
  params.jobs[2] = PagedJob(args.kpe_in, args.kpe_cache, args.pages.v_indices, rotate, args.kpe_scale);
  const int32_t rotary_dim = args.rotary_dim > 0 ? args.rotary_dim : rope_dim;
  return LaunchAppend(params, args.tokens, args.pages, args.rope_style, args.rope_inv_freq,
                      rotary_dim, in_dtype, args.ckv_cache.dtype, stream);
}

}  // namespace attnd::cuda
