// Drives the daemon's request path in-process, without a network: every request of a FuzzCase
// goes through the same functions the gRPC handlers call (service/convert.h decoding and
// validation, HandlePlan/HandleForward/HandleEndStep, HandleForkSequence, SequenceExporter and
// SequenceImporter, the engine) over the CPU backend, and
// the harness checks the engine's invariants after each request and after each case.
//
// An invariant that breaks is reported on stderr and ends the process with abort(), which
// libFuzzer (and the corpus replay test) records as a crash. Checked:
// - pool bytes: a request other than a successful Forward changes no byte of any pool; a
//   successful Forward changes only its layer, and there only the slots of the step's new
//   tokens (EXTERNAL: exactly the slots its page table names; MANAGED: at most one slot per
//   new token, each at a new token's in-page offset). Writes outside the pools are ASan's: the
//   CPU backend holds each cache's pools in one heap allocation of its own. After a fork, a
//   Forward may also turn a page into a copy of another (copy-on-write), and an EndStep that
//   commits early may too; an import may change its target cache's pages (those it reserved).
// - pages: after every step is ended, each MANAGED cache's used pages equal the pages its
//   sequences need (sum of ceil(length / page_size); at most that once forks share pages), the
//   Prometheus gauges agree (used + free = num_pages), and freeing every sequence returns
//   exactly the used pages, leaving 0 used and 0 shared.
// - lifecycle: a fork has the length asked and shares ceil(length / page_size) pages; an
//   export's chunks carry correct CRC-32s and as many as its header says; a damaged import
//   (a chunk dropped, corrupted or repeated) fails, changing no counter; an intact one exports
//   the same bytes again.
// - steps: after EndStep/abort/stream close/expiry of everything the case opened, the engine
//   has no open step and every cache reports open_steps == 0.
// - budget: once the case's caches are deleted, the whole KV budget is free again.
//
// Not thread-safe: one harness per process (libFuzzer runs inputs one at a time).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "fuzz_case.pb.h"

namespace attnd::fuzz {

// KV budget of the harness's CPU backend: small, so that capacity errors are reachable and
// pool snapshots stay cheap.
inline constexpr int64_t kHarnessKvBudgetBytes = int64_t{1} << 20;

class RequestHarness {
 public:
  RequestHarness();
  ~RequestHarness();
  RequestHarness(const RequestHarness&) = delete;
  RequestHarness& operator=(const RequestHarness&) = delete;

  // Runs one case and checks the invariants above.
  void Run(const FuzzCase& fuzz_case);
  // Random bytes: parses them as every request type in turn (CreateCacheRequest, PlanRequest,
  // ForwardRequest, EndStepRequest, StreamRequest, FreeSequencesRequest, DeleteCacheRequest,
  // GetCacheRequest, ForkSequenceRequest, ImportSequenceRequest) and runs what parses as one
  // case.
  void RunRawBytes(const uint8_t* data, size_t size);

 private:
  struct State;
  std::unique_ptr<State> state_;
};

// The libFuzzer entry point's body: a FuzzCase when the bytes parse as one, else raw bytes.
void RunInput(RequestHarness& harness, const uint8_t* data, size_t size);

}  // namespace attnd::fuzz
