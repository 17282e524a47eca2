"""CUDA_IPC channels: torch CUDA tensors that alias a ring in attnd's GPU memory, with ready and
done flags on a torch CUDA stream.

The handle is opened with the CUDA driver API through ctypes (libcuda.so.1), not with
torch or cuda-python: libcuda comes with the GPU driver wherever a GPU works (no toolkit, no
particular libcudart soname, no extra package), its cuIpcOpenMemHandle takes the same 64-byte
handle as cudaIpcOpenMemHandle, and the flags need cuStreamWriteValue32/cuStreamWaitValue32,
which only the driver API has. torch has no public call that maps a raw IPC handle (its
multiprocessing path expects its own handle format), so torch is used only to wrap the mapped
pointer as tensors (__cuda_array_interface__, no copy) and for streams.

    with client.open_channel("llama", "cuda_ipc", max_tokens=256) as channel:
        with client.step("llama", entries, channel=channel) as step:
            q_slot = channel.view(channel.slot_of(0), "q", step.num_tokens)   # torch, aliases ring
            torch.matmul(x, w_q, out=q_slot.view(T, -1))                      # write in place
            channel.set_ready(0, step.channel_sequence)                        # on the stream
            channel.wait_done(0, step.channel_sequence)                        # on the stream
            o = channel.view(channel.slot_of(0), "o", step.num_tokens)         # read after the wait

Every flag operation is enqueued on `stream` (default: torch's current stream), so the host
never blocks and ordering follows the stream: kernels enqueued after wait_done see o.
"""
import ctypes

from attnd.channel import Channel
from attnd.step import ForwardResult
from attnd.v1 import attnd_pb2 as pb

_CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 1
_CU_STREAM_WAIT_VALUE_GEQ = 0


class _IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * 64)]


class CudaDriver:
    """The few libcuda entry points a CUDA_IPC channel needs."""

    def __init__(self):
        self.lib = ctypes.CDLL("libcuda.so.1")
        self._check(self.lib.cuInit(0), "cuInit")

    def _function(self, *names):
        for name in names:
            function = getattr(self.lib, name, None)
            if function is not None:
                return function
        raise RuntimeError(f"libcuda.so.1 has none of {names}")

    def _check(self, result, what):
        if result != 0:
            name = ctypes.c_char_p()
            self.lib.cuGetErrorName(result, ctypes.byref(name))
            raise RuntimeError(f"{what} failed: {name.value.decode() if name.value else result}")

    def device_by_pci_bus_id(self, pci_bus_id):
        device = ctypes.c_int()
        self._check(self.lib.cuDeviceGetByPCIBusId(ctypes.byref(device), pci_bus_id.encode()),
                    f"cuDeviceGetByPCIBusId({pci_bus_id})")
        return device.value

    def pci_bus_id(self, ordinal):
        device = ctypes.c_int()
        self._check(self.lib.cuDeviceGet(ctypes.byref(device), ordinal), f"cuDeviceGet({ordinal})")
        name = ctypes.create_string_buffer(64)
        self._check(self.lib.cuDeviceGetPCIBusId(name, 64, device), "cuDeviceGetPCIBusId")
        return name.value.decode()

    def primary_context(self, device):
        context = ctypes.c_void_p()
        self._check(self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(context), device),
                    "cuDevicePrimaryCtxRetain")
        return context

    def push(self, context):
        self._check(self._function("cuCtxPushCurrent_v2", "cuCtxPushCurrent")(context),
                    "cuCtxPushCurrent")

    def pop(self):
        context = ctypes.c_void_p()
        self._check(self._function("cuCtxPopCurrent_v2", "cuCtxPopCurrent")(ctypes.byref(context)),
                    "cuCtxPopCurrent")

    def open_ipc(self, handle_bytes):
        if len(handle_bytes) != 64:
            raise ValueError(f"cuda_ipc_handle: expected 64 bytes, got {len(handle_bytes)}")
        handle = _IpcHandle()
        # handle.reserved would be a copy (ctypes returns char arrays as bytes): write the struct.
        ctypes.memmove(ctypes.addressof(handle), handle_bytes, 64)
        pointer = ctypes.c_uint64()
        function = self._function("cuIpcOpenMemHandle_v2", "cuIpcOpenMemHandle")
        self._check(function(ctypes.byref(pointer), handle,
                             ctypes.c_uint(_CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)),
                    "cuIpcOpenMemHandle")
        return pointer.value

    def close_ipc(self, pointer):
        self._check(self.lib.cuIpcCloseMemHandle(ctypes.c_uint64(pointer)), "cuIpcCloseMemHandle")

    def stream_write_value32(self, stream, address, value):
        function = self._function("cuStreamWriteValue32_v2", "cuStreamWriteValue32")
        self._check(function(ctypes.c_void_p(stream), ctypes.c_uint64(address),
                             ctypes.c_uint32(value & 0xFFFFFFFF), ctypes.c_uint(0)),
                    "cuStreamWriteValue32")

    def stream_wait_value32(self, stream, address, value):
        # GEQ is (int32)(*address - value) >= 0: the proto's wrap-safe comparison.
        function = self._function("cuStreamWaitValue32_v2", "cuStreamWaitValue32")
        self._check(function(ctypes.c_void_p(stream), ctypes.c_uint64(address),
                             ctypes.c_uint32(value & 0xFFFFFFFF),
                             ctypes.c_uint(_CU_STREAM_WAIT_VALUE_GEQ)),
                    "cuStreamWaitValue32")


def format_pci_bus_id(domain, bus, device):
    """"0000:3b:00.0", as cudaDeviceGetPCIBusId writes it (attnd accepts any case)."""
    return f"{domain:04x}:{bus:02x}:{device:02x}.0"


def device_pci_bus_id(device):
    """The PCI bus id of the torch CUDA device a CUDA_IPC channel will be mapped on, for
    OpenChannelRequest.client_pci_bus_id. "" when there is nothing to check: no device given
    (the channel maps the ring on attnd's own GPU), not a CUDA device, or no torch with CUDA."""
    if device is None:
        return ""
    try:
        import torch
    except ImportError:
        return ""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return ""
    index = torch.cuda.current_device() if device.index is None else device.index
    properties = torch.cuda.get_device_properties(index)
    if all(hasattr(properties, name) for name in ("pci_domain_id", "pci_bus_id", "pci_device_id")):
        return format_pci_bus_id(properties.pci_domain_id, properties.pci_bus_id,
                                 properties.pci_device_id)
    return CudaDriver().pci_bus_id(index)


class _CudaArray:
    """Exposes a device pointer to torch.as_tensor through __cuda_array_interface__."""

    def __init__(self, pointer, shape, typestr):
        self.__cuda_array_interface__ = {"shape": tuple(shape), "typestr": typestr,
                                         "data": (pointer, False), "version": 2,
                                         "strides": None}


class StreamOrderedChannel(Channel):
    """What CUDA_IPC and NCCL channels share: slots as torch tensors on `self.device` (the
    subclass's view()), each layer handed over and its o awaited on a torch stream, so o can be
    read as soon as the layer is submitted (stream order), and a commit first waits for the
    device (attnd refuses to commit layers it has not been handed)."""

    def _stream(self, stream):
        """The raw handle of `stream`, by default torch's current stream on the device (0, no
        stream, for a CPU device: the tests drive the NCCL channel there)."""
        if self.device.type != "cuda":
            return 0
        if stream is None:
            stream = self._torch.cuda.current_stream(self.device)
        return stream.cuda_stream

    def slot(self, index, num_tokens=None):
        return {name: self.view(index, name, num_tokens) for name in self.layout.slots[index]}

    def write(self, slot, name, value, num_tokens):
        torch = self._torch
        if name not in self.layout.slots[slot]:
            raise ValueError(f"this channel carries no {name}")
        target = self.view(slot, name, num_tokens)
        if not torch.is_tensor(value):
            value = torch.as_tensor(value)
        if tuple(value.shape) != tuple(target.shape):
            raise ValueError(f"{name}: expected shape {tuple(target.shape)}, "
                             f"got {tuple(value.shape)}")
        target.copy_(value, non_blocking=True)

    def read(self, slot, name, num_tokens, reference=None):
        return self.view(slot, name, num_tokens).clone()

    def collect(self, pending, timeout=None):
        # Stream-ordered: the layer's wait was enqueued at submit time, so o can be read now.
        step, layer = pending.step, pending.layer
        committed = False
        if pending.rpc_future is not None:
            committed = pending.rpc_future.result(timeout).step_committed
        slot = self.slot_of(layer)
        o = self.read(slot, "o", step.num_tokens)
        lse = None
        if step.return_lse and "lse" in self.layout.slots[slot]:
            lse = self.read(slot, "lse", step.num_tokens)
        if self._slot_users[slot] is pending:
            self._slot_users[slot] = None
        return ForwardResult(o, lse, committed)

    def before_commit(self):
        # The hand-overs are stream operations: without this, EndStep could reach attnd before
        # the device performed the last layer's (FAILED_PRECONDITION, nothing committed).
        if self.device.type == "cuda":
            self._torch.cuda.synchronize(self.device)


class CudaIpcChannel(StreamOrderedChannel):
    """A CUDA_IPC channel: torch tensors aliasing the ring; flags on CUDA streams.

    device: the torch device to map the ring on (default: the GPU whose PCI bus id the server
    named; a peer GPU of the same host works too).
    """

    def __init__(self, client, call, config, device=None):
        super().__init__(client, call, config)
        import torch
        self._torch = torch
        self.driver = CudaDriver()
        if device is None:
            index = self.driver.device_by_pci_bus_id(self.info.pci_bus_id)
            device = torch.device("cuda", index)
        self.device = torch.device(device)
        torch.cuda.init()
        with torch.cuda.device(self.device):
            torch.cuda.current_stream()  # makes torch's primary context exist and current
            self._context = self.driver.primary_context(self.device.index)
            self.driver.push(self._context)
            try:
                self.base = self.driver.open_ipc(bytes(self.info.cuda_ipc_handle))
            finally:
                self.driver.pop()

    def view(self, slot, name, num_tokens=None):
        """A torch tensor (no copy) of a slot's tensor: [num_tokens or max_tokens, *row_shape]
        in its dtype, on this channel's device. Valid until close()."""
        torch = self._torch
        spec = self.layout.slots[slot][name]
        rows = self.layout.max_tokens if num_tokens is None else num_tokens
        typestr = {pb.DTYPE_FLOAT16: "<f2", pb.DTYPE_BFLOAT16: "<i2",
                   pb.DTYPE_FLOAT32: "<f4"}[spec.dtype]
        shape = (rows, *spec.row_shape)
        tensor = torch.as_tensor(_CudaArray(self.base + spec.offset, shape, typestr),
                                 device=self.device)
        return tensor.view(torch.bfloat16) if spec.dtype == pb.DTYPE_BFLOAT16 else tensor

    def set_ready(self, layer, sequence, stream=None):
        """Enqueues ready[layer] = sequence on `stream` (after the work that wrote the inputs)."""
        self.driver.stream_write_value32(self._stream(stream),
                                         self.base + self.layout.ready_offsets[layer], sequence)

    def wait_done(self, layer, sequence, timeout=None, stream=None):
        """Enqueues a wait for done[layer] >= sequence on `stream`: work enqueued after it sees
        the layer's o. (A step that aborts still sets its done flags; EndStep tells.)"""
        self.driver.stream_wait_value32(self._stream(stream),
                                        self.base + self.layout.done_offsets[layer], sequence)

    def start_layer(self, step, layer):
        rpc_future = super().start_layer(step, layer)
        if rpc_future is None:
            self.wait_done(layer, step.channel_sequence)
        return rpc_future

    def _unmap(self):
        if getattr(self, "base", None):
            self._torch.cuda.synchronize(self.device)
            self.driver.push(self._context)
            try:
                self.driver.close_ipc(self.base)
            finally:
                self.driver.pop()
            self.base = None
