"""Channels: a layer's tensors through memory attnd and the client both map, and per-layer
ready/done flag words, instead of Forward's bytes (proto: OpenChannel, ChannelLayout).

    with client.open_channel("llama", "host_shm", max_tokens=256) as channel:
        with client.step("llama", entries, channel=channel) as step:
            for layer in range(num_layers):
                o = step.forward(layer, q, k, v).o   # writes the slot, sets ready, waits done

For a step planned on a channel, layer l's inputs go into slot l mod slots; the client sets
ready[l] to the step's channel_sequence, attnd runs the layer and sets done[l] to it. The
client may write layer l + slots only once done[l] is set: Step.forward_async keeps that rule
(it waits for the slot's previous layer before reusing it) so `slots` layers can be in flight.

HOST_SHM (this module): the ring is a POSIX shared-memory object attnd created; the client maps
/dev/shm/<name> and reads and writes it through numpy views (slot(i)); flags are acquire/release
32-bit words with futex waits (attnd.flags). CUDA_IPC: attnd.cuda_ipc.

The OpenChannel call stays open while the channel lives: closing the channel (close(), the
with-block's end, or this process dying) ends it, and attnd then aborts the channel's open
steps. One thread should drive a channel at a time.
"""
import dataclasses
import mmap
import os
import threading

import grpc
import numpy as np

from attnd import config as cfg
from attnd import tensors
from attnd.errors import AttndError, StepAborted
from attnd.flags import FlagWords
from attnd.step import ForwardResult
from attnd.v1 import attnd_pb2 as pb

TENSOR_NAMES = ("q", "k", "v", "q_pe", "ckv", "kpe", "o", "lse")
INPUT_NAMES = ("q", "k", "v", "q_pe", "ckv", "kpe")


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One tensor of a slot: byte offset from the ring's start, per-row shape, wire dtype."""
    offset: int
    row_shape: tuple
    dtype: int
    row_bytes: int


@dataclasses.dataclass(frozen=True)
class Layout:
    """A checked ChannelLayout with the cache's shapes: slots[i][name] is a TensorSpec for
    every tensor the channel carries (MHA: q, k, v, o[, lse]; MLA: q, q_pe, ckv, kpe, o[, lse])."""
    ring_bytes: int
    max_tokens: int
    ready_offsets: tuple
    done_offsets: tuple
    aborted_offset: int
    slots: tuple


def row_shapes(config):
    """name -> (row shape, wire dtype) of every tensor a step of this cache carries."""
    q_dtype = config.q_dtype or pb.DTYPE_BFLOAT16
    heads = config.num_qo_heads
    if config.kind == pb.ATTENTION_KIND_MLA:
        rank, rope = config.kv_lora_rank or 512, config.rope_dim or 64
        return {"q": ((heads, rank), q_dtype), "q_pe": ((heads, rope), q_dtype),
                "ckv": ((rank,), q_dtype), "kpe": ((rope,), q_dtype),
                "o": ((heads, rank), q_dtype), "lse": ((heads,), pb.DTYPE_FLOAT32)}
    kv = (config.num_kv_heads, config.head_dim)
    return {"q": ((heads, config.head_dim), q_dtype), "k": (kv, q_dtype), "v": (kv, q_dtype),
            "o": ((heads, config.head_dim), q_dtype), "lse": ((heads,), pb.DTYPE_FLOAT32)}


def parse_layout(info, config):
    """Layout of a ChannelInfo, checked against the cache config and the ring's bounds (the
    client must never touch memory outside its mapping, whatever the server sent)."""
    layout = info.layout
    ring_bytes, max_tokens = int(layout.ring_bytes), int(info.max_tokens)
    if ring_bytes <= 0 or max_tokens <= 0:
        raise ValueError(f"channel layout: ring_bytes {ring_bytes}, max_tokens {max_tokens}")
    num_layers = config.num_layers
    if len(layout.ready_offsets) != num_layers or len(layout.done_offsets) != num_layers:
        raise ValueError(f"channel layout: expected {num_layers} ready and done offsets, got "
                         f"{len(layout.ready_offsets)} and {len(layout.done_offsets)}")
    if not layout.slots or (info.slots and len(layout.slots) != info.slots):
        raise ValueError(f"channel layout: {len(layout.slots)} slots, info says {info.slots}")
    for offset in (*layout.ready_offsets, *layout.done_offsets, layout.aborted_offset):
        if offset < 0 or offset % 4 or offset + 4 > ring_bytes:
            raise ValueError(f"channel layout: flag offset {offset} outside a {ring_bytes}-byte "
                             "ring or not 4-byte aligned")
    shapes = row_shapes(config)
    slots = []
    for index, slot in enumerate(layout.slots):
        specs = {}
        for name, (row_shape, dtype) in shapes.items():
            row_bytes = int(getattr(layout, f"{name}_row_bytes"))
            if row_bytes == 0:
                continue  # not carried (lse without with_lse)
            expected = int(np.prod(row_shape)) * tensors.ELEMENT_BYTES[dtype]
            if row_bytes != expected:
                raise ValueError(f"channel layout: {name}_row_bytes {row_bytes}, the cache's "
                                 f"shape {row_shape} needs {expected}")
            offset = int(getattr(slot, f"{name}_offset"))
            if offset < 0 or offset + max_tokens * row_bytes > ring_bytes:
                raise ValueError(f"channel layout: slot {index} {name} at {offset} "
                                 f"({max_tokens} x {row_bytes} bytes) outside the ring")
            specs[name] = TensorSpec(offset, tuple(row_shape), dtype, row_bytes)
        missing = {"q", "o"} - specs.keys()
        if missing:
            raise ValueError(f"channel layout: slot {index} has no {sorted(missing)}")
        slots.append(specs)
    return Layout(ring_bytes, max_tokens, tuple(layout.ready_offsets),
                  tuple(layout.done_offsets), int(layout.aborted_offset), tuple(slots))


class _OpenCall:
    """The OpenChannel call: its first message is the channel; it then stays open, and its
    end (a final message's `closed`, or the call failing) means the channel is gone."""

    def __init__(self, client, request, timeout_seconds):
        self._call = client.stub.OpenChannel(request, metadata=client.metadata)
        self._opened = threading.Event()
        self.info = None
        self.error = None
        self.closed_reason = None
        self._reader = threading.Thread(target=self._read, name="attnd-channel", daemon=True)
        self._reader.start()
        if not self._opened.wait(timeout_seconds):
            self._call.cancel()
            raise AttndError(grpc.StatusCode.DEADLINE_EXCEEDED,
                             f"no channel within {timeout_seconds} s", "OpenChannel")
        if self.error is not None:
            raise self.error

    def _read(self):
        try:
            for response in self._call:
                if self.info is None:
                    self.info = response.channel
                    self._opened.set()
                if response.closed:
                    self.closed_reason = response.closed
        except grpc.RpcError as error:
            if error.code() != grpc.StatusCode.CANCELLED or self.info is None:
                self.error = AttndError.from_rpc_error(error, "OpenChannel")
        finally:
            if self.closed_reason is None:
                self.closed_reason = str(self.error) if self.error else "the call ended"
            if self.info is None and self.error is None:
                self.error = AttndError(grpc.StatusCode.INTERNAL,
                                        "OpenChannel ended without a channel", "OpenChannel")
            self._opened.set()

    @property
    def alive(self):
        return self._reader.is_alive()

    def cancel(self):
        self._call.cancel()
        self._reader.join(5.0)


class _Pending:
    """A layer in flight on a channel; result() waits for it and reads o (and lse)."""

    def __init__(self, channel, step, layer, reference, rpc_future=None):
        self.channel, self.step, self.layer = channel, step, layer
        self.reference = reference
        self.rpc_future = rpc_future
        self._result = None
        self._error = None

    def done(self):
        return self._result is not None or self._error is not None

    def result(self, timeout=None):
        if not self.done():
            try:
                self._result = self.channel.collect(self, timeout)
            except BaseException as error:
                self._error = error
        if self._error is not None:
            raise self._error
        return self._result


class Channel:
    """Common part of every channel kind: the open call, the layout, slot bookkeeping and the
    Step hooks. Subclasses map the ring and implement views, flags and copies."""

    def __init__(self, client, call, config):
        self.client = client
        self._call = call
        self.info = call.info
        self.config = config
        self.layout = parse_layout(call.info, config)
        self.completion = "flags"  # "rpc": Forward{use_channel} completes each layer instead
        self.timeout_seconds = client.timeout or 60.0
        self._slot_users = [None] * len(self.layout.slots)  # slot -> _Pending not yet read

    channel_id = property(lambda self: self.info.channel_id)
    cache = property(lambda self: self.info.cache)
    max_tokens = property(lambda self: self.layout.max_tokens)
    num_slots = property(lambda self: len(self.layout.slots))

    @property
    def closed_reason(self):
        """Why the server ended the channel, or None while it is open."""
        return None if self._call.alive else self._call.closed_reason

    def slot_of(self, layer):
        return layer % len(self.layout.slots)

    # --- Step hooks --------------------------------------------------------------------------

    def submit(self, step, layer, q=None, k=None, v=None, *, q_pe=None, ckv=None, kpe=None):
        """Writes one layer's inputs into its slot and starts it (ready flag, or Forward with
        use_channel under completion="rpc"); returns a pending result."""
        if step.channel is not self:
            raise ValueError("the step was planned on another channel")
        num_tokens = step.num_tokens
        if num_tokens > self.max_tokens:
            raise ValueError(f"step has {num_tokens} tokens, the channel carries {self.max_tokens}")
        slot = self.slot_of(layer)
        previous = self._slot_users[slot]
        if previous is not None:
            previous.result()  # its done flag frees the slot (and its o is read out first)
        inputs = {"q": q, "k": k, "v": v, "q_pe": q_pe, "ckv": ckv, "kpe": kpe}
        for name, value in inputs.items():
            if value is not None:
                self.write(slot, name, value, num_tokens)
        reference = q if q is not None else ckv
        rpc_future = self.start_layer(step, layer)
        pending = _Pending(self, step, layer, reference, rpc_future)
        self._slot_users[slot] = pending
        return pending

    def start_layer(self, step, layer):
        """Hands a layer whose inputs are in its slot to attnd: sets its ready flag, or under
        completion="rpc" sends Forward{use_channel} and returns that call's future."""
        if self.completion == "rpc":
            return step.forward_request_async(pb.ForwardRequest(layer=layer, use_channel=True))
        self.set_ready(layer, step.channel_sequence)
        return None

    def collect(self, pending, timeout=None):
        """Waits for a submitted layer and reads its outputs out of the slot."""
        step, layer = pending.step, pending.layer
        timeout = self.timeout_seconds if timeout is None else timeout
        committed = False
        if pending.rpc_future is not None:
            committed = pending.rpc_future.result(timeout).step_committed
        self.wait_done(layer, step.channel_sequence, timeout)
        slot = self.slot_of(layer)
        o = self.read(slot, "o", step.num_tokens, pending.reference)
        lse = None
        if step.return_lse and "lse" in self.layout.slots[slot]:
            lse = self.read(slot, "lse", step.num_tokens, pending.reference)
        if self._slot_users[slot] is pending:
            self._slot_users[slot] = None
        return ForwardResult(o, lse, committed)

    def before_commit(self):
        """Called before a step on this channel is ended with a commit: whatever this side
        enqueued for its layers must have reached attnd (nothing to do for HOST_SHM, whose flags
        are set from the host)."""

    def wait_done(self, layer, sequence, timeout=None):
        """Waits (host side) until done[layer] reached `sequence`; StepAborted when the step
        was aborted instead (its done flags are still set so that no waiter hangs)."""
        raise NotImplementedError

    def set_ready(self, layer, sequence):
        raise NotImplementedError

    def write(self, slot, name, value, num_tokens):
        raise NotImplementedError

    def read(self, slot, name, num_tokens, reference=None):
        raise NotImplementedError

    # --- lifetime ----------------------------------------------------------------------------

    def close(self):
        """Closes the channel (attnd aborts its open steps) and unmaps the ring. Views of the
        ring must not be used afterwards."""
        if self._call.alive:
            try:
                self.client.close_channel(self.channel_id)
            except AttndError:
                pass  # already gone (cache deleted, server shut down): the call's end says so
            self._call.cancel()
        self._unmap()

    def _unmap(self):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


class HostShmChannel(Channel):
    """A HOST_SHM channel: numpy views of a POSIX shared-memory ring."""

    def __init__(self, client, call, config, shm_dir="/dev/shm"):
        super().__init__(client, call, config)
        name = self.info.shm_name.lstrip("/")
        if not name or "/" in name:
            raise ValueError(f"channel: bad shm_name {self.info.shm_name!r}")
        descriptor = os.open(os.path.join(shm_dir, name), os.O_RDWR)
        try:
            size = os.fstat(descriptor).st_size
            if size < self.layout.ring_bytes:
                raise ValueError(f"channel: shm object is {size} bytes, layout needs "
                                 f"{self.layout.ring_bytes}")
            self._map = mmap.mmap(descriptor, self.layout.ring_bytes)
        finally:
            os.close(descriptor)
        self._bytes = np.frombuffer(self._map, dtype=np.uint8)
        self.flags = FlagWords(self._bytes.ctypes.data)

    @classmethod
    def over_memory(cls, memory, info, config):
        """A channel over memory the caller provides (a writable buffer of ring_bytes), with
        no server: for tests of the layout and flag logic."""
        channel = cls.__new__(cls)
        Channel.__init__(channel, _DetachedClient(), _DetachedCall(info), config)
        channel._map = memory
        channel._bytes = np.frombuffer(memory, dtype=np.uint8)
        channel.flags = FlagWords(channel._bytes.ctypes.data)
        return channel

    def view(self, slot, name, num_tokens=None):
        """numpy view (no copy) of a slot's tensor: [num_tokens or max_tokens, *row_shape],
        float16/float32, or uint16 bfloat16 bit patterns."""
        spec = self.layout.slots[slot][name]
        rows = self.layout.max_tokens if num_tokens is None else num_tokens
        dtype = tensors.wire_numpy_dtype(spec.dtype)
        count = rows * spec.row_bytes // dtype.itemsize
        flat = np.frombuffer(self._map, dtype=dtype, count=count, offset=spec.offset)
        return flat.reshape((rows, *spec.row_shape))

    def slot(self, index):
        """Every tensor of a slot as a numpy view, by name."""
        return {name: self.view(index, name) for name in self.layout.slots[index]}

    def torch_view(self, slot, name, num_tokens=None):
        """torch view (no copy) of a slot's tensor, in its dtype (bfloat16 included)."""
        import torch
        spec = self.layout.slots[slot][name]
        rows = self.layout.max_tokens if num_tokens is None else num_tokens
        torch_dtype = {pb.DTYPE_FLOAT16: torch.float16, pb.DTYPE_BFLOAT16: torch.bfloat16,
                       pb.DTYPE_FLOAT32: torch.float32}[spec.dtype]
        element = tensors.ELEMENT_BYTES[spec.dtype]
        flat = torch.frombuffer(self._map, dtype=torch_dtype, count=rows * spec.row_bytes // element,
                                offset=spec.offset)
        return flat.reshape((rows, *spec.row_shape))

    def write(self, slot, name, value, num_tokens):
        spec = self.layout.slots[slot].get(name)
        if spec is None:
            raise ValueError(f"this channel carries no {name}")
        source = tensors.to_wire_numpy(value, spec.dtype)
        target = self.view(slot, name, num_tokens)
        if source.shape != target.shape:
            raise ValueError(f"{name}: expected shape {target.shape}, got {tuple(source.shape)}")
        np.copyto(target, source)

    def read(self, slot, name, num_tokens, reference=None):
        spec = self.layout.slots[slot][name]
        return tensors.from_wire_numpy(self.view(slot, name, num_tokens), spec.dtype, reference)

    def set_ready(self, layer, sequence):
        self.flags.set(self.layout.ready_offsets[layer], sequence)

    def wait_done(self, layer, sequence, timeout=None):
        timeout = self.timeout_seconds if timeout is None else timeout
        self.flags.wait(self.layout.done_offsets[layer], sequence, timeout)
        # The aborted word holds the sequence of the last aborted step; EndStep's outcome is
        # the authority (Step's with-block checks it), this only spares reading a dead slot.
        if self.flags.load(self.layout.aborted_offset) == sequence & 0xFFFFFFFF:
            raise StepAborted(f"channel {self.channel_id}: the step of sequence {sequence} was "
                              f"aborted (layer {layer})", "channel")

    def _unmap(self):
        self.flags = None
        self._bytes = None
        try:
            self._map.close()
        except (BufferError, AttributeError):
            pass  # views the caller still holds keep the mapping until they go


class _DetachedCall:
    def __init__(self, info):
        self.info = info
        self.alive = False
        self.closed_reason = "detached"

    def cancel(self):
        pass


class _DetachedClient:
    timeout = 10.0

    def close_channel(self, channel_id):
        pass


def open_channel(client, cache, kind, max_tokens, slots, with_lse, timeout_seconds,
                 client_pci_bus_id=None, **kwargs):
    kind = cfg.enum_value("channel_kind", kind)
    config = client.get_cache(cache).config
    if client_pci_bus_id is None and kind == pb.CHANNEL_KIND_CUDA_IPC:
        # attnd checks that the GPU the ring will be mapped on reaches its own (peer access),
        # and refuses the channel with a clear error when not.
        from attnd.cuda_ipc import device_pci_bus_id
        client_pci_bus_id = device_pci_bus_id(kwargs.get("device"))
    request = pb.OpenChannelRequest(cache=cache, kind=kind, max_tokens=max_tokens, slots=slots,
                                    with_lse=with_lse,
                                    client_pci_bus_id=client_pci_bus_id or "")
    call = _OpenCall(client, request, timeout_seconds)
    try:
        if kind == pb.CHANNEL_KIND_HOST_SHM:
            return HostShmChannel(client, call, config, **kwargs)
        if kind == pb.CHANNEL_KIND_CUDA_IPC:
            from attnd.cuda_ipc import CudaIpcChannel
            return CudaIpcChannel(client, call, config, **kwargs)
        if kind == pb.CHANNEL_KIND_NCCL:
            from attnd.nccl import NcclChannel
            return NcclChannel(client, call, config, **kwargs)
        raise ValueError(f"channel kind {kind} is not supported by this client")
    except BaseException:
        call.cancel()
        raise
