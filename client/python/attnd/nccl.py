"""NCCL channels (CHANNEL_KIND_NCCL): for an orchestrator on another host, or on a GPU of this
host that cannot map attnd's memory. Nothing is shared: attnd creates a 2-rank communicator
(rank 0) and names it in ChannelInfo.nccl_unique_id; this process joins as rank 1 on its own GPU
and, per layer, sends q, k, v (MLA: q_nope, q_pe, ckv, kpe) as one NCCL group and receives o
(and lse when the step returns it) as another, on a torch CUDA stream. The tensors go through a
local ring of the channel's layout on that GPU, so slots, views and Step work as for CUDA_IPC.

NCCL is loaded at run time through ctypes (libnccl.so.2, >= 2.14, as attnd does): PyTorch's CUDA
wheels ship it (the nvidia-nccl package), and that copy is found by import when the loader does
not find one of its own. On one host, prefer a CUDA_IPC channel from the orchestrator's GPU:
measured on two H200s, NCCL adds ~44 us per decode layer of the e2e shape, CUDA_IPC ~13 us
(docs/benchmarks.md).

    with client.open_channel("llama", "nccl", max_tokens=256, device="cuda:1") as channel:
        with client.step("llama", entries, channel=channel) as step:
            o = step.forward(layer, q, k, v).o     # sent, attended, received on the stream

Layers go in order (0, 1, ..., then the next step's 0): attnd's receives are queued in that
order, and NCCL pairs sends with receives by order alone.
"""
import contextlib
import ctypes
import os

from attnd.cuda_ipc import StreamOrderedChannel, device_pci_bus_id
from attnd.v1 import attnd_pb2 as pb

NCCL_UINT8 = 1  # ncclDataType_t ncclUint8
UNIQUE_ID_BYTES = 128
ATTND_RANK, CLIENT_RANK, RANKS = 0, 1, 2


class _UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_char * UNIQUE_ID_BYTES)]


def _candidate_paths(path):
    yield path
    try:  # PyTorch's CUDA wheels: nvidia/nccl/lib/libnccl.so.2
        import nvidia.nccl
        for folder in nvidia.nccl.__path__:
            yield os.path.join(folder, "lib", os.path.basename(path))
    except ImportError:
        pass


class NcclLibrary:
    """The few libnccl.so.2 entry points a channel needs."""

    def __init__(self, path="libnccl.so.2"):
        errors = []
        self.lib = None
        for candidate in _candidate_paths(path):
            try:
                self.lib = ctypes.CDLL(candidate)
                break
            except OSError as error:
                errors.append(str(error))
        if self.lib is None:
            raise RuntimeError("NCCL is not available: " + "; ".join(errors) +
                               " (install NCCL >= 2.14, or open a HOST_SHM or CUDA_IPC channel)")
        self.lib.ncclGetErrorString.restype = ctypes.c_char_p
        version = ctypes.c_int()
        self._check(self.lib.ncclGetVersion(ctypes.byref(version)), "ncclGetVersion")
        if version.value < 21400:
            raise RuntimeError(f"NCCL is not available: version {version.value} "
                               "(NCCL channels need 2.14 or later)")
        self.version = version.value

    def _check(self, result, what):
        if result != 0:
            words = None
            if hasattr(self.lib, "ncclGetErrorString"):
                words = self.lib.ncclGetErrorString(result)
            raise RuntimeError(f"{what}: {words.decode() if words else 'NCCL error'} ({result})")

    def join(self, unique_id):
        """ncclCommInitRank as the channel's rank 1 on the current CUDA device (blocking: it
        returns once attnd's rank 0 is in)."""
        if len(unique_id) != UNIQUE_ID_BYTES:
            raise ValueError(f"nccl_unique_id: expected {UNIQUE_ID_BYTES} bytes, "
                             f"got {len(unique_id)}")
        identity = _UniqueId()
        ctypes.memmove(ctypes.addressof(identity), bytes(unique_id), UNIQUE_ID_BYTES)
        comm = ctypes.c_void_p()
        self._check(self.lib.ncclCommInitRank(ctypes.byref(comm), RANKS, identity, CLIENT_RANK),
                    "ncclCommInitRank (rank 1 of the channel's communicator)")
        return comm

    def group(self, send, buffers, comm, stream):
        """One group of ncclSend (send) or ncclRecv of (pointer, bytes) buffers with attnd."""
        call = self.lib.ncclSend if send else self.lib.ncclRecv
        self._check(self.lib.ncclGroupStart(), "ncclGroupStart")
        failure = None
        for pointer, count in buffers:
            result = call(ctypes.c_void_p(pointer), ctypes.c_size_t(count),
                          ctypes.c_int(NCCL_UINT8), ctypes.c_int(ATTND_RANK), comm,
                          ctypes.c_void_p(stream))
            if result != 0:
                failure = result
                break
        ended = self.lib.ncclGroupEnd()  # ended even after a failure: an open group swallows more
        what = "ncclSend group (inputs to attnd)" if send else "ncclRecv group (o from attnd)"
        self._check(failure if failure is not None else ended, what)

    def abort(self, comm):
        self._check(self.lib.ncclCommAbort(comm), "ncclCommAbort")


# The wire order of a layer (attnd.proto, CHANNEL_KIND_NCCL).
MHA_INPUTS = ("q", "k", "v")
MLA_INPUTS = ("q", "q_pe", "ckv", "kpe")


class NcclChannel(StreamOrderedChannel):
    """An NCCL channel: a local ring of the channel's layout on `device` (a torch device; not
    attnd's GPU: NCCL puts one rank on a GPU), the layer exchanged with attnd on a stream.

    library: an NcclLibrary (tests give a fake)."""

    def __init__(self, client, call, config, device=None, library=None):
        super().__init__(client, call, config)
        import torch
        self._torch = torch
        self.device = torch.device(device if device is not None else "cuda")
        if self.device.type == "cuda":
            own = device_pci_bus_id(self.device)
            if own and own.lower() == self.info.pci_bus_id.lower():
                raise ValueError(f"channel: {self.device} is attnd's GPU ({own}), and NCCL cannot "
                                 "join two ranks on one GPU: open a CUDA_IPC channel, or pass "
                                 "another device")
        self.library = library if library is not None else NcclLibrary()
        self._ring = torch.zeros(self.layout.ring_bytes, dtype=torch.uint8, device=self.device)
        self._inputs = MLA_INPUTS if config.kind == pb.ATTENTION_KIND_MLA else MHA_INPUTS
        self._next_layer = 0
        # NCCL joins from the current CUDA device.
        on_device = (torch.cuda.device(self.device) if self.device.type == "cuda"
                     else contextlib.nullcontext())
        with on_device:
            self.comm = self.library.join(bytes(self.info.nccl_unique_id))

    def view(self, slot, name, num_tokens=None):
        """A torch tensor (no copy) of a slot's tensor in the local ring: [num_tokens or
        max_tokens, *row_shape] in its dtype, on this channel's device."""
        torch = self._torch
        spec = self.layout.slots[slot][name]
        rows = self.layout.max_tokens if num_tokens is None else num_tokens
        dtype = {pb.DTYPE_FLOAT16: torch.float16, pb.DTYPE_BFLOAT16: torch.bfloat16,
                 pb.DTYPE_FLOAT32: torch.float32}[spec.dtype]
        data = self._ring[spec.offset:spec.offset + rows * spec.row_bytes]
        return data.view(dtype).view((rows, *spec.row_shape))

    def exchange(self, layer, num_tokens, return_lse, stream=None):
        """Sends layer `layer`'s inputs from its slot and receives its o (and lse) into it, on
        `stream` (default: torch's current stream): work enqueued after it sees o."""
        if self.comm is None:
            raise RuntimeError(f"channel {self.channel_id}: the NCCL communicator is closed")
        if layer != self._next_layer:
            raise ValueError(f"channel {self.channel_id}: layer {layer} out of order (NCCL pairs "
                             f"sends by order: layer {self._next_layer} comes next)")
        self._next_layer = (layer + 1) % self.config.num_layers
        if num_tokens == 0:
            return  # a step of no rows moves nothing (attnd knows T from Plan too)
        slot = self.layout.slots[self.slot_of(layer)]
        base = self._ring.data_ptr()
        sends = [(base + slot[name].offset, num_tokens * slot[name].row_bytes)
                 for name in self._inputs]
        receives = [(base + slot["o"].offset, num_tokens * slot["o"].row_bytes)]
        if return_lse and "lse" in slot:
            receives.append((base + slot["lse"].offset, num_tokens * slot["lse"].row_bytes))
        raw = self._stream(stream)
        self.library.group(True, sends, self.comm, raw)
        self.library.group(False, receives, self.comm, raw)

    def set_ready(self, layer, sequence):
        raise NotImplementedError("an NCCL channel has no ready words: Step.forward sends the "
                                  "layer (NcclChannel.exchange)")

    def wait_done(self, layer, sequence, timeout=None, stream=None):
        """Nothing to wait for on the host: the receive is ordered on the stream."""

    def start_layer(self, step, layer):
        if self.completion == "rpc":
            raise ValueError("an NCCL channel has no RPC-completed mode (Forward{use_channel})")
        self.exchange(layer, step.num_tokens, step.return_lse)
        return None

    def _unmap(self):
        # Abort, not destroy: attnd may be gone, and NCCL kernels still waiting on the stream
        # exit only once the communicator is aborted.
        if self.comm is not None:
            comm, self.comm = self.comm, None
            self.library.abort(comm)
        self._ring = None
