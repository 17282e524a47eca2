// attnctl bench --transport=shm|cuda_ipc|nccl: the e2e benchmark of PERFORMANCE.md over a
// channel (DESIGN 3b) instead of Forward messages. An orchestrator emulator produces each
// layer's q/k/v as an engine would (CUDA_IPC: a kernel on the bench's own stream writing into
// the slot, then ready set and done awaited with stream memory operations; NCCL: the same
// kernel writing into the client's local slot, then the layer's ncclSend/ncclRecv groups on
// that stream; HOST_SHM: the layer's inputs copied from host buffers into the slot, ready set
// and done awaited from the host), and the outputs of the first prefill and decode steps are
// checked against the CPU reference for --check_sequences sequences. --client_device puts the
// client's stream (and the channel's mapping or NCCL rank) on another GPU than attnd's.
//
// Reported: the prompt step (every sequence's prompt in as few steps as max_tokens allows) with
// its kernel time; per-layer time of the timed decode steps as the client sees it (CUDA_IPC:
// between the events after consecutive done waits (NCCL: receives), minus the emulator's
// fill; HOST_SHM: ready set to done seen), minus the mean kernel time of a layer (GetStats) =
// overhead; steps/s and the kernels-only rate; over CUDA_IPC and NCCL also chained steps (each
// planned on top of the previous one while it runs) against the kernels-only rate and against
// kernels + the emulator's fill.
#include <algorithm>
#include <chrono>
#include <cstring>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "attnd/client/channel.h"
#include "attnd/client/client.h"
#include "attnd/client/compare.h"
#include "attnd/client/reference_cache.h"
#include "attnd/client/tensor.h"
#include "attnd/kernels/dtype.h"
#include "attnd/status_macros.h"
#include "channel_bench.h"
#include "commands.h"
#include "emulator.h"
#include "latency.h"
#include "printing.h"

ABSL_FLAG(int32_t, check_sequences, 2,
          "bench (channels): sequences whose outputs are checked against the CPU reference in "
          "the prompt step and the first decode step (0: no check)");
ABSL_FLAG(bool, fill_stamps, false,
          "bench (cuda_ipc): the chained phase's fills record the GPU's global timer when they "
          "start and end, printed as `client-stamp` lines (to merge with attnd's "
          "ATTND_CHANNEL_STAMPS lines: scripts/channel_stamps.py)");
ABSL_FLAG(std::string, stream_flags, "memops",
          "bench (cuda_ipc): how the emulator's stream sets ready and waits for done: memops "
          "(stream memory operations) or kernels (one-thread kernels, the fill launched as a "
          "programmatic dependent of the done wait; ChannelOptions::stream_flags)");
ABSL_FLAG(bool, fill_sets_ready, true,
          "bench (cuda_ipc): the emulator's fill kernel sets the layer's ready word itself, from "
          "its last block (Channel::ReadyWord), as an engine's last kernel before attention "
          "can; false: a separate SetReadyOnStream after it (a stream memory operation or, with "
          "--stream_flags=kernels, a signal kernel)");
ABSL_FLAG(int32_t, host_spin_us, 200,
          "bench (shm): how long the client spins on a done word before it sleeps on it");

namespace attnd::attnctl {
namespace {

using Entries = std::vector<std::pair<uint64_t, int32_t>>;
using Clock = std::chrono::steady_clock;

// Each kernel's (name/phase) seconds and timed launches between two GetStats answers.
struct KernelDelta {
  double seconds = 0;
  int64_t launches = 0;
};
std::map<std::string, KernelDelta> KernelDeltas(const attnd::v1::GetStatsResponse& before,
                                                const attnd::v1::GetStatsResponse& after) {
  std::map<std::string, KernelDelta> delta;
  for (const auto& [stats, sign] : {std::pair{&after, 1}, std::pair{&before, -1}}) {
    for (const auto& kernel : stats->kernels()) {
      KernelDelta& d = delta[absl::StrCat(kernel.kernel(), "/", kernel.phase())];
      d.seconds += sign * kernel.total_seconds();
      d.launches += sign * kernel.count();
    }
  }
  return delta;
}

// The kernel seconds of one layer between two GetStats answers: each kernel's mean over the
// launches timed in between, summed (every layer runs each of its kernels once). attnd times
// one CUDA_IPC channel layer in --channel_kernel_timing, so the launch count is not the
// layer count.
double KernelSecondsPerLayer(const attnd::v1::GetStatsResponse& before,
                             const attnd::v1::GetStatsResponse& after) {
  double per_layer = 0;
  for (const auto& [name, d] : KernelDeltas(before, after)) {
    if (d.launches > 0) per_layer += d.seconds / static_cast<double>(d.launches);
  }
  return per_layer;
}

// Each kernel's mean per launch in a GetStats delta: "append/decode 6.1 us (100 timed), ...".
std::string KernelBreakdown(const attnd::v1::GetStatsResponse& before,
                            const attnd::v1::GetStatsResponse& after) {
  std::string out;
  for (const auto& [name, d] : KernelDeltas(before, after)) {
    if (d.launches <= 0) continue;
    absl::StrAppend(&out, out.empty() ? "" : ", ", name, " ",
                    absl::StrFormat("%.1f", d.seconds * 1e6 / static_cast<double>(d.launches)),
                    " us (", d.launches, " timed)");
  }
  return out;
}

// Inputs come in kVariants sets, layer `layer` of step `step` taking set (7 step + layer) % 4:
// enough that no two consecutive layers see the same data, few enough that the HOST_SHM
// emulator generates them once.
constexpr int kVariants = 4;

int VariantOf(int64_t step, int32_t layer) {
  return static_cast<int>((7 * step + layer) % kVariants);
}

// Seed of one tensor (0 q, 1 k, 2 v) of a variant.
uint64_t SeedOf(int variant, int tensor) { return 16 * static_cast<uint64_t>(variant) + tensor + 1; }

class ChannelBench {
 public:
  ChannelBench(client::Client& client, const attnd::v1::CacheInfo& cache,
               const ChannelBenchSettings& settings, attnd::v1::ChannelKind kind)
      : client_(client), cache_(cache), settings_(settings), kind_(kind),
        shape_(cache.config()),
        bf16_(shape_.q_dtype() == attnd::v1::DTYPE_BFLOAT16),
        q_row_(int64_t{shape_.num_qo_heads()} * shape_.head_dim()),
        kv_row_(int64_t{shape_.num_kv_heads()} * shape_.head_dim()) {}

  int Run() {
    const int32_t max_tokens = static_cast<int32_t>(std::max<int64_t>(
        settings_.sequences,
        std::min<int64_t>(int64_t{settings_.sequences} * settings_.prompt_tokens,
                          settings_.max_step_tokens)));
    const bool on_gpu = kind_ != attnd::v1::CHANNEL_KIND_HOST_SHM;
    client::ChannelOptions options;
    options.kind = kind_;
    options.cuda_device = settings_.client_device;
    options.max_tokens = max_tokens;
    options.host_spin = absl::Microseconds(absl::GetFlag(FLAGS_host_spin_us));
    using Flags = client::ChannelOptions::StreamFlags;
    const std::string stream_flags = absl::GetFlag(FLAGS_stream_flags);
    options.stream_flags =
        stream_flags == "kernels" ? Flags::kKernels : Flags::kMemoryOperations;
    auto channel = client::Channel::Open(client_, cache_.name(), options);
    if (!channel.ok()) return Fail("open channel", channel.status());
    channel_ = *std::move(channel);
    if (on_gpu) {
      // Events: after each layer's done wait, 8 of the bench's own, after each layer's fill.
      auto stream = EmulatorStream::Create(channel_->cuda_device(),
                                           2 * shape_.num_layers() + 8);
      if (!stream.ok()) return Fail("CUDA stream", stream.status());
      stream_ = *std::move(stream);
    }
    const int32_t checked = std::min(absl::GetFlag(FLAGS_check_sequences), settings_.sequences);
    if (checked > 0) {
      auto reference = client::ReferenceCache::Create(cache_.config());
      if (!reference.ok()) return Fail("reference", reference.status());
      reference_ = *std::move(reference);
      checked_ = checked;
    }

    // The prompt: as many sequences per step as max_tokens holds.
    const int32_t per_step = std::max(1, max_tokens / std::max(1, settings_.prompt_tokens));
    if (settings_.prompt_tokens > 0) {
      // One untimed prompt step of the same shape on other sequences, freed after: the first
      // launches of each kernel (module loading) and first touches are not the step's cost.
      Entries warmup;
      std::vector<uint64_t> ids;
      for (int32_t s = 0; s < std::min(settings_.sequences, per_step); ++s) {
        ids.push_back(settings_.first_id + settings_.sequences + s);
        warmup.push_back({ids.back(), settings_.prompt_tokens});
      }
      if (!RunStep(warmup, kPlain, nullptr)) return kExitFailure;
      if (auto freed = client_.FreeSequences(cache_.name(), ids); !freed.ok()) {
        return Fail("free the warm-up sequences", freed.status());
      }
    }
    absl::Duration prompt_wall;
    double prompt_kernels = 0;
    int64_t prompt_tokens = 0;
    for (int32_t first = 0; first < settings_.sequences && settings_.prompt_tokens > 0;
         first += per_step) {
      Entries entries;
      for (int32_t s = first; s < std::min(settings_.sequences, first + per_step); ++s) {
        entries.push_back({settings_.first_id + s, settings_.prompt_tokens});
      }
      auto before = client_.GetStats();
      // The checked sequences' prompt is replayed in the reference after the step, outside the
      // step's time (RunStep measures Plan to the last layer's done).
      if (!RunStep(entries, first == 0 && checked_ > 0 ? kReplay : kPlain, nullptr)) {
        return kExitFailure;
      }
      const absl::Duration wall = last_step_wall_;
      if (first == 0) prompt_plan_ = last_plan_wall_;
      auto after = client_.GetStats();
      absl::FPrintF(stderr, "bench: prompt step of %d sequences in %.3f ms\n", entries.size(),
                    absl::ToDoubleMilliseconds(wall));
      if (first == 0 && before.ok() && after.ok()) {
        absl::FPrintF(stderr, "bench: prompt step kernels per layer: %s\n",
                      KernelBreakdown(*before, *after));
        prompt_wall = wall;
        prompt_kernels = KernelSecondsPerLayer(*before, *after) * shape_.num_layers();
        prompt_tokens = static_cast<int64_t>(entries.size()) * settings_.prompt_tokens;
      }
    }

    Entries decode;
    for (int32_t s = 0; s < settings_.sequences; ++s) decode.push_back({settings_.first_id + s, 1});
    for (int32_t i = 0; i < settings_.warmup_steps; ++i) {
      if (!RunStep(decode, i == 0 && checked_ > 0 ? kCheck : kPlain, nullptr)) {
        return kExitFailure;
      }
    }
    if (stream_) {
      // What the client's own kernel costs per layer, to tell it apart from attnd's overhead.
      absl::StatusOr<double> fill = MeasureFillUs(settings_.sequences);
      if (!fill.ok()) return Fail("timing the emulator's fill", fill.status());
      fill_us_ = *fill;
      if (prompt_tokens > 0) {
        fill = MeasureFillUs(prompt_tokens);
        if (!fill.ok()) return Fail("timing the emulator's fill", fill.status());
        prompt_fill_us_ = *fill;
      }
    }
    auto before = client_.GetStats();
    const absl::Time start = absl::Now();
    KeySpan plain_keys;
    for (int32_t i = 0; i < settings_.steps; ++i) {
      if (!RunStep(decode, kPlain, &latency_)) return kExitFailure;
      plain_keys.See(last_step_keys_);
      if (i % 10 == 9) absl::FPrintF(stderr, "bench: %d decode steps\n", i + 1);
    }
    const absl::Duration wall = absl::Now() - start;
    auto after = client_.GetStats();
    if (!before.ok() || !after.ok()) return Fail("GetStats", before.ok() ? after.status()
                                                                           : before.status());
    const int64_t layers = int64_t{settings_.steps} * shape_.num_layers();
    const double kernels = KernelSecondsPerLayer(*before, *after) * static_cast<double>(layers);
    absl::FPrintF(stderr, "bench: decode kernels per layer: %s\n",
                  KernelBreakdown(*before, *after));
    const double kernel_us = kernels / layers * 1e6;
    const double p50 = absl::ToDoubleMicroseconds(latency_.Percentile(50));
    const double p99 = absl::ToDoubleMicroseconds(latency_.Percentile(99));
    const double steps_per_second = settings_.steps / absl::ToDoubleSeconds(wall);
    const double kernel_rate = kernels > 0 ? settings_.steps / kernels : 0;
    Chained chained;
    if (stream_) {
      absl::StatusOr<Chained> ran = RunChained(decode, settings_.steps);
      if (!ran.ok()) return Fail("chained steps", ran.status());
      chained = *ran;
    }
    Pipelined pipelined;
    if (stream_ && settings_.micro_batches > 1) {
      absl::StatusOr<Pipelined> ran = RunPipelined(settings_.micro_batches);
      if (!ran.ok()) return Fail("pipelined micro-batches", ran.status());
      pipelined = *ran;
    }
    const char* transport = kind_ == attnd::v1::CHANNEL_KIND_CUDA_IPC ? "cuda_ipc"
                            : kind_ == attnd::v1::CHANNEL_KIND_NCCL   ? "nccl"
                                                                      : "shm";
    absl::PrintF("transport %s: %d sequences x %d layers, %d timed decode steps\n", transport,
                 settings_.sequences, shape_.num_layers(), settings_.steps);
    absl::PrintF("  layer (client view%s): p50 %.1f us, p99 %.1f us; kernels %.1f us/layer\n",
                 stream_ ? ", emulator fill excluded" : "", p50, p99, kernel_us);
    absl::PrintF("  overhead: p50 %.1f us, p99 %.1f us per layer\n", p50 - kernel_us,
                 p99 - kernel_us);
    const double attnd_p50 = absl::ToDoubleMicroseconds(attnd_latency_.Percentile(50));
    const double attnd_p99 = absl::ToDoubleMicroseconds(attnd_latency_.Percentile(99));
    if (stream_) {
      // The fill as it ran (3 kernels after a wait) differs from the fill timed back to back:
      // this view needs no fill estimate.
      // With --fill_sets_ready attnd starts before the fill's event (which follows the fill's
      // last block, its ready write, and the grid's end): this view then reads low.
      absl::PrintF("  attnd's part (client's fill done to its done wait passed%s): p50 %.1f us, "
                   "p99 %.1f us; overhead p50 %.1f us, p99 %.1f us\n",
                   fill_sets_ready_ ? "; the fill set ready, so it reads low" : "", attnd_p50,
                   attnd_p99, attnd_p50 - kernel_us, attnd_p99 - kernel_us);
    }
    absl::PrintF("  steps/s %.1f, kernels-only %.1f (%.0f%%); keys per sequence %s\n",
                 steps_per_second, kernel_rate,
                 kernel_rate > 0 ? 100.0 * steps_per_second / kernel_rate : 0.0,
                 plain_keys.ToString());
    const double fill_us = fill_us_;
    // The GPU work of a step either way: attnd's kernels and the emulator's fill of every layer.
    const double gpu_rate =
        kernels > 0 ? settings_.steps / (kernels + 1e-6 * fill_us * layers) : 0;
    if (stream_) {
      absl::PrintF("  emulator fill (GPU time): %.1f us/layer decode, %.1f us/layer prompt\n",
                   fill_us, prompt_fill_us_);
      absl::PrintF("  client host per layer: fill launch p50 %.1f us, hand-off call p50 %.1f us "
                   "(p99 %.1f us)\n",
                   absl::ToDoubleMicroseconds(fill_host_.Percentile(50)),
                   absl::ToDoubleMicroseconds(signal_host_.Percentile(50)),
                   absl::ToDoubleMicroseconds(signal_host_.Percentile(99)));
    }
    const double chained_gpu_rate =
        chained.kernel_rate > 0
            ? 1.0 / (1.0 / chained.kernel_rate + 1e-6 * fill_us * shape_.num_layers())
            : 0;
    if (chained.steps > 0) {
      // The chained steps follow the plain ones, so their sequences are longer and their
      // decode kernels slower: both rates are of the chained phase's own kernels.
      absl::PrintF("  chained (step N+1 planned while step N runs): %.1f steps/s, %.0f%% of "
                   "kernels-only %.1f, %.0f%% of kernels + emulator fill %.1f; keys per "
                   "sequence %s\n",
                   chained.steps_per_second,
                   chained.kernel_rate > 0 ? 100.0 * chained.steps_per_second / chained.kernel_rate
                                           : 0.0,
                   chained.kernel_rate,
                   chained_gpu_rate > 0 ? 100.0 * chained.steps_per_second / chained_gpu_rate : 0.0,
                   chained_gpu_rate, chained.keys.ToString());
    }
    if (pipelined.rounds > 0) {
      absl::PrintF("  %d micro-batches pipelined (own channel and stream each): %.1f steps/s, "
                   "kernels-only %.1f (%.0f%%)\n",
                   settings_.micro_batches, pipelined.steps_per_second, pipelined.kernel_rate,
                   pipelined.kernel_rate > 0
                       ? 100.0 * pipelined.steps_per_second / pipelined.kernel_rate
                       : 0.0);
    }
    if (prompt_tokens > 0) {
      const double prompt_ms = absl::ToDoubleMilliseconds(prompt_wall);
      const double prompt_fill_ms = 1e-3 * prompt_fill_us_ * shape_.num_layers();
      absl::PrintF("  prompt step: %d tokens in %.3f ms (Plan %.3f ms), kernels %.3f ms "
                   "(%.2fx); without the emulator's fill (%.3f ms) %.3f ms (%.2fx)\n",
                   prompt_tokens, prompt_ms, absl::ToDoubleMilliseconds(prompt_plan_),
                   prompt_kernels * 1e3,
                   prompt_kernels > 0 ? prompt_ms / (prompt_kernels * 1e3) : 0, prompt_fill_ms,
                   prompt_ms - prompt_fill_ms,
                   prompt_kernels > 0 ? (prompt_ms - prompt_fill_ms) / (prompt_kernels * 1e3)
                                      : 0);
    }
    if (kind_ == attnd::v1::CHANNEL_KIND_HOST_SHM) {
      const double bytes = static_cast<double>(
          settings_.sequences * (q_row_ * 2 + kv_row_ * 2) * 2 * layers);
      absl::PrintF("  through the ring: %.2f GB/s of q/k/v/o\n",
                   bytes / absl::ToDoubleSeconds(wall) / 1e9);
    }
    absl::PrintF(
        "RESULT transport=%s sequences=%d layers=%d steps=%d layer_p50_us=%.1f "
        "layer_p99_us=%.1f kernel_us_per_layer=%.1f overhead_p50_us=%.1f overhead_p99_us=%.1f "
        "steps_per_s=%.1f kernels_only_steps_per_s=%.1f prompt_tokens=%d prompt_ms=%.3f "
        "prompt_kernel_ms=%.3f checked=%s micro_batches=%d pipelined_steps_per_s=%.1f "
        "pipelined_kernels_only_steps_per_s=%.1f chained_steps_per_s=%.1f "
        "chained_kernels_only_steps_per_s=%.1f fill_us_per_layer=%.1f "
        "kernels_and_fill_steps_per_s=%.1f prompt_fill_us_per_layer=%.1f "
        "prompt_plan_ms=%.3f plain_keys=%s chained_keys=%s "
        "chained_kernels_and_fill_steps_per_s=%.1f",
        transport, settings_.sequences, shape_.num_layers(), settings_.steps, p50, p99, kernel_us,
        p50 - kernel_us, p99 - kernel_us, steps_per_second, kernel_rate, prompt_tokens,
        absl::ToDoubleMilliseconds(prompt_wall), prompt_kernels * 1e3,
        checked_ > 0 ? (check_failures_ == 0 ? "PASS" : "FAIL") : "off",
        settings_.micro_batches, pipelined.steps_per_second, pipelined.kernel_rate,
        chained.steps_per_second, chained.kernel_rate, fill_us, gpu_rate, prompt_fill_us_,
        absl::ToDoubleMilliseconds(prompt_plan_), plain_keys.ToString(), chained.keys.ToString(),
        chained_gpu_rate);
    // attnd's own part is measured only with the client's GPU stream (CUDA_IPC).
    if (stream_) {
      absl::PrintF(" attnd_layer_p50_us=%.1f attnd_overhead_p50_us=%.1f attnd_overhead_p99_us=%.1f",
                   attnd_p50, attnd_p50 - kernel_us, attnd_p99 - kernel_us);
    }
    absl::PrintF("\n");
    return check_failures_ == 0 ? kExitOk : kExitFailure;
  }

 private:
  struct Pipelined {
    int32_t rounds = 0;
    double steps_per_second = 0;
    double kernel_rate = 0;
  };

  // The keys a decode token of the first sequence attends (its own included), over a phase's
  // steps: the decode kernel's time grows with them.
  struct KeySpan {
    int64_t first = -1;
    int64_t last = -1;
    void See(int64_t keys) {
      if (first < 0) first = keys;
      last = keys;
    }
    std::string ToString() const {
      return first < 0 ? std::string("-") : absl::StrCat(first, "-", last);
    }
  };

  struct Chained {
    int32_t steps = 0;
    KeySpan keys;
    double steps_per_second = 0;
    double kernel_rate = 0;
  };

  // A Plan of `entries` (sequence id, new tokens) through `channel`.
  attnd::v1::PlanRequest PlanThrough(const client::Channel& channel, const Entries& entries) const {
    attnd::v1::PlanRequest request;
    request.set_cache(cache_.name());
    request.set_channel_id(channel.id());
    for (const auto& [id, tokens] : entries) {
      auto* entry = request.add_entries();
      entry->set_sequence_id(id);
      entry->set_num_new_tokens(tokens);
    }
    return request;
  }

  // Hands a filled layer to attnd and makes `stream` wait for its o: CUDA_IPC sets ready (unless
  // the fill did, --fill_sets_ready) and waits for done; NCCL sends the slot's q/k/v and
  // receives o.
  absl::Status SignalLayer(client::Channel& channel, void* stream, int32_t layer,
                           uint32_t sequence, int64_t rows,
                           client::ChannelOptions::StreamFlags flags =
                               client::ChannelOptions::StreamFlags::kDefault) const {
    if (channel.kind() == attnd::v1::CHANNEL_KIND_NCCL) {
      return channel.ExchangeOnStream(layer, rows, /*return_lse=*/false, channel.Slot(layer),
                                      stream);
    }
    if (ReadyWordOf(channel, layer) == nullptr) {
      RETURN_IF_ERROR(channel.SetReadyOnStream(layer, sequence, stream));
    }
    return channel.WaitDoneOnStream(layer, sequence, stream, flags);
  }

  // Enqueues every layer of a planned step on `stream`: fill, then SignalLayer (no host wait).
  absl::Status EnqueueStep(client::Channel& channel, EmulatorStream& emulator,
                           const attnd::v1::PlanResponse& planned, int64_t step,
                           FillStamps* stamps = nullptr) const {
    for (int32_t layer = 0; layer < shape_.num_layers(); ++layer) {
      RETURN_IF_ERROR(FillLayer(channel, emulator, step, layer, planned.num_tokens(),
                                stamps == nullptr ? nullptr : stamps + layer,
                                channel.stream_flag_kernels(), ReadyWordOf(channel, layer),
                                planned.channel_sequence()));
      RETURN_IF_ERROR(SignalLayer(channel, emulator.stream(), layer, planned.channel_sequence(),
                                  planned.num_tokens()));
    }
    return absl::OkStatus();
  }

  // The GPU time of the emulator's fill of one layer of `rows` rows: fills of kRepeats layers
  // enqueued behind a 5 ms hold of the stream (so the host's launch rate is not timed), between
  // two events.
  absl::StatusOr<double> MeasureFillUs(int64_t rows) {
    constexpr int32_t kRepeats = 32;
    const int first = shape_.num_layers() + 5;
    RETURN_IF_ERROR(stream_->Synchronize());
    RETURN_IF_ERROR(stream_->Sleep(5000));
    RETURN_IF_ERROR(stream_->Record(first));
    for (int32_t i = 0; i < kRepeats; ++i) {
      // With --fill_sets_ready the timed fill signals too (a word nobody reads).
      RETURN_IF_ERROR(FillLayer(*channel_, *stream_, /*step=*/i, i, rows, nullptr, false,
                                fill_sets_ready_ ? stream_->scratch_word() : nullptr, 0));
    }
    RETURN_IF_ERROR(stream_->Record(first + 1));
    RETURN_IF_ERROR(stream_->Synchronize());
    return stream_->ElapsedMs(first, first + 1) * 1e3 / kRepeats;
  }

  absl::Status EndCommitted(uint64_t step_id) {
    ASSIGN_OR_RETURN(const attnd::v1::EndStepResponse ended, client_.EndStep(step_id, false));
    if (ended.outcome() != attnd::v1::STEP_OUTCOME_COMMITTED) {
      return absl::InternalError(absl::StrCat("chained step ended ", ended.ShortDebugString()));
    }
    return absl::OkStatus();
  }

  // Decode steps as an engine that plans ahead runs them (DESIGN 3b): step N+1 is planned on
  // top of step N and its layers enqueued while step N's run on the GPU; step N's EndStep (an
  // outcome query by then) follows once the stream has passed it. The GPU never waits for Plan.
  absl::StatusOr<Chained> RunChained(const Entries& entries, int32_t steps) {
    const attnd::v1::PlanRequest request = PlanThrough(*channel_, entries);
    const int event = shape_.num_layers() + 3;  // two events after those of RunStep
    const int32_t layers = shape_.num_layers();
    std::unique_ptr<StampBuffer> stamps;
    std::vector<uint32_t> sequences;  // each chained step's channel sequence (stamps)
    if (absl::GetFlag(FLAGS_fill_stamps)) {
      ASSIGN_OR_RETURN(stamps, StampBuffer::Create(int64_t{steps} * layers));
    }
    auto stamps_of = [&](int32_t i) {
      return stamps ? stamps->at(int64_t{i} * layers) : nullptr;
    };
    ASSIGN_OR_RETURN(const attnd::v1::GetStatsResponse before, client_.GetStats());
    const absl::Time start = absl::Now();
    ASSIGN_OR_RETURN(attnd::v1::PlanResponse previous, client_.Plan(request));
    sequences.push_back(previous.channel_sequence());
    KeySpan keys;
    keys.See(previous.entries(0).start_position() + 1);
    RETURN_IF_ERROR(
        EnqueueStep(*channel_, *stream_, previous, step_count_++, stamps_of(0)));
    RETURN_IF_ERROR(stream_->Record(event));
    for (int32_t i = 1; i < steps; ++i) {
      ASSIGN_OR_RETURN(const attnd::v1::PlanResponse current, client_.Plan(request));
      if (current.entries(0).start_position() != previous.entries(0).start_position() + 1) {
        return absl::InternalError(absl::StrCat(
            "a chained step starts at ", current.entries(0).start_position(),
            ", not after the open step's token at ", previous.entries(0).start_position()));
      }
      sequences.push_back(current.channel_sequence());
      keys.See(current.entries(0).start_position() + 1);
      RETURN_IF_ERROR(
          EnqueueStep(*channel_, *stream_, current, step_count_++, stamps_of(i)));
      RETURN_IF_ERROR(stream_->Record(event + i % 2));
      RETURN_IF_ERROR(stream_->WaitEvent(event + (i - 1) % 2));
      RETURN_IF_ERROR(EndCommitted(previous.step_id()));
      previous = current;
    }
    RETURN_IF_ERROR(stream_->Synchronize());
    RETURN_IF_ERROR(EndCommitted(previous.step_id()));
    const absl::Duration wall = absl::Now() - start;
    ASSIGN_OR_RETURN(const attnd::v1::GetStatsResponse after, client_.GetStats());
    const double kernels =
        KernelSecondsPerLayer(before, after) * static_cast<double>(steps) * shape_.num_layers();
    absl::FPrintF(stderr, "bench: chained decode kernels per layer: %s\n",
                  KernelBreakdown(before, after));
    if (stamps) {
      ASSIGN_OR_RETURN(const std::vector<FillStamps> read, stamps->Read());
      for (int32_t i = 0; i < steps; ++i) {
        for (int32_t layer = 0; layer < layers; ++layer) {
          const FillStamps& stamp = read[int64_t{i} * layers + layer];
          absl::PrintF("client-stamp seq=%u layer=%d fill_start_ns=%u fill_end_ns=%u\n",
                       sequences[i], layer, stamp.start_ns, stamp.end_ns);
        }
      }
    }
    Chained result;
    result.steps = steps;
    result.keys = keys;
    result.steps_per_second = steps / absl::ToDoubleSeconds(wall);
    result.kernel_rate = kernels > 0 ? steps / kernels : 0;
    return result;
  }

  // A micro-batch of the pipelined phase: its sequences, channel, stream and open step.
  struct MicroBatch {
    Entries entries;
    std::unique_ptr<client::Channel> channel;
    std::unique_ptr<EmulatorStream> stream;
    uint64_t open_step = 0;
  };

  // Plans micro-batch `batch`'s next step and enqueues its layers on its stream (no wait).
  absl::Status BeginMicroStep(MicroBatch& batch) {
    ASSIGN_OR_RETURN(const attnd::v1::PlanResponse planned,
                     client_.Plan(PlanThrough(*batch.channel, batch.entries)));
    batch.open_step = planned.step_id();
    return EnqueueStep(*batch.channel, *batch.stream, planned, step_count_++);
  }

  // The emulator's q, k and v of (step, layer) written into the layer's slot on `stream`.
  // The event recorded after layer `layer`'s fill (RunStep).
  int FilledEvent(int32_t layer) const { return shape_.num_layers() + 8 + layer; }

  // `after_poll`: the fill follows a polling done wait, so it is launched as that kernel's
  // programmatic dependent (Channel::stream_flag_kernels). With a `signal_word` the fill sets
  // it to `sequence` once its writes are visible (FillSignal).
  absl::Status FillLayer(client::Channel& channel, EmulatorStream& emulator, int64_t step,
                         int32_t layer, int64_t rows, FillStamps* stamps = nullptr,
                         bool after_poll = false, uint32_t* signal_word = nullptr,
                         uint32_t sequence = 0) const {
    const client::ChannelSlot slot = channel.Slot(layer);
    const int variant = VariantOf(step, layer);
    // q, k and v in one launch, as a fused QKV projection writes them.
    const FillRegion regions[] = {{slot.q, rows * q_row_, SeedOf(variant, 0)},
                                  {slot.k, rows * kv_row_, SeedOf(variant, 1)},
                                  {slot.v, rows * kv_row_, SeedOf(variant, 2)}};
    const FillSignal signal = {signal_word, sequence, emulator.signal_counter()};
    return FillRegionsOnStream(regions, 3, bf16_, emulator.stream(), stamps, after_poll,
                               signal_word != nullptr ? &signal : nullptr);
  }

  // Waits for micro-batch `batch`'s open step on its stream and for its commit.
  absl::Status FinishMicroStep(MicroBatch& batch) {
    if (batch.open_step == 0) return absl::OkStatus();
    RETURN_IF_ERROR(batch.stream->Synchronize());
    ASSIGN_OR_RETURN(const attnd::v1::EndStepResponse ended,
                     client_.EndStep(batch.open_step, /*abort=*/false));
    batch.open_step = 0;
    if (ended.outcome() != attnd::v1::STEP_OUTCOME_COMMITTED) {
      return absl::InternalError(absl::StrCat("micro-batch step ended ", ended.ShortDebugString()));
    }
    return absl::OkStatus();
  }

  // The sequences in `count` micro-batches, each with its own channel and stream; while one
  // micro-batch's layers run on the GPU the host commits and plans the next one's step, as an
  // engine pipelines them. One round = every micro-batch one step (every sequence one token).
  absl::StatusOr<Pipelined> RunPipelined(int32_t count) {
    std::vector<MicroBatch> batches(count);
    for (int32_t k = 0; k < count; ++k) {
      for (int32_t s = k * settings_.sequences / count; s < (k + 1) * settings_.sequences / count;
           ++s) {
        batches[k].entries.push_back({settings_.first_id + s, 1});
      }
      client::ChannelOptions options;
      options.kind = kind_;
      options.cuda_device = settings_.client_device;
      options.max_tokens = static_cast<int32_t>(std::max<size_t>(1, batches[k].entries.size()));
      ASSIGN_OR_RETURN(batches[k].channel,
                       client::Channel::Open(client_, cache_.name(), options));
      ASSIGN_OR_RETURN(batches[k].stream,
                       EmulatorStream::Create(batches[k].channel->cuda_device(), 1));
    }
    auto round = [&]() -> absl::Status {
      for (MicroBatch& batch : batches) {
        RETURN_IF_ERROR(FinishMicroStep(batch));
        RETURN_IF_ERROR(BeginMicroStep(batch));
      }
      return absl::OkStatus();
    };
    for (int i = 0; i < 3; ++i) RETURN_IF_ERROR(round());  // warm-up
    for (MicroBatch& batch : batches) RETURN_IF_ERROR(FinishMicroStep(batch));
    ASSIGN_OR_RETURN(const attnd::v1::GetStatsResponse before, client_.GetStats());
    const absl::Time start = absl::Now();
    for (int32_t i = 0; i < settings_.steps; ++i) RETURN_IF_ERROR(round());
    for (MicroBatch& batch : batches) RETURN_IF_ERROR(FinishMicroStep(batch));
    const absl::Duration wall = absl::Now() - start;
    ASSIGN_OR_RETURN(const attnd::v1::GetStatsResponse after, client_.GetStats());
    const double kernels = KernelSecondsPerLayer(before, after) * static_cast<double>(count) *
                           settings_.steps * shape_.num_layers();
    Pipelined result;
    result.rounds = settings_.steps;
    result.steps_per_second = settings_.steps / absl::ToDoubleSeconds(wall);
    result.kernel_rate = kernels > 0 ? settings_.steps / kernels : 0;
    return result;
  }

  int Fail(const std::string& what, const absl::Status& status) {
    PrintError(absl::StrCat("bench ", what), status);
    return kExitFailure;
  }

  // The host copy of what the emulator writes for rows [0, rows) of one tensor.
  std::vector<uint16_t> HostTensor(uint64_t seed, int64_t elements) const {
    std::vector<uint16_t> out(elements);
    for (int64_t i = 0; i < elements; ++i) out[i] = EmulatedElement(seed, i, bf16_);
    return out;
  }

  // The inputs of (step, layer), rows [0, rows): generated once per variant and row count.
  const attnd::v1::ForwardRequest& HostLayer(int64_t step, int32_t layer, int64_t rows) {
    const int variant = VariantOf(step, layer);
    attnd::v1::ForwardRequest& cached = host_inputs_[{variant, rows}];
    if (!cached.has_q()) cached = MakeHostLayer(variant, rows);
    cached.set_layer(layer);
    return cached;
  }

  attnd::v1::ForwardRequest MakeHostLayer(int variant, int64_t rows) const {
    attnd::v1::ForwardRequest request;
    const DType dtype = bf16_ ? DType::kBFloat16 : DType::kFloat16;
    const int64_t heads_q = shape_.num_qo_heads();
    const int64_t heads_kv = shape_.num_kv_heads();
    const int64_t dim = shape_.head_dim();
    *request.mutable_q() = *client::MakeTensor(dtype, std::vector<int64_t>{rows, heads_q, dim},
                                               HostTensor(SeedOf(variant, 0), rows * q_row_));
    *request.mutable_k() = *client::MakeTensor(dtype, std::vector<int64_t>{rows, heads_kv, dim},
                                               HostTensor(SeedOf(variant, 1), rows * kv_row_));
    *request.mutable_v() = *client::MakeTensor(dtype, std::vector<int64_t>{rows, heads_kv, dim},
                                               HostTensor(SeedOf(variant, 2), rows * kv_row_));
    return request;
  }

  enum Mode {
    kPlain,   // the channel alone
    kReplay,  // the first checked_ entries replayed in the reference after the step
    kCheck,   // and their o compared with it, layer by layer (the step waits for each layer)
  };

  // Runs one step through the channel. `latency`: per-layer client times.
  bool RunStep(const Entries& entries, Mode mode, LatencyRecorder* latency) {
    const bool check = mode == kCheck;
    const bool replay = mode != kPlain;
    const int64_t step = step_count_++;
    const absl::Time started = absl::Now();
    const attnd::v1::PlanRequest plan = PlanThrough(*channel_, entries);
    auto planned = client_.Plan(plan);
    last_plan_wall_ = absl::Now() - started;
    if (!planned.ok()) {
      Fail("Plan", planned.status());
      return false;
    }
    const uint32_t sequence = planned->channel_sequence();
    const int64_t rows = planned->num_tokens();
    if (planned->entries_size() > 0) {
      last_step_keys_ = planned->entries(0).start_position() + plan.entries(0).num_new_tokens();
    }
    const int32_t num_layers = shape_.num_layers();
    attnd::v1::PlanRequest reference_plan;
    int64_t checked_rows = 0;
    if (replay) {
      reference_plan.set_cache(cache_.name());
      for (int32_t e = 0; e < checked_; ++e) {
        *reference_plan.add_entries() = plan.entries(e);
        checked_rows += plan.entries(e).num_new_tokens();
      }
    }
    // The reference's step begins inside the timed step only where its layers are checked on
    // the way; a replay begins it after the step's time.
    auto begin_reference = [&] {
      if (absl::Status begun = reference_->BeginStep(reference_plan); !begun.ok()) {
        Fail("reference plan", begun);
        return false;
      }
      return true;
    };
    if (check && !begin_reference()) return false;
    if (stream_) {
      (void)stream_->Record(num_layers);  // the step's start
    }
    // A prompt step's done words are awaited with memory operations: a polling wait would hold
    // an SM slot that attnd's prefill kernel wants (ChannelOptions::stream_flags).
    const bool prompt_rows = rows > static_cast<int64_t>(entries.size());
    const auto flags = prompt_rows ? client::ChannelOptions::StreamFlags::kMemoryOperations
                                   : client::ChannelOptions::StreamFlags::kDefault;
    const bool poll = !prompt_rows && channel_->stream_flag_kernels();
    for (int32_t layer = 0; layer < num_layers; ++layer) {
      const client::ChannelSlot slot = channel_->Slot(layer);
      absl::Status status;
      if (stream_) {
        void* stream = stream_->stream();
        const auto host_start = Clock::now();
        status.Update(
            FillLayer(*channel_, *stream_, step, layer, rows, nullptr, poll && layer > 0,
                      ReadyWordOf(*channel_, layer), sequence));
        // A timing event costs ~2 us of the stream: the fill's own only every other step.
        if (step % 2 == 1) status.Update(stream_->Record(FilledEvent(layer)));
        const auto host_filled = Clock::now();
        status.Update(SignalLayer(*channel_, stream, layer, sequence, rows, flags));
        if (latency != nullptr) {
          fill_host_.Record(absl::FromChrono(host_filled - host_start));
          signal_host_.Record(absl::FromChrono(Clock::now() - host_filled));
        }
        status.Update(stream_->Record(layer));
        if (check) status.Update(stream_->Synchronize());
      } else {
        const attnd::v1::ForwardRequest& inputs = HostLayer(step, layer, rows);
        std::memcpy(slot.q, inputs.q().data().data(), inputs.q().data().size());
        std::memcpy(slot.k, inputs.k().data().data(), inputs.k().data().size());
        std::memcpy(slot.v, inputs.v().data().data(), inputs.v().data().size());
        const auto ready = Clock::now();
        channel_->SetReady(layer, sequence);
        status = channel_->WaitDone(layer, sequence, absl::Seconds(60));
        if (latency != nullptr) latency->Record(absl::FromChrono(Clock::now() - ready));
      }
      if (!status.ok()) {
        Fail(absl::StrCat("layer ", layer), status);
        return false;
      }
      if (check && !CheckLayer(step, layer, checked_rows, slot)) ++check_failures_;
    }
    if (stream_) {
      if (absl::Status synced = stream_->Synchronize(); !synced.ok()) {
        Fail("synchronize", synced);
        return false;
      }
      if (rows > static_cast<int64_t>(entries.size()) && num_layers > 1) {
        // A prompt step: where its GPU time goes, layer by layer (fill included).
        std::vector<double> layer_us;
        for (int32_t layer = 1; layer < num_layers; ++layer) {
          layer_us.push_back(1e3 * stream_->ElapsedMs(layer - 1, layer));
        }
        std::sort(layer_us.begin(), layer_us.end());
        absl::FPrintF(stderr,
                      "bench: prompt step on the client's stream: start to layer 0 done %.1f us, "
                      "later layers p50 %.1f / max %.1f us, start to last done %.1f us, host "
                      "Plan %.1f us\n",
                      1e3 * stream_->ElapsedMs(num_layers, 0), layer_us[layer_us.size() / 2],
                      layer_us.back(), 1e3 * stream_->ElapsedMs(num_layers, num_layers - 1),
                      absl::ToDoubleMicroseconds(last_plan_wall_));
      }
      if (latency != nullptr) {
        for (int32_t layer = 0; layer < num_layers; ++layer) {
          if (step % 2 == 1) {
            // attnd's part as it ran: from the client's fill done (its ready write next) to
            // the client's done wait passed.
            attnd_latency_.Record(
                absl::Microseconds(1e3 * stream_->ElapsedMs(FilledEvent(layer), layer)));
          } else {
            const double ms = stream_->ElapsedMs(layer == 0 ? num_layers : layer - 1, layer);
            latency->Record(absl::Microseconds(ms * 1e3 - fill_us_));
          }
        }
      }
    }
    last_step_wall_ = absl::Now() - started;
    if (mode == kReplay) {
      if (!begin_reference()) return false;
      for (int32_t layer = 0; layer < num_layers; ++layer) {
        if (!reference_->Forward(HostLayer(step, layer, checked_rows)).ok()) {
          Fail("reference replay", absl::InternalError("reference forward failed"));
          return false;
        }
      }
    }
    if (replay) reference_->EndStep(false);
    // The step commits after its last layer; EndStep answers once it has.
    auto ended = client_.EndStep(planned->step_id(), false);
    if (!ended.ok() || ended->outcome() != attnd::v1::STEP_OUTCOME_COMMITTED) {
      Fail("step end", ended.ok() ? absl::InternalError(ended->ShortDebugString())
                                  : ended.status());
      return false;
    }
    return true;
  }

  bool CheckLayer(int64_t step, int32_t layer, int64_t rows, const client::ChannelSlot& slot) {
    const attnd::v1::ForwardRequest& inputs = HostLayer(step, layer, rows);
    auto expected = reference_->Forward(inputs);
    if (!expected.ok()) {
      Fail("reference forward", expected.status());
      return false;
    }
    std::string o(rows * q_row_ * 2, '\0');
    if (absl::Status copied = channel_->CopyOut(o.data(), slot.o, o.size()); !copied.ok()) {
      Fail("copy o", copied);
      return false;
    }
    attnd::v1::Tensor tensor;
    tensor.set_dtype(shape_.q_dtype());
    tensor.add_shape(rows);
    tensor.add_shape(shape_.num_qo_heads());
    tensor.add_shape(shape_.head_dim());
    tensor.set_data(std::move(o));
    auto actual = client::TensorToFloats(tensor);
    if (!actual.ok()) return false;
    const DType dtype = bf16_ ? DType::kBFloat16 : DType::kFloat16;
    const client::ErrorStats error = client::CompareOutputs(*actual, expected->o);
    const bool ok = error.mismatched_non_finite == 0 &&
                    error.normwise_relative <= client::OutputTolerance(dtype);
    if (!ok) {
      absl::FPrintF(stderr, "bench: step %d layer %d: o differs from the reference (normwise %g)\n",
                    step, layer, error.normwise_relative);
    }
    return ok;
  }

  client::Client& client_;
  const attnd::v1::CacheInfo& cache_;
  const ChannelBenchSettings settings_;
  const attnd::v1::ChannelKind kind_;
  const attnd::v1::CacheConfig shape_;
  const bool bf16_;
  const int64_t q_row_;
  const int64_t kv_row_;
  std::unique_ptr<client::Channel> channel_;
  std::unique_ptr<EmulatorStream> stream_;
  std::unique_ptr<client::ReferenceCache> reference_;
  int32_t checked_ = 0;
  int64_t check_failures_ = 0;
  int64_t step_count_ = 0;
  std::map<std::pair<int, int64_t>, attnd::v1::ForwardRequest> host_inputs_;
  absl::Duration last_step_wall_;
  absl::Duration last_plan_wall_;
  int64_t last_step_keys_ = 0;  // RunStep's: the first entry's keys after its new token(s)
  absl::Duration prompt_plan_;
  LatencyRecorder latency_;
  LatencyRecorder attnd_latency_;  // CUDA_IPC: fill done to done wait passed, per layer
  // The host's time per timed layer: the fill's launch, and the hand-off call (ready + done
  // wait, or NCCL's send and receive groups) after it.
  LatencyRecorder fill_host_;
  LatencyRecorder signal_host_;
  // --fill_sets_ready, for CUDA_IPC channels (the only kind with a ready word on the device).
  bool FillSetsReady(const client::Channel& channel) const {
    return fill_sets_ready_ && channel.kind() == attnd::v1::CHANNEL_KIND_CUDA_IPC;
  }
  // The word the fill of `layer` sets: its ready word where the fill sets it, else none.
  uint32_t* ReadyWordOf(const client::Channel& channel, int32_t layer) const {
    return FillSetsReady(channel) ? channel.ReadyWord(layer) : nullptr;
  }
  const bool fill_sets_ready_ = absl::GetFlag(FLAGS_fill_sets_ready);
  double fill_us_ = 0;         // GPU time of the emulator's fill of a decode layer
  double prompt_fill_us_ = 0;  // and of a prompt step's layer
};

}  // namespace

int RunChannelBench(client::Client& client, const attnd::v1::CacheInfo& cache,
                    const ChannelBenchSettings& settings, attnd::v1::ChannelKind kind) {
  if (cache.config().q_dtype() != attnd::v1::DTYPE_BFLOAT16 &&
      cache.config().q_dtype() != attnd::v1::DTYPE_FLOAT16) {
    absl::FPrintF(stderr, "attnctl bench: channels bench fp16/bf16 q only\n");
    return kExitUsage;
  }
  ChannelBench bench(client, cache, settings, kind);
  return bench.Run();
}

}  // namespace attnd::attnctl
