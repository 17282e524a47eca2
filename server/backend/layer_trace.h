// Timestamps of one layer's trip through the daemon, for the hot-path breakdown of
// docs/benchmarks.md (tests/bench/hot_path_bench.cc). A trace is attached to a Forward only when
// the service has a LayerTraceSink (benchmarks); otherwise every stage is skipped by a null
// check, so the daemon pays one branch per stage.
#pragma once

#include <array>
#include <chrono>
#include <cstdint>

namespace attnd {

struct LayerTrace {
  enum Stage : int {
    kReceived,      // the request message reached the handler
    kDecoded,       // its fields are parsed (tensor bytes located, not copied)
    kValidated,     // the engine accepted it against the step
    kStaged,        // inputs copied into the backend's staging memory
    kEnqueued,      // device work enqueued
    kDeviceDone,    // the completion thread saw the layer's outputs in host staging
    kCopiedOut,     // outputs are where the response reads them
    kEncoded,       // the response message is built
    kWriteStarted,  // handed to gRPC
    kWritten,       // gRPC reported the write done (streams only)
    kNumStages
  };

  uint64_t step_id = 0;
  int32_t layer = 0;
  std::array<int64_t, kNumStages> ns{};  // steady clock; 0 = stage not reached

  static int64_t NowNs() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }
  void Mark(Stage stage) { ns[stage] = NowNs(); }
};

// Marks `stage` of a trace that may be absent.
inline void MarkStage(LayerTrace* trace, LayerTrace::Stage stage) {
  if (trace != nullptr) trace->Mark(stage);
}

// Receives finished traces; called from gRPC and backend threads, so thread-safe.
class LayerTraceSink {
 public:
  virtual ~LayerTraceSink() = default;
  virtual void Record(const LayerTrace& trace) = 0;
};

}  // namespace attnd
