// Engine channels (DESIGN 3b): open, close, and the steps that run through them. A channel step
// has every layer in flight from Plan on: the backend's channel waits for each layer's ready
// word and reports the layer through ChannelLayerDone, which does what a Forward's completion
// does (count the layer, commit after the last) and answers a Forward{use_channel} waiting for it.
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "attnd/status_macros.h"
#include "engine/engine.h"
#include "engine/engine_state.h"

namespace attnd {
namespace {

constexpr int32_t kDefaultChannelSlots = 2;

}  // namespace

ChannelStatus Engine::State::ChannelStatusLocked(const ChannelEntry& channel) const {
  ChannelStatus status;
  status.id = channel.id;
  status.cache = channel.cache->spec.name;
  status.kind = channel.spec.kind;
  status.max_tokens = channel.spec.max_tokens;
  status.num_slots = channel.spec.num_slots;
  status.with_lse = channel.spec.with_lse;
  status.layout = channel.layout;
  if (channel.backend != nullptr) {
    status.shm_name = channel.backend->shm_name();
    status.cuda_ipc_handle = channel.backend->cuda_ipc_handle();
    status.pci_bus_id = channel.backend->pci_bus_id();
    status.device = channel.backend->device();
    status.peer_access = channel.backend->peer_access();
    status.nccl_unique_id = channel.backend->nccl_unique_id();
  }
  status.open_steps = channel.open_steps;
  status.last_sequence = channel.last_sequence;
  status.bytes_in = channel.bytes_in;
  status.bytes_out = channel.bytes_out;
  status.transferring = channel.transferring;
  return status;
}

absl::StatusOr<ChannelStatus> Engine::OpenChannel(
    const ChannelOpenSpec& spec, std::function<void(std::string reason)> on_closed) {
  std::shared_ptr<CacheEntry> cache;
  ChannelSpec backend_spec;
  std::shared_ptr<const ChannelLayout> layout;
  {
    absl::MutexLock lock(&state_->mu);
    if (state_->draining) {
      return absl::UnavailableError("server is draining: no new channels are accepted");
    }
    ASSIGN_OR_RETURN(cache, state_->UsableCacheLocked(spec.cache));
    const ServerLimitsOptions& limits = state_->options.limits;
    const CacheGeometry& geometry = cache->spec.geometry;
    if (spec.max_tokens < 1 || spec.max_tokens > limits.max_step_tokens) {
      return absl::InvalidArgumentError(absl::StrCat(
          "max_tokens: expected 1..", limits.max_step_tokens, " (--max_step_tokens), got ",
          spec.max_tokens));
    }
    int32_t slots = spec.num_slots;
    if (slots == 0) slots = std::min(kDefaultChannelSlots, geometry.num_layers);
    if (slots < 1 || slots > geometry.num_layers) {
      return absl::InvalidArgumentError(absl::StrCat("slots: expected 1..", geometry.num_layers,
                                                     " (the cache's num_layers; 0 = ",
                                                     kDefaultChannelSlots, "), got ",
                                                     spec.num_slots));
    }
    const size_t channels = state_->channels.size() + state_->opening_channels;
    if (static_cast<int32_t>(channels) >= limits.max_channels) {
      return absl::ResourceExhaustedError(
          absl::StrCat("channels: ", channels, " are open, the limit (--max_channels)"));
    }
    backend_spec.kind = spec.kind;
    backend_spec.max_tokens = spec.max_tokens;
    backend_spec.num_slots = slots;
    backend_spec.with_lse = spec.with_lse;
    backend_spec.client_pci_bus_id = spec.client_pci_bus_id;
    layout = std::make_shared<const ChannelLayout>(
        MakeChannelLayout(geometry, spec.max_tokens, slots, spec.with_lse));
    if (state_->channel_bytes + layout->ring_bytes > limits.max_channel_bytes) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "max_tokens: the ring needs ", layout->ring_bytes, " bytes (", slots, " slots of ",
          spec.max_tokens, " tokens) but open channels hold ", state_->channel_bytes,
          " of the ", limits.max_channel_bytes, " allowed (--max_channel_bytes)"));
    }
    // The id (which names the shared-memory object) and the ring's bytes are the channel's
    // from here; the ring is made without the lock.
    backend_spec.id = state_->next_channel_id++;
    // A channel that breaks on its own (an NCCL peer gone) closes as CloseChannel would; the
    // reaper thread destroys it later (never the channel's own thread, which this runs on).
    backend_spec.on_broken = [state = state_.get(), id = backend_spec.id](absl::Status why) {
      state->CloseBrokenChannel(id, why);
    };
    state_->channel_bytes += layout->ring_bytes;
    ++state_->opening_channels;
  }
  // Memory the device maps (cudaMalloc, or a shared-memory object registered with CUDA).
  absl::StatusOr<std::unique_ptr<BackendChannel>> created =
      cache->backend->CreateChannel(backend_spec);
  absl::Status refused = created.status();
  std::unique_ptr<BackendChannel> ring;
  if (created.ok()) ring = std::move(created).value();
  absl::StatusOr<ChannelStatus> opened;
  {
    absl::MutexLock lock(&state_->mu);
    --state_->opening_channels;
    if (refused.ok()) {
      // The cache may have been deleted (or have failed) meanwhile.
      absl::StatusOr<std::shared_ptr<CacheEntry>> usable = state_->UsableCacheLocked(spec.cache);
      if (!usable.ok()) {
        refused = usable.status();
      } else if (*usable != cache) {
        refused = absl::NotFoundError(absl::StrCat("cache: cache '", spec.cache,
                                                   "' was deleted while the channel opened"));
      }
    }
    if (!refused.ok()) {
      state_->channel_bytes -= layout->ring_bytes;
      // A refused open leaves no gap in the ids when nothing else took one meanwhile.
      if (state_->next_channel_id == backend_spec.id + 1) state_->next_channel_id = backend_spec.id;
      opened = absl::Status(refused.code(), absl::StrCat("open ", ChannelKindName(spec.kind),
                                                         " channel on cache '", spec.cache,
                                                         "': ", refused.message()));
    } else {
      auto channel = std::make_shared<ChannelEntry>();
      channel->id = backend_spec.id;
      channel->tenant = spec.tenant;
      channel->cache = cache;
      channel->spec = backend_spec;
      channel->layout = layout;
      channel->backend = std::move(ring);
      channel->on_closed = std::move(on_closed);
      state_->channels[channel->id] = channel;
      if (state_->metrics) state_->metrics->SetOpenChannels(state_->channels.size());
      opened = state_->ChannelStatusLocked(*channel);
    }
  }
  // A ring made for a cache deleted meanwhile goes here, without the lock (as does the last
  // reference to that cache).
  ring.reset();
  return opened;
}

void Engine::State::CloseChannelLocked(std::shared_ptr<ChannelEntry> channel,
                                       const std::string& reason, Deferred& deferred) {
  if (channel->closed) return;
  channel->closed = true;
  channels.erase(channel->id);
  std::vector<std::shared_ptr<StepEntry>> steps;
  for (auto& [id, step] : open_steps) {
    if (step->channel == channel) steps.push_back(step);
  }
  for (auto& step : steps) EndLocked(step, StepOutcome::kAborted, deferred);
  closing_channels.push_back(channel);
  if (metrics) metrics->SetOpenChannels(channels.size());
  if (channel->on_closed) {
    deferred.Add([on_closed = std::move(channel->on_closed), reason] { on_closed(reason); });
    channel->on_closed = nullptr;
  }
}

void Engine::State::CloseBrokenChannel(uint64_t channel_id, const absl::Status& why) {
  Deferred deferred;
  {
    absl::MutexLock lock(&mu);
    auto it = channels.find(channel_id);
    if (it == channels.end()) return;  // already closing
    CloseChannelLocked(it->second, absl::StrCat("channel broke: ", why.message()), deferred);
  }
  deferred.Run();
}

std::vector<std::shared_ptr<ChannelEntry>> Engine::State::TakeIdleChannelsLocked() {
  std::vector<std::shared_ptr<ChannelEntry>> idle;
  auto busy = std::partition(closing_channels.begin(), closing_channels.end(),
                             [](const std::shared_ptr<ChannelEntry>& channel) {
                               return channel->open_steps > 0 || channel->transferring;
                             });
  for (auto it = busy; it != closing_channels.end(); ++it) {
    channel_bytes -= (*it)->layout->ring_bytes;
    idle.push_back(std::move(*it));
  }
  closing_channels.erase(busy, closing_channels.end());
  return idle;
}

absl::Status Engine::CloseChannel(uint64_t channel_id, const std::string& tenant,
                                  const std::string& reason) {
  State::Deferred deferred;
  {
    absl::MutexLock lock(&state_->mu);
    auto it = state_->channels.find(channel_id);
    if (it == state_->channels.end() || it->second->tenant != tenant) {
      return absl::NotFoundError(absl::StrCat("channel_id: no open channel ", channel_id));
    }
    state_->CloseChannelLocked(it->second, reason, deferred);
  }
  deferred.Run();
  ReapIdleChannels();
  return absl::OkStatus();
}

void Engine::ReapIdleChannels() {
  std::vector<std::shared_ptr<ChannelEntry>> idle;
  {
    absl::MutexLock lock(&state_->mu);
    idle = state_->TakeIdleChannelsLocked();
  }
  for (auto& channel : idle) channel->backend.reset();
}

void Engine::CloseAllChannels(const std::string& reason) {
  State::Deferred deferred;
  {
    absl::MutexLock lock(&state_->mu);
    std::vector<std::shared_ptr<ChannelEntry>> open;
    for (auto& [id, channel] : state_->channels) open.push_back(channel);
    for (auto& channel : open) state_->CloseChannelLocked(channel, reason, deferred);
  }
  deferred.Run();
  ReapIdleChannels();
}

int Engine::OpenChannels() const {
  absl::MutexLock lock(&state_->mu);
  return static_cast<int>(state_->channels.size());
}

void Engine::State::StartChannelStep(const std::shared_ptr<StepEntry>& step) {
  ChannelEntry& channel = *step->channel;
  State* state = this;
  channel.backend->StartStep(step->backend_step.get(), step->channel_sequence,
                             step->batch->num_tokens,
                             [state, step](int32_t layer, absl::Status status) {
                               state->ChannelLayerDone(step, layer, std::move(status));
                             });
}

void Engine::State::ChannelLayerDone(const std::shared_ptr<StepEntry>& step, int32_t layer,
                                     absl::Status status) {
  Deferred deferred;
  {
    absl::MutexLock lock(&mu);
    if (status.ok()) {
      ChannelEntry& channel = *step->channel;
      const int64_t in = channel.layout->InputBytes(step->batch->num_tokens);
      const int64_t out =
          channel.layout->OutputBytes(step->batch->num_tokens, step->batch->options.return_lse);
      channel.bytes_in += in;
      channel.bytes_out += out;
      if (metrics) metrics->ChannelBytes(ChannelKindName(channel.spec.kind), in, out);
    }
    status = LayerLandedLocked(step, layer, std::move(status), deferred);
    // A device fault (INTERNAL after landing) ends the step: its other layers would wait on
    // ready words for nothing.
    if (status.code() == absl::StatusCode::kInternal && !step->ending) {
      EndLocked(step, StepOutcome::kAborted, deferred);
    }
    if (static_cast<size_t>(layer) < step->channel_waiters.size() &&
        step->channel_waiters[layer]) {
      auto waiter = std::move(step->channel_waiters[layer]);
      step->channel_waiters[layer] = nullptr;
      const bool aborted = step->ending && step->outcome == StepOutcome::kAborted;
      absl::Status answer = status;
      if (answer.ok() && aborted) {
        answer = absl::AbortedError(absl::StrCat("step_id: step ", step->id,
                                                 " was aborted while layer ", layer, " ran"));
      }
      deferred.Add([waiter = std::move(waiter), answer] { waiter(answer); });
    }
    TryFinalizeLocked(step, deferred);
  }
  deferred.Run();
}

}  // namespace attnd

namespace attnd {

// ---------------------------------------------------------------------------------------------
// Channels lent to sequence transfers
// ---------------------------------------------------------------------------------------------

absl::StatusOr<std::unique_ptr<ChannelTransfer>> Engine::LendChannel(uint64_t channel_id,
                                                                     const std::string& tenant) {
  absl::MutexLock lock(&state_->mu);
  auto it = state_->channels.find(channel_id);
  if (it == state_->channels.end() || it->second->tenant != tenant) {
    return absl::NotFoundError(absl::StrCat("channel_id: no open channel ", channel_id));
  }
  const std::shared_ptr<ChannelEntry>& channel = it->second;
  if (channel->spec.kind != ChannelKind::kHostShm && channel->spec.kind != ChannelKind::kCudaIpc) {
    return absl::FailedPreconditionError(absl::StrCat(
        "channel_id: channel ", channel_id, " is ", ChannelKindName(channel->spec.kind),
        ", which has no ring; transfers go through HOST_SHM or CUDA_IPC channels"));
  }
  if (channel->transferring) {
    return absl::FailedPreconditionError(absl::StrCat(
        "channel_id: channel ", channel_id, " already carries another sequence transfer"));
  }
  if (channel->open_steps > 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "channel_id: channel ", channel_id, " has ", channel->open_steps,
        " open steps; a channel carries steps or a transfer, not both at once"));
  }
  channel->transferring = true;
  std::unique_ptr<ChannelTransfer> lent(new ChannelTransfer());
  lent->state_ = state_.get();
  lent->channel_ = channel;
  return lent;
}

ChannelTransfer::~ChannelTransfer() {
  if (state_ == nullptr) return;
  // Tells a client waiting for a region that nothing more will be read (only attnd writes the
  // word, and one transfer at a time, so a load and a store make the increment).
  BackendChannel& ring = *channel_->backend;
  const int64_t end = channel_->layout->transfer_end;
  if (absl::StatusOr<uint32_t> ended = ring.LoadTransferFlag(end); ended.ok()) {
    ring.StoreTransferFlag(end, *ended + 1).IgnoreError();
  }
  std::vector<std::shared_ptr<ChannelEntry>> idle;
  {
    absl::MutexLock lock(&state_->mu);
    channel_->transferring = false;
    idle = state_->TakeIdleChannelsLocked();
  }
  // A channel closed during the transfer is freed here (joining its threads: this runs on an
  // RPC's thread, never on one of the channel's).
  for (auto& channel : idle) channel->backend.reset();
}

uint64_t ChannelTransfer::channel_id() const { return channel_->id; }
ChannelKind ChannelTransfer::kind() const { return channel_->spec.kind; }
const ChannelLayout& ChannelTransfer::layout() const { return *channel_->layout; }
BackendChannel& ChannelTransfer::ring() const { return *channel_->backend; }

absl::Status ChannelTransfer::CheckOpen() const {
  absl::MutexLock lock(&state_->mu);
  if (channel_->closed) {
    return absl::UnavailableError(absl::StrCat("channel_id: channel ", channel_->id,
                                               " closed during the transfer"));
  }
  return absl::OkStatus();
}

}  // namespace attnd
