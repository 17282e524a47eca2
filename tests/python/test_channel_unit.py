"""Channel layout parsing, flag words and a HOST_SHM step against a fake attnd thread (no
server): the client's half of the channel contract in proto/attnd/v1/attnd.proto."""
import os
import threading

import numpy as np
import pytest

import attnd
from attnd import channel as channels
from attnd.flags import FlagWords, reached
from attnd.step import Step
from attnd.v1 import attnd_pb2 as pb

NUM_LAYERS, HQ, HKV, DIM, MAX_TOKENS, SLOTS = 3, 4, 2, 64, 8, 2


def make_config(q_dtype=pb.DTYPE_FLOAT16):
    return pb.CacheConfig(num_layers=NUM_LAYERS, num_qo_heads=HQ, num_kv_heads=HKV,
                          head_dim=DIM, q_dtype=q_dtype, num_pages=16)


def make_info(q_dtype=pb.DTYPE_FLOAT16, with_lse=True):
    """A ChannelInfo laid out as attnd would: flags on their own 64-byte lines, then slots
    with 256-byte aligned regions."""
    element = 2
    rows = {"q": HQ * DIM * element, "k": HKV * DIM * element, "v": HKV * DIM * element,
            "o": HQ * DIM * element, "lse": HQ * 4 if with_lse else 0}
    layout = pb.ChannelLayout(ready_offsets=[64 * i for i in range(NUM_LAYERS)],
                              done_offsets=[64 * (NUM_LAYERS + i) for i in range(NUM_LAYERS)],
                              aborted_offset=64 * 2 * NUM_LAYERS)
    for name, row_bytes in rows.items():
        setattr(layout, f"{name}_row_bytes", row_bytes)
    offset = 1024
    for _ in range(SLOTS):
        slot = layout.slots.add()
        for name, row_bytes in rows.items():
            if row_bytes:
                setattr(slot, f"{name}_offset", offset)
                offset += (MAX_TOKENS * row_bytes + 255) // 256 * 256
    layout.ring_bytes = offset
    return pb.ChannelInfo(channel_id=9, cache="fake", kind=pb.CHANNEL_KIND_HOST_SHM,
                          max_tokens=MAX_TOKENS, slots=SLOTS, layout=layout,
                          shm_name="/attnd-test-ring")


def test_flags_compare_modulo_two_to_the_32():
    assert reached(5, 5) and reached(6, 5) and not reached(4, 5)
    assert reached(0, 0xFFFFFFFF) and reached(3, 0xFFFFFFFE)  # wrapped past the sequence
    assert not reached(0xFFFFFFFF, 0)


def test_layout_gives_each_tensor_its_offset_shape_and_dtype():
    layout = channels.parse_layout(make_info(), make_config())
    assert layout.max_tokens == MAX_TOKENS and len(layout.slots) == SLOTS
    assert layout.slots[0]["q"].offset == 1024 and layout.slots[0]["q"].row_shape == (HQ, DIM)
    assert layout.slots[1]["k"].row_shape == (HKV, DIM)
    assert layout.slots[0]["lse"].dtype == pb.DTYPE_FLOAT32
    assert "q_pe" not in layout.slots[0]
    assert "lse" not in channels.parse_layout(make_info(with_lse=False), make_config()).slots[0]


def test_layout_pointing_outside_the_ring_is_refused():
    info = make_info()
    info.layout.slots[1].o_offset = info.layout.ring_bytes - 16
    with pytest.raises(ValueError, match="slot 1 o .* outside the ring"):
        channels.parse_layout(info, make_config())
    info = make_info()
    info.layout.done_offsets[1] = info.layout.ring_bytes
    with pytest.raises(ValueError, match="flag offset"):
        channels.parse_layout(info, make_config())


def test_layout_that_disagrees_with_the_cache_shapes_is_refused():
    with pytest.raises(ValueError, match="q_row_bytes"):
        channels.parse_layout(make_info(), pb.CacheConfig(num_layers=NUM_LAYERS, num_qo_heads=8,
                                                          num_kv_heads=2, head_dim=DIM,
                                                          q_dtype=pb.DTYPE_FLOAT16))
    with pytest.raises(ValueError, match="ready and done offsets"):
        channels.parse_layout(make_info(), pb.CacheConfig(num_layers=2, num_qo_heads=HQ,
                                                          num_kv_heads=HKV, head_dim=DIM,
                                                          q_dtype=pb.DTYPE_FLOAT16))


@pytest.fixture
def shm_channel(tmp_path):
    """A HostShmChannel opened the way a real one is (by name, in a directory standing in for
    /dev/shm), over a ring no server owns."""
    def make(q_dtype=pb.DTYPE_FLOAT16):
        info = make_info(q_dtype)
        path = tmp_path / info.shm_name.lstrip("/")
        with open(path, "wb") as f:
            f.truncate(info.layout.ring_bytes)
        return channels.HostShmChannel(channels._DetachedClient(), channels._DetachedCall(info),
                                       make_config(q_dtype), shm_dir=str(tmp_path))
    return make


class FakeAttnd(threading.Thread):
    """Plays attnd's side of a channel step on its own mapping of the ring: per layer, wait
    ready >= sequence, read q, write o = 2 * q and lse = layer, set done (and wake it)."""

    def __init__(self, path, layout, sequence, num_tokens, abort_at_layer=None):
        super().__init__(daemon=True)
        self.memory = np.memmap(path, dtype=np.uint8, mode="r+")
        self.flags = FlagWords(self.memory.ctypes.data)
        self.layout, self.sequence, self.num_tokens = layout, sequence, num_tokens
        self.abort_at_layer = abort_at_layer
        self.error = None

    def run(self):
        try:
            for layer in range(NUM_LAYERS):
                self.flags.wait(self.layout.ready_offsets[layer], self.sequence, 10)
                slot = self.layout.slots[layer % SLOTS]
                q_bytes = self.num_tokens * slot["q"].row_bytes
                q = self.memory[slot["q"].offset:slot["q"].offset + q_bytes].view(np.float16)
                o = self.memory[slot["o"].offset:slot["o"].offset + q_bytes].view(np.float16)
                o[:] = q * 2
                lse_bytes = self.num_tokens * slot["lse"].row_bytes
                lse = self.memory[slot["lse"].offset:slot["lse"].offset + lse_bytes]
                lse.view(np.float32)[:] = layer
                if layer == self.abort_at_layer:
                    self.flags.store(self.layout.aborted_offset, self.sequence)
                self.flags.set(self.layout.done_offsets[layer], self.sequence)
        except BaseException as error:  # reported by the test
            self.error = error


class FakeTransport:
    def __init__(self):
        self.ended = []

    def end_step(self, step_id, abort):
        self.ended.append((step_id, abort))
        outcome = pb.STEP_OUTCOME_ABORTED if abort else pb.STEP_OUTCOME_COMMITTED
        return pb.EndStepResponse(outcome=outcome, layers_run=NUM_LAYERS)


def start_step(channel, transport, sequence, num_tokens):
    plan = pb.PlanResponse(step_id=41, num_tokens=num_tokens, channel_sequence=sequence)
    return Step(transport, plan, channel.config, channel, return_lse=True)


# Sequence 0 follows a step whose flags hold 0xFFFFFFFF: the words wrap.
@pytest.mark.parametrize("sequence", [1, 0])
def test_step_through_a_host_shm_channel_writes_slots_and_waits_done(shm_channel, tmp_path,
                                                                     sequence):
    channel = shm_channel()
    layout = channel.layout
    for offset in (*layout.ready_offsets, *layout.done_offsets, layout.aborted_offset):
        channel.flags.store(offset, sequence - 1)  # the previous step's flags
    num_tokens = 5
    server = FakeAttnd(tmp_path / "attnd-test-ring", channel.layout, sequence, num_tokens)
    server.start()
    transport = FakeTransport()
    rng = np.random.default_rng(0)
    with start_step(channel, transport, sequence, num_tokens) as step:
        # All layers submitted before any is collected: a third layer reuses slot 0, so it
        # must wait for layer 0's done flag (and read layer 0's o out) first.
        qs = [rng.standard_normal((num_tokens, HQ, DIM)).astype(np.float32)
              for _ in range(NUM_LAYERS)]
        kv = np.zeros((num_tokens, HKV, DIM), dtype=np.float32)
        pending = [step.forward_async(layer, qs[layer], kv, kv) for layer in range(NUM_LAYERS)]
        results = [p.result(timeout=10) for p in pending]
    server.join(10)
    assert server.error is None
    for layer, result in enumerate(results):
        assert result.o.dtype == np.float16 and result.o.shape == (num_tokens, HQ, DIM)
        np.testing.assert_array_equal(result.o, qs[layer].astype(np.float16) * 2)
        np.testing.assert_array_equal(result.lse, np.full((num_tokens, HQ), layer, np.float32))
    assert transport.ended == [(41, False)]  # committed on exit
    channel.close()


def test_bfloat16_slot_views_hold_bit_patterns_and_torch_views_alias_them(shm_channel):
    torch = pytest.importorskip("torch")
    channel = shm_channel(pb.DTYPE_BFLOAT16)
    values = np.linspace(-2, 2, 2 * HQ * DIM, dtype=np.float32).reshape(2, HQ, DIM)
    channel.write(0, "q", values, 2)
    assert channel.view(0, "q", 2).dtype == np.uint16
    view = channel.torch_view(0, "q", 2)
    assert view.dtype == torch.bfloat16
    assert torch.equal(view, torch.from_numpy(values).to(torch.bfloat16))
    view.fill_(1.5)  # a write through torch is what the numpy view reads
    np.testing.assert_array_equal(channel.read(0, "q", 2), np.full((2, HQ, DIM), 1.5))
    del view
    channel.close()


def test_aborted_step_raises_step_aborted_and_aborts_on_exit(shm_channel, tmp_path):
    channel = shm_channel()
    server = FakeAttnd(tmp_path / "attnd-test-ring", channel.layout, 7, 1, abort_at_layer=0)
    server.start()
    transport = FakeTransport()
    q = np.ones((1, HQ, DIM), dtype=np.float32)
    kv = np.ones((1, HKV, DIM), dtype=np.float32)
    with pytest.raises(attnd.StepAborted):
        with start_step(channel, transport, 7, 1) as step:
            step.forward(0, q, kv, kv)
    assert transport.ended == [(41, True)]
    for layer in (1, 2):  # let the fake server finish
        channel.set_ready(layer, 7)
    server.join(10)
    channel.close()


def test_wait_times_out_when_the_flag_never_comes(shm_channel):
    channel = shm_channel()
    with pytest.raises(TimeoutError):
        channel.wait_done(0, 3, timeout=0.05)
    channel.close()


def test_wrong_input_shape_is_refused_before_ready_is_set(shm_channel):
    channel = shm_channel()
    with pytest.raises(ValueError, match="expected shape"):
        channel.write(0, "q", np.zeros((3, HQ, DIM + 1), dtype=np.float32), 3)
    assert channel.flags.load(channel.layout.ready_offsets[0]) == 0
    channel.close()


class _FakeOpenClient:
    """A client whose OpenChannel records the request and answers one ChannelInfo; the channel
    class is replaced, so nothing is mapped."""

    metadata = ()
    timeout = 5.0

    def __init__(self):
        self.requests = []
        client = self

        class Stub:
            def OpenChannel(self, request, metadata=None):
                client.requests.append(request)
                return iter([pb.OpenChannelResponse(channel=make_info())])

        self.stub = Stub()

    def get_cache(self, name):
        return pb.CacheInfo(name=name, config=make_config())


@pytest.fixture
def fake_cuda_ipc(monkeypatch):
    """attnd.cuda_ipc.CudaIpcChannel replaced by a recorder of its keyword arguments (no torch,
    no libcuda)."""
    import attnd.cuda_ipc as cuda_ipc
    opened = []

    class FakeChannel:
        def __init__(self, client, call, config, **kwargs):
            opened.append(kwargs)

    monkeypatch.setattr(cuda_ipc, "CudaIpcChannel", FakeChannel)
    return opened


def test_open_channel_sends_the_client_pci_bus_id_it_is_given(fake_cuda_ipc):
    client = _FakeOpenClient()
    channels.open_channel(client, "fake", "cuda_ipc", 8, 2, False, 5.0,
                          client_pci_bus_id="0000:3b:00.0")
    assert client.requests[0].client_pci_bus_id == "0000:3b:00.0"
    assert client.requests[0].kind == pb.CHANNEL_KIND_CUDA_IPC


def test_open_channel_names_the_device_the_ring_will_be_mapped_on(fake_cuda_ipc, monkeypatch):
    import attnd.cuda_ipc as cuda_ipc
    asked = []
    monkeypatch.setattr(cuda_ipc, "device_pci_bus_id",
                        lambda device: asked.append(device) or "0000:9c:00.0")
    client = _FakeOpenClient()
    channels.open_channel(client, "fake", "cuda_ipc", 8, 2, False, 5.0, device="cuda:1")
    assert asked == ["cuda:1"]
    assert client.requests[0].client_pci_bus_id == "0000:9c:00.0"
    assert fake_cuda_ipc == [{"device": "cuda:1"}]  # the channel still maps on that device


def test_open_channel_leaves_the_bus_id_empty_when_nothing_is_to_be_checked(fake_cuda_ipc):
    # No device: the ring is mapped on attnd's own GPU. No torch CUDA: nothing to name.
    client = _FakeOpenClient()
    channels.open_channel(client, "fake", "cuda_ipc", 8, 2, False, 5.0)
    assert client.requests[0].client_pci_bus_id == ""
    from attnd.cuda_ipc import device_pci_bus_id
    assert device_pci_bus_id(None) == ""
    assert device_pci_bus_id("cpu") == ""


def test_pci_bus_ids_are_written_as_cuda_writes_them():
    from attnd.cuda_ipc import format_pci_bus_id
    assert format_pci_bus_id(0, 0x3B, 0) == "0000:3b:00.0"
    assert format_pci_bus_id(1, 0xC, 0x1F) == "0001:0c:1f.0"


# --- NCCL channels (attnd.nccl), against a fake libnccl that plays attnd's rank --------------

class FakeNccl:
    """Records each group (sends: the bytes sent; receives: where to) and answers a layer's
    receive group as attnd would: o = 2 * q (float16), lse = the layer."""

    def __init__(self):
        self.joined = []
        self.groups = []
        self.aborted = []
        self._layer = 0
        self._q = None

    def join(self, unique_id):
        self.joined.append(bytes(unique_id))
        return "comm"

    def group(self, send, buffers, comm, stream):
        import ctypes
        assert comm == "comm" and stream == 0
        if send:
            sent = [ctypes.string_at(pointer, count) for pointer, count in buffers]
            self.groups.append(("send", [(pointer, count) for pointer, count in buffers]))
            self._q = np.frombuffer(sent[0], dtype=np.float16)
            return
        self.groups.append(("recv", list(buffers)))
        (o_pointer, o_bytes), *rest = buffers
        o = (self._q * 2).astype(np.float16).tobytes()
        assert len(o) == o_bytes
        ctypes.memmove(o_pointer, o, o_bytes)
        for pointer, count in rest:  # lse
            ctypes.memmove(pointer, np.full(count // 4, self._layer, np.float32).tobytes(), count)
        self._layer = (self._layer + 1) % NUM_LAYERS

    def abort(self, comm):
        self.aborted.append(comm)


@pytest.fixture
def nccl_channel():
    pytest.importorskip("torch")
    from attnd.nccl import NcclChannel

    def make(library):
        info = make_info()
        info.kind = pb.CHANNEL_KIND_NCCL
        info.nccl_unique_id = bytes(range(128))
        return NcclChannel(channels._DetachedClient(), channels._DetachedCall(info),
                           make_config(), device="cpu", library=library)
    return make


def test_nccl_step_sends_each_layer_in_wire_order_and_reads_o(nccl_channel):
    library = FakeNccl()
    channel = nccl_channel(library)
    assert library.joined == [bytes(range(128))]
    num_tokens = 5
    transport = FakeTransport()
    rng = np.random.default_rng(1)
    qs = [rng.standard_normal((num_tokens, HQ, DIM)).astype(np.float32) for _ in range(NUM_LAYERS)]
    kv = np.zeros((num_tokens, HKV, DIM), dtype=np.float32)
    commits = []
    channel.before_commit = lambda: commits.append(len(transport.ended))
    with start_step(channel, transport, 3, num_tokens) as step:
        results = [step.forward(layer, qs[layer], kv, kv) for layer in range(NUM_LAYERS)]
    assert commits == [0]  # the channel finished its side before EndStep was sent
    base = channel._ring.data_ptr()
    for layer in range(NUM_LAYERS):
        slot = channel.layout.slots[layer % SLOTS]
        sends, receives = library.groups[2 * layer], library.groups[2 * layer + 1]
        # q, k, v of this layer's slot, T rows each; then o and lse back into the slot.
        assert sends == ("send", [(base + slot[name].offset, num_tokens * slot[name].row_bytes)
                                  for name in ("q", "k", "v")])
        assert receives == ("recv", [(base + slot[name].offset, num_tokens * slot[name].row_bytes)
                                     for name in ("o", "lse")])
        np.testing.assert_array_equal(results[layer].o.numpy(),
                                      qs[layer].astype(np.float16) * 2)
        np.testing.assert_array_equal(results[layer].lse.numpy(),
                                      np.full((num_tokens, HQ), layer, np.float32))
    assert transport.ended == [(41, False)]
    channel.close()
    assert library.aborted == ["comm"]  # aborted, never destroyed: attnd may be gone


def test_nccl_layers_out_of_order_are_refused_before_anything_is_sent(nccl_channel):
    library = FakeNccl()
    channel = nccl_channel(library)
    step = start_step(channel, FakeTransport(), 3, 2)
    kv = np.zeros((2, HKV, DIM), dtype=np.float32)
    with pytest.raises(ValueError, match="out of order"):
        step.forward_async(1, np.zeros((2, HQ, DIM), np.float32), kv, kv)
    assert library.groups == []
    with pytest.raises(NotImplementedError):
        channel.set_ready(0, 3)  # no ready words on an NCCL channel
    channel.close()


def test_open_channel_routes_nccl_to_the_nccl_client(monkeypatch):
    import attnd.nccl as nccl
    opened = []

    class FakeChannel:
        def __init__(self, client, call, config, **kwargs):
            opened.append((call.info.channel_id, kwargs))

    monkeypatch.setattr(nccl, "NcclChannel", FakeChannel)
    client = _FakeOpenClient()
    channels.open_channel(client, "fake", "nccl", 8, 2, True, 5.0, device="cuda:1")
    assert client.requests[0].kind == pb.CHANNEL_KIND_NCCL
    assert client.requests[0].client_pci_bus_id == ""  # only CUDA_IPC names a bus id
    assert opened == [(9, {"device": "cuda:1"})]


def test_a_missing_nccl_library_is_a_clear_error():
    from attnd.nccl import NcclLibrary
    with pytest.raises(RuntimeError, match="NCCL is not available"):
        NcclLibrary("libnccl-not-here.so.2")
