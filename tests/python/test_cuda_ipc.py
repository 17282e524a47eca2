"""CUDA_IPC channels: torch CUDA tensors aliasing attnd's ring, ready/done on a torch stream.
Needs a GPU, torch with CUDA and an attnd on the CUDA backend on the same host: on the GPU
machine, `python3 -m pytest tests/python/test_cuda_ipc.py --attnd build/server/attnd
--backend cuda`. Skips elsewhere (CI has no GPU)."""
import pytest

import attnd

torch = pytest.importorskip("torch")
LAYERS, HQ, HKV, DIM = 3, 8, 2, 128


@pytest.fixture
def caches(client, cache_name):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device for torch")
    if "channel_cuda_ipc" not in client.server_info().extensions:
        pytest.skip("this attnd has no CUDA_IPC channels (run it with --backend cuda)")
    names = [cache_name, cache_name + "-grpc"]
    for name in names:
        client.create_cache(name, num_layers=LAYERS, num_qo_heads=HQ, num_kv_heads=HKV,
                            head_dim=DIM, q_dtype="bfloat16", num_pages=256,
                            rope={"style": "neox", "theta": 10000})
    yield names
    client.delete_cache(names[1], force=True)


def layer_inputs(generator, tokens):
    def randn(*shape):
        return torch.randn(*shape, generator=generator, device="cuda").to(torch.bfloat16)
    return [(randn(tokens, HQ, DIM), randn(tokens, HKV, DIM), randn(tokens, HKV, DIM))
            for _ in range(LAYERS)]


def test_cuda_ipc_steps_match_grpc_steps(client, caches):
    on_channel, over_grpc = caches
    generator = torch.Generator(device="cuda").manual_seed(0)
    with client.open_channel(on_channel, "cuda_ipc", max_tokens=64) as channel:
        view = channel.view(0, "q")
        assert view.is_cuda and view.dtype == torch.bfloat16 and view.shape == (64, HQ, DIM)
        for batch in ([(1, 40), (2, 9)], [(1, 1), (2, 1)]):
            tokens = sum(n for _, n in batch)
            inputs = layer_inputs(generator, tokens)
            with client.step(on_channel, batch, channel=channel) as step:
                served = [step.forward(layer, *inputs[layer]).o for layer in range(LAYERS)]
                torch.cuda.current_stream().synchronize()
            with client.step(over_grpc, batch) as step:
                expected = [step.forward(layer, *inputs[layer]).o for layer in range(LAYERS)]
            for layer in range(LAYERS):
                assert served[layer].is_cuda
                torch.testing.assert_close(served[layer], expected[layer], atol=1e-2, rtol=1e-2)


def test_cuda_ipc_zero_copy_write_and_stream_flags(client, caches):
    """The orchestrator's own kernels write q/k/v into the slot tensors; ready and done are
    stream operations; the host never waits until the end."""
    on_channel, over_grpc = caches
    generator = torch.Generator(device="cuda").manual_seed(1)
    inputs = layer_inputs(generator, 5)
    with client.open_channel(on_channel, "cuda_ipc", max_tokens=8, slots=LAYERS) as channel:
        with client.step(on_channel, [(7, 5)], channel=channel) as step:
            sequence = step.channel_sequence
            outputs = []
            for layer, (q, k, v) in enumerate(inputs):
                slot = channel.slot_of(layer)
                channel.view(slot, "q", 5).copy_(q * 1)   # stands for the projection kernel
                channel.view(slot, "k", 5).copy_(k)
                channel.view(slot, "v", 5).copy_(v)
                channel.set_ready(layer, sequence)
                channel.wait_done(layer, sequence)
                outputs.append(channel.view(slot, "o", 5).clone())
            torch.cuda.current_stream().synchronize()
    with client.step(over_grpc, [(7, 5)]) as step:
        expected = [step.forward(layer, *inputs[layer]).o for layer in range(LAYERS)]
    for layer in range(LAYERS):
        torch.testing.assert_close(outputs[layer], expected[layer], atol=1e-2, rtol=1e-2)


def test_nccl_steps_from_another_gpu_match_grpc_steps(client, caches):
    """attnd.nccl: the client on a second GPU joins attnd's NCCL communicator; plain steps give
    the gRPC path's o (attnd on GPU 0 with --devices=0, two GPUs visible to torch)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("an NCCL channel needs a GPU other than attnd's")
    if "channel_nccl" not in client.server_info().extensions:
        pytest.skip("this attnd has no NCCL channels (libnccl.so.2 did not load)")
    on_channel, over_grpc = caches
    generator = torch.Generator(device="cuda:1").manual_seed(2)
    with client.open_channel(on_channel, "nccl", max_tokens=64, with_lse=True,
                             device="cuda:1") as channel:
        for batch in ([(11, 40), (12, 9)], [(11, 1), (12, 1)]):
            tokens = sum(n for _, n in batch)
            def randn(*shape):
                return torch.randn(*shape, generator=generator, device="cuda:1").to(torch.bfloat16)
            inputs = [(randn(tokens, HQ, DIM), randn(tokens, HKV, DIM), randn(tokens, HKV, DIM))
                      for _ in range(LAYERS)]
            with client.step(on_channel, batch, channel=channel, return_lse=True) as step:
                served = [step.forward(layer, *inputs[layer]) for layer in range(LAYERS)]
            with client.step(over_grpc, batch, return_lse=True) as step:
                expected = [step.forward(layer, *[t.cpu() for t in inputs[layer]])
                            for layer in range(LAYERS)]
            for layer in range(LAYERS):
                assert served[layer].o.device == torch.device("cuda:1")
                assert torch.equal(served[layer].o.cpu(), expected[layer].o.cpu())
                assert torch.equal(served[layer].lse.cpu(), expected[layer].lse.cpu())
