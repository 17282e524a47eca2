// Engine::Forward: check one layer's tensors against the step, run it on the backend, and
// commit the step after its last layer.
#include <algorithm>
#include <initializer_list>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "attnd/status_macros.h"
#include "engine/engine.h"
#include "engine/engine_state.h"

namespace attnd {
namespace {

template <typename Dims>
std::string ShapeString(const Dims& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

bool SameShape(const std::vector<int64_t>& got, std::initializer_list<int64_t> expected) {
  return got.size() == expected.size() && std::equal(got.begin(), got.end(), expected.begin());
}

// A tensor the step needs: present (or omitted when the step has no rows), of the cache's
// q dtype, the expected shape, and exactly the bytes that shape holds. Allocates nothing unless
// it fails.
absl::Status CheckTensor(absl::string_view field, const TensorArg& tensor,
                         std::initializer_list<int64_t> shape, DType dtype) {
  int64_t elements = 1;
  for (const int64_t dim : shape) elements *= dim;
  if (!tensor.present) {
    if (elements == 0) return absl::OkStatus();
    return absl::InvalidArgumentError(absl::StrCat(field, ": required, expected shape ",
                                                   ShapeString(shape), " of ",
                                                   DTypeName(dtype)));
  }
  if (tensor.dtype != dtype) {
    return absl::InvalidArgumentError(absl::StrCat(field, ".dtype: expected ", DTypeName(dtype),
                                                   " (the cache's q_dtype), got ",
                                                   DTypeName(tensor.dtype)));
  }
  if (!SameShape(tensor.shape, shape)) {
    return absl::InvalidArgumentError(absl::StrCat(field, ".shape: expected ", ShapeString(shape),
                                                   ", got ", ShapeString(tensor.shape)));
  }
  const int64_t bytes = elements * DTypeBytes(dtype);
  const int64_t got = tensor.size_bytes();
  if (got != bytes) {
    return absl::InvalidArgumentError(absl::StrCat(field, ".data: expected ", bytes,
                                                   " bytes for shape ", ShapeString(shape),
                                                   " of ", DTypeName(dtype), ", got ", got));
  }
  return absl::OkStatus();
}

absl::Status CheckAbsent(absl::string_view field, const TensorArg& tensor, bool mla) {
  if (!tensor.present) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(field, ": not used by ", mla ? "MLA" : "MHA",
                                                 " caches; leave it unset"));
}

absl::Status CheckInputs(const ForwardArgs& args, const CacheGeometry& geometry,
                         int64_t num_tokens) {
  const int64_t tokens = num_tokens;
  const DType dtype = geometry.q_dtype;
  if (!geometry.mla) {
    RETURN_IF_ERROR(CheckTensor(
        "q", args.q, {tokens, geometry.num_qo_heads, geometry.k_head_dim}, dtype));
    RETURN_IF_ERROR(CheckTensor(
        "k", args.k, {tokens, geometry.num_kv_heads, geometry.k_head_dim}, dtype));
    RETURN_IF_ERROR(CheckTensor(
        "v", args.v, {tokens, geometry.num_kv_heads, geometry.v_head_dim}, dtype));
    RETURN_IF_ERROR(CheckAbsent("q_pe", args.q_pe, false));
    RETURN_IF_ERROR(CheckAbsent("ckv", args.ckv, false));
    return CheckAbsent("kpe", args.kpe, false);
  }
  RETURN_IF_ERROR(CheckTensor(
      "q", args.q, {tokens, geometry.num_qo_heads, geometry.k_head_dim}, dtype));
  RETURN_IF_ERROR(CheckTensor(
      "q_pe", args.q_pe, {tokens, geometry.num_qo_heads, geometry.v_head_dim}, dtype));
  RETURN_IF_ERROR(CheckTensor("ckv", args.ckv, {tokens, geometry.k_head_dim}, dtype));
  RETURN_IF_ERROR(CheckTensor("kpe", args.kpe, {tokens, geometry.v_head_dim}, dtype));
  RETURN_IF_ERROR(CheckAbsent("k", args.k, true));
  return CheckAbsent("v", args.v, true);
}

InputBytes PiecesOf(const TensorArg& tensor) {
  InputBytes bytes;
  if (tensor.present) bytes.pieces = tensor.pieces;
  return bytes;
}

}  // namespace

// Forward{use_channel}: the layer's inputs are in its channel slot. Sets the ready word for the
// client (a no-op when it already did) and answers once the channel reports the layer.
void Engine::ForwardThroughChannel(const ForwardArgs& args, ForwardOutputs* outputs,
                                   std::function<void(absl::Status)> done) {
  absl::Status rejected;
  std::shared_ptr<ChannelEntry> channel;
  uint32_t sequence = 0;
  {
    absl::MutexLock lock(&state_->mu);
    auto it = state_->open_steps.find(args.step_id);
    if (it == state_->open_steps.end() || it->second->tenant != args.tenant ||
        it->second->preparing) {
      rejected = state_->NotOpenLocked(args.step_id, args.tenant);
    } else {
      StepEntry& step = *it->second;
      const CacheGeometry& geometry = step.cache->spec.geometry;
      if (step.channel == nullptr) {
        rejected = absl::InvalidArgumentError(absl::StrCat(
            "use_channel: step ", step.id, " was not planned on a channel (Plan channel_id)"));
      } else if (step.channel->spec.kind == ChannelKind::kNccl) {
        rejected = absl::FailedPreconditionError(absl::StrCat(
            "use_channel: step ", step.id, " runs on an NCCL channel, whose inputs come only "
            "from the peer's ncclSend; Forward cannot signal them"));
      } else if (args.layer < 0 || args.layer >= geometry.num_layers) {
        rejected = absl::InvalidArgumentError(absl::StrCat(
            "layer: expected 0..", geometry.num_layers - 1, ", got ", args.layer));
      } else if (args.q.present || args.k.present || args.v.present || args.q_pe.present ||
                 args.ckv.present || args.kpe.present) {
        rejected = absl::InvalidArgumentError(
            "use_channel: the inputs are read from the channel slot; set no tensor");
      } else if (step.layers[args.layer] == LayerState::kDone) {
        rejected = absl::FailedPreconditionError(absl::StrCat(
            "layer: layer ", args.layer, " already ran in step ", step.id));
      } else if (static_cast<size_t>(args.layer) < step.channel_waiters.size() &&
                 step.channel_waiters[args.layer]) {
        rejected = absl::FailedPreconditionError(absl::StrCat(
            "layer: a Forward for layer ", args.layer, " of step ", step.id,
            " is already waiting"));
      } else {
        step.channel_waiters.resize(geometry.num_layers);
        std::weak_ptr<StepEntry> weak = it->second;
        State* state = state_.get();
        step.channel_waiters[args.layer] = [outputs, weak, state,
                                            done = std::move(done)](absl::Status status) {
          if (auto step = weak.lock()) {
            absl::MutexLock lock(&state->mu);
            outputs->step_committed = step->ending && step->outcome == StepOutcome::kCommitted &&
                                      step->layers_done ==
                                          static_cast<int32_t>(step->layers.size());
          }
          done(std::move(status));
        };
        step.last_activity = absl::Now();
        outputs->in_channel = true;
        outputs->o_shape.clear();
        outputs->lse_shape.clear();
        outputs->o_dtype = geometry.q_dtype;
        outputs->step_committed = false;
        channel = step.channel;
        sequence = step.channel_sequence;
      }
    }
  }
  if (!rejected.ok()) {
    done(rejected);
    return;
  }
  if (channel->backend) channel->backend->SignalReady(args.layer, sequence);
}

void Engine::Forward(const ForwardArgs& args, ForwardOutputs* outputs,
                     std::function<void(absl::Status)> done) {
  if (args.use_channel) {
    ForwardThroughChannel(args, outputs, std::move(done));
    return;
  }
  std::shared_ptr<StepEntry> step;
  absl::Status rejected;
  {
    absl::MutexLock lock(&state_->mu);
    auto it = state_->open_steps.find(args.step_id);
    if (it != state_->open_steps.end() &&
        (it->second->tenant != args.tenant || it->second->preparing)) {
      // Another tenant's step does not exist for this caller, nor one still being planned.
      it = state_->open_steps.end();
    }
    if (it == state_->open_steps.end()) {
      rejected = state_->NotOpenLocked(args.step_id, args.tenant);
    } else {
      step = it->second;
      const CacheEntry& cache = *step->cache;
      const CacheGeometry& geometry = cache.spec.geometry;
      if (cache.failed) {
        rejected = absl::InternalError(absl::StrCat("cache '", cache.spec.name,
                                                    "' failed: ", cache.failure,
                                                    "; abort the step and delete the cache"));
      } else if (args.layer < 0 || args.layer >= geometry.num_layers) {
        rejected = absl::InvalidArgumentError(absl::StrCat(
            "layer: expected 0..", geometry.num_layers - 1, ", got ", args.layer));
      } else if (step->channel != nullptr) {
        rejected = absl::InvalidArgumentError(absl::StrCat(
            "use_channel: step ", step->id, " runs through channel ", step->channel->id,
            ": its inputs come from the channel's slots (Forward with use_channel, or the "
            "ready words), not from Forward's tensors"));
      } else if (step->layers[args.layer] != LayerState::kPending) {
        rejected = absl::FailedPreconditionError(absl::StrCat(
            "layer: layer ", args.layer, " already ",
            step->layers[args.layer] == LayerState::kDone ? "ran" : "is running", " in step ",
            step->id));
      } else {
        rejected = CheckInputs(args, geometry, step->batch->num_tokens);
      }
      if (rejected.ok()) {
        step->layers[args.layer] = LayerState::kRunning;
        ++step->in_flight;
        ++state_->layers_in_flight;
        step->last_activity = absl::Now();
      }
    }
  }
  if (!rejected.ok()) {
    done(rejected);
    return;
  }
  MarkStage(args.trace, LayerTrace::kValidated);

  // Outside the lock: the step cannot end under us while in_flight > 0 holds its pages.
  const CacheGeometry& geometry = step->cache->spec.geometry;
  const int64_t tokens = step->batch->num_tokens;
  const int32_t o_dim = geometry.k_head_dim;  // MHA head_dim; MLA kv_lora_rank
  const bool want_lse = step->batch->options.return_lse;
  outputs->in_channel = false;
  outputs->o_dtype = geometry.q_dtype;
  outputs->o_shape.assign({tokens, geometry.num_qo_heads, o_dim});
  if (want_lse) {
    outputs->lse_shape.assign({tokens, geometry.num_qo_heads});
  } else {
    outputs->lse_shape.clear();
  }
  outputs->step_committed = false;
  outputs->lease = OutputLease();
  LayerIo io;
  io.layer = args.layer;
  io.q_bytes = PiecesOf(args.q);
  io.k_bytes = PiecesOf(args.k);
  io.v_bytes = PiecesOf(args.v);
  io.q_pe_bytes = PiecesOf(args.q_pe);
  io.ckv_bytes = PiecesOf(args.ckv);
  io.kpe_bytes = PiecesOf(args.kpe);
  if (outputs->o != nullptr) {
    // resize keeps a reused string's bytes: no zero-fill when the size repeats.
    outputs->o->resize(tokens * geometry.num_qo_heads * o_dim * DTypeBytes(geometry.q_dtype));
    if (want_lse) outputs->lse->resize(tokens * geometry.num_qo_heads * sizeof(float));
    io.o = outputs->o->data();
    io.lse = want_lse ? reinterpret_cast<float*>(outputs->lse->data()) : nullptr;
  } else {
    io.lease = &outputs->lease;
  }
  io.trace = args.trace;

  // The completion's state lives in `outputs`, so the callback below captures two pointers and
  // std::function stores it without allocating.
  outputs->running_step = std::move(step);
  outputs->running_done = std::move(done);
  outputs->running_layer = args.layer;
  State* state = state_.get();
  BackendStep* backend_step = outputs->running_step->backend_step.get();
  backend_step->RunLayer(io, [state, outputs](absl::Status status) {
    std::shared_ptr<StepEntry> step = std::move(outputs->running_step);
    std::function<void(absl::Status)> done = std::move(outputs->running_done);
    const int32_t layer = outputs->running_layer;
    State::Deferred deferred;
    {
      absl::MutexLock lock(&state->mu);
      const bool was_ending = step->ending;
      status = state->LayerLandedLocked(step, layer, std::move(status), deferred);
      // This layer committed the step when it was its last and the step was not ending yet.
      outputs->step_committed = status.ok() && !was_ending && step->ending &&
                                step->outcome == StepOutcome::kCommitted;
      state->TryFinalizeLocked(step, deferred);
    }
    // The step (and with it the backend step) may end here, outside the lock.
    step.reset();
    done(status);
    deferred.Run();
  });
}

}  // namespace attnd
