"""HOST_SHM channels against a real attnd (CPU backend): a step's layers through the shared
ring and its flags give the same o and lse as the same step over gRPC, in flag mode and in
RPC-completed mode, with layers in flight across the ring's slots; an exception rolls the
step back; closing the channel removes it from the cache."""
import numpy as np
import pytest

import attnd
from attnd.v1 import attnd_pb2 as pb
from conftest import require_extension
from reference import attention, rope_neox

LAYERS, HQ, HKV, DIM = 3, 4, 2, 64


@pytest.fixture
def caches(client, cache_name):
    """Two identical caches: one driven through a channel, one over gRPC."""
    require_extension(client, "channel_host_shm")
    names = [cache_name, cache_name + "-grpc"]
    for name in names:
        client.create_cache(name, num_layers=LAYERS, num_qo_heads=HQ, num_kv_heads=HKV,
                            head_dim=DIM, q_dtype="float16", num_pages=64, page_size=4,
                            rope={"style": "neox", "theta": 10000})
    yield names
    client.delete_cache(names[1], force=True)


def inputs(rng, tokens):
    return [(rng.standard_normal((tokens, HQ, DIM)).astype(np.float32),
             rng.standard_normal((tokens, HKV, DIM)).astype(np.float32),
             rng.standard_normal((tokens, HKV, DIM)).astype(np.float32))
            for _ in range(LAYERS)]


@pytest.mark.parametrize("completion", ["flags", "rpc"])
def test_channel_steps_match_grpc_steps(client, caches, completion):
    on_channel, over_grpc = caches
    rng = np.random.default_rng(11)
    with client.open_channel(on_channel, "host_shm", max_tokens=16, slots=2,
                             with_lse=True) as channel:
        channel.completion = completion
        info = client.get_cache(on_channel)
        assert [c.channel_id for c in info.channels] == [channel.channel_id]
        assert channel.info.kind == pb.CHANNEL_KIND_HOST_SHM and channel.num_slots == 2
        for batch in ([(1, 7), (2, 3)], [(1, 1), (2, 1)], [(2, 5), (1, 1), (3, 2)]):
            tokens = sum(n for _, n in batch)
            layer_inputs = inputs(rng, tokens)
            with client.step(on_channel, batch, channel=channel, return_lse=True) as step:
                assert step.channel_sequence != 0
                # Every layer submitted before any is collected: layer 2 reuses slot 0.
                pending = [step.forward_async(layer, *layer_inputs[layer])
                           for layer in range(LAYERS)]
                served = [p.result(timeout=20) for p in pending]
            assert step.outcome.outcome == pb.STEP_OUTCOME_COMMITTED
            with client.step(over_grpc, batch, return_lse=True) as step:
                expected = [step.forward(layer, *layer_inputs[layer]) for layer in range(LAYERS)]
            for layer in range(LAYERS):
                np.testing.assert_array_equal(served[layer].o, expected[layer].o)
                np.testing.assert_array_equal(served[layer].lse, expected[layer].lse)
    assert len(client.get_cache(on_channel).channels) == 0


def test_channel_step_against_the_oracle_and_rollback(client, caches):
    on_channel, _ = caches
    rng = np.random.default_rng(12)
    with client.open_channel(on_channel, "host_shm", max_tokens=8) as channel:
        (q, k, v), = inputs(rng, 5)[:1]
        with client.step(on_channel, [(9, 5)], channel=channel) as step:
            o = step.forward(0, q, k, v).o
            for layer in range(1, LAYERS):
                step.forward(layer, q, k, v)
        f16 = lambda x: x.astype(np.float16).astype(np.float64)  # noqa: E731
        positions = np.arange(5)
        expected, _ = attention(rope_neox(f16(q), positions), rope_neox(f16(k), positions), f16(v))
        np.testing.assert_allclose(o, expected, atol=5e-3, rtol=5e-3)
        with pytest.raises(RuntimeError):
            with client.step(on_channel, [(9, 2)], channel=channel) as step:
                step.forward(0, *inputs(rng, 2)[0])
                raise RuntimeError("orchestrator failed")
        with client.step(on_channel, [(9, 1)], channel=channel) as step:
            assert step.entries[0].start_position == 5  # the aborted step left nothing
            for layer in range(LAYERS):
                step.forward(layer, *inputs(rng, 1)[0])
        with pytest.raises(attnd.AttndError) as error:  # more tokens than the channel carries
            client.step(on_channel, [(10, 9)], channel=channel)
        assert error.value.code.name == "INVALID_ARGUMENT"
