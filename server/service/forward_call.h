// One Forward on the hot path, unary or on a ForwardStream: the received message as slices,
// its decode by the wire codec (attnd/wire/forward_wire.h), the engine's arguments and outputs,
// and the encoded reply.
// The tensors' bytes are never copied here: the backend copies them from the slices straight
// into pinned staging, and the reply's o is the backend's lent pinned buffer. Calls are pooled
// and reused, so a Forward allocates nothing of attnd's own once its pool is warm (gRPC's
// per-message bookkeeping aside).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/server_callback.h>
#include <grpcpp/support/slice.h>

#include "backend/layer_trace.h"
#include "engine/specs.h"
#include "service/attention_service.h"
#include "attnd/wire/forward_wire.h"

namespace attnd {

struct ForwardCall {
  using Clock = std::chrono::steady_clock;
  // Where the answer goes (set by the owner before RunForward): `on_done(owner, call, status)`
  // runs exactly once with `response` encoded when status is OK.
  using OnDone = void (*)(void* owner, ForwardCall* call, absl::Status status);

  grpc::ByteBuffer request;
  std::vector<grpc::Slice> slices;  // the request's slices, referenced
  wire::ForwardRequest wire;
  ForwardArgs args;
  ForwardOutputs outputs;
  grpc::ByteBuffer response;
  Tenant tenant;
  uint64_t tag = 0;  // streams: echoed in the reply
  bool stream = false;
  Clock::time_point start;
  LayerTrace trace;
  LayerTraceSink* trace_sink = nullptr;  // set: the call is traced
  Metrics* metrics = nullptr;
  void* owner = nullptr;
  OnDone on_done = nullptr;
  // Unary calls: the reactor to finish and the message the reply goes into.
  grpc::ServerUnaryReactor* unary_reactor = nullptr;
  grpc::ByteBuffer* unary_reply = nullptr;

  // Drops the request, the reply and (through them) the lent output; keeps capacities.
  void Reset();
  // The received message's slices (no copy).
  void TakeSlices();
  void Mark(LayerTrace::Stage stage) {
    if (trace_sink != nullptr) trace.Mark(stage);
  }
  // Hands the trace to the sink (once the reply went out).
  void RecordTrace();
};

// Thread-safe free list of calls.
class ForwardCallPool {
 public:
  ForwardCall* Take();
  void Return(ForwardCall* call);  // resets it

 private:
  std::mutex mu_;
  std::vector<std::unique_ptr<ForwardCall>> all_;
  std::vector<ForwardCall*> free_;
};

// Runs call->wire (already parsed) through the engine as `tenant`'s call; call->on_done runs
// exactly once, possibly before this returns.
void RunForward(const ServiceContext& context, ForwardCall* call);

}  // namespace attnd
