#include "service/forward_call.h"

#include <utility>

#include "service/convert.h"

namespace attnd {

void ForwardCall::Reset() {
  request.Clear();
  slices.clear();
  wire.Clear();
  for (TensorArg* tensor : {&args.q, &args.k, &args.v, &args.q_pe, &args.ckv, &args.kpe}) {
    tensor->present = false;
    tensor->pieces = {};
  }
  outputs.lease.Release();
  response.Clear();
  tag = 0;
  trace = LayerTrace();
  trace_sink = nullptr;
  owner = nullptr;
  on_done = nullptr;
  unary_reactor = nullptr;
  unary_reply = nullptr;
}

void ForwardCall::TakeSlices() {
  if (!request.Dump(&slices).ok()) slices.clear();
}

void ForwardCall::RecordTrace() {
  if (trace_sink == nullptr) return;
  trace.step_id = args.step_id;
  trace.layer = args.layer;
  trace_sink->Record(trace);
}

ForwardCall* ForwardCallPool::Take() {
  std::lock_guard lock(mu_);
  if (free_.empty()) {
    all_.push_back(std::make_unique<ForwardCall>());
    return all_.back().get();
  }
  ForwardCall* call = free_.back();
  free_.pop_back();
  return call;
}

void ForwardCallPool::Return(ForwardCall* call) {
  call->Reset();
  std::lock_guard lock(mu_);
  free_.push_back(call);
}

namespace {

// The engine's completion: encode the reply from the lent output, then hand the call back.
void Finished(ForwardCall* call, absl::Status status) {
  if (status.ok()) {
    ForwardOutputs& outputs = call->outputs;
    int64_t o_bytes = DTypeBytes(outputs.o_dtype);
    for (const int64_t dim : outputs.o_shape) o_bytes *= dim;
    wire::ForwardResponseBytes response;
    response.o.dtype = static_cast<int32_t>(outputs.o_dtype);  // numbered as v1.DType
    response.o.shape = outputs.o_shape;
    response.o.bytes = {outputs.lease.o, static_cast<size_t>(o_bytes)};
    if (!outputs.lse_shape.empty()) {
      const int64_t lse_bytes = outputs.lse_shape[0] * outputs.lse_shape[1] * sizeof(float);
      response.lse = wire::TensorBytes{
          v1::DTYPE_FLOAT32, outputs.lse_shape,
          {reinterpret_cast<const uint8_t*>(outputs.lease.lse), static_cast<size_t>(lse_bytes)}};
    }
    response.step_committed = outputs.step_committed;
    // The lease moves into o's slice: it goes back once gRPC has sent the bytes.
    const wire::Lent owner{outputs.lease.release, outputs.lease.release_arg};
    outputs.lease.release = nullptr;
    wire::EncodeForwardResponse(response, owner, call->response,
                                call->stream ? std::optional<uint64_t>(call->tag) : std::nullopt);
  } else {
    call->outputs.lease.Release();
    if (!call->tenant.name.empty()) status = call->tenant.Scrub(status);
  }
  call->Mark(LayerTrace::kEncoded);
  call->on_done(call->owner, call, std::move(status));
}

}  // namespace

void RunForward(const ServiceContext& context, ForwardCall* call) {
  const absl::Status decoded = ForwardArgsFromWire(call->wire, call->args);
  if (!decoded.ok()) {
    call->on_done(call->owner, call, call->tenant.name.empty() ? decoded
                                                               : call->tenant.Scrub(decoded));
    return;
  }
  call->Mark(LayerTrace::kDecoded);
  call->args.tenant = call->tenant.name;
  call->args.trace = call->trace_sink != nullptr ? &call->trace : nullptr;
  call->outputs.o = nullptr;  // borrow the backend's output buffer
  call->outputs.lse = nullptr;
  context.engine->Forward(call->args, &call->outputs,
                          [call](absl::Status status) { Finished(call, std::move(status)); });
}

}  // namespace attnd
