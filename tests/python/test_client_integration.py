"""The Python client against a real attnd (CPU backend): every RPC, errors with their codes,
steps that commit and roll back, a ForwardStream with several steps and layers in flight, and
outputs checked against a float64 oracle."""
import os
import threading

import grpc
import numpy as np
import pytest

import attnd
from attnd.v1 import attnd_pb2 as pb
from reference import attention, rope_neox

HQ, HKV, DIM = 4, 2, 64


def create(client, name, **overrides):
    fields = dict(num_layers=2, num_qo_heads=HQ, num_kv_heads=HKV, head_dim=DIM,
                  q_dtype="float16", num_pages=64, page_size=4)
    fields.update(overrides)
    return client.create_cache(name, **fields)


def random_qkv(rng, num_tokens):
    return (rng.standard_normal((num_tokens, HQ, DIM)).astype(np.float32),
            rng.standard_normal((num_tokens, HKV, DIM)).astype(np.float32),
            rng.standard_normal((num_tokens, HKV, DIM)).astype(np.float32))


def f16(x):
    return np.asarray(x, dtype=np.float16).astype(np.float64)


def test_server_info_and_health(client):
    info = client.server_info()
    assert info.backend in ("cpu", "cuda") and info.version
    assert info.limits.max_message_bytes > 0
    assert client.health() == "SERVING"
    assert client.health(attnd.READINESS_SERVICE) == "SERVING"


def test_cache_lifecycle_and_error_codes(client, cache_name):
    info = create(client, cache_name)
    assert info.name == cache_name and info.num_pages == 64 and info.used_pages == 0
    assert info.config.page_size == 4
    assert client.get_cache(cache_name).config.num_qo_heads == HQ
    assert cache_name in [cache.name for cache in client.list_caches()]
    with pytest.raises(attnd.AttndError) as error:
        create(client, cache_name)
    assert error.value.code == grpc.StatusCode.ALREADY_EXISTS
    assert cache_name in error.value.message and error.value.method == "CreateCache"
    with pytest.raises(attnd.AttndError) as error:
        client.create_cache(cache_name + "-bad", num_layers=1, num_qo_heads=4, num_kv_heads=3,
                            head_dim=64, num_pages=8)
    assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "num_kv_heads" in error.value.message
    client.delete_cache(cache_name)
    with pytest.raises(attnd.AttndError) as error:
        client.get_cache(cache_name)
    assert error.value.code == grpc.StatusCode.NOT_FOUND


def test_step_outputs_match_the_oracle_over_prefill_then_decode(client, cache_name):
    create(client, cache_name, rope={"style": "neox", "theta": 10000})
    rng = np.random.default_rng(1)
    history = {}  # (sequence, layer) -> (k, v) before rope, float16-rounded
    lengths = {7: 0, 8: 0}
    for batch in ([(7, 6), (8, 3)], [(7, 1), (8, 1)], [(8, 2), (7, 1)]):
        with client.step(cache_name, batch, return_lse=True) as step:
            assert step.kernel in ("prefill", "decode", "pod")
            for entry, result in zip(batch, step.entries):
                assert result.start_position == lengths[entry[0]]
            total = sum(n for _, n in batch)
            for layer in range(2):
                q, k, v = random_qkv(rng, total)
                out = step.forward(layer, q, k, v)
                assert out.o.dtype == np.float16 and out.lse.shape == (total, HQ)
                row = 0
                for sequence, count in batch:
                    start = lengths[sequence]
                    old_k, old_v = history.get((sequence, layer), (np.zeros((0, HKV, DIM)),) * 2)
                    rows = slice(row, row + count)
                    new_k = np.concatenate([old_k, f16(k[rows])])
                    new_v = np.concatenate([old_v, f16(v[rows])])
                    history[(sequence, layer)] = (new_k, new_v)
                    positions = np.arange(start, start + count)
                    expected_o, expected_lse = attention(
                        rope_neox(f16(q[rows]), positions),
                        rope_neox(new_k, np.arange(start + count)), new_v)
                    np.testing.assert_allclose(out.o[rows], expected_o, atol=5e-3, rtol=5e-3)
                    np.testing.assert_allclose(out.lse[rows], expected_lse, atol=5e-3, rtol=1e-3)
                    row += count
            assert out.step_committed and not step.open
        for sequence, count in batch:
            lengths[sequence] += count
    assert client.get_cache(cache_name).num_sequences == 2
    assert client.free_sequences(cache_name, [7, 8]) == 2 + 2  # 8 and 6 tokens, 4 a page
    assert client.get_cache(cache_name).used_pages == 0


def test_exception_in_the_block_rolls_the_step_back(client, cache_name):
    create(client, cache_name)
    rng = np.random.default_rng(2)
    with pytest.raises(KeyError):
        with client.step(cache_name, [(1, 5)]) as step:
            step.forward(0, *random_qkv(rng, 5))
            raise KeyError("orchestrator failed mid-step")
    assert client.get_cache(cache_name).used_pages == 0
    with client.step(cache_name, [(1, 2)]) as step:  # the sequence starts again at 0
        assert step.entries[0].start_position == 0
        step.forward(0, *random_qkv(rng, 2))
    assert step.outcome.outcome == pb.STEP_OUTCOME_COMMITTED and step.outcome.layers_run == 1
    assert client.stats().steps_aborted >= 1


def test_forward_errors_carry_the_code_and_leave_the_step_usable(client, cache_name):
    create(client, cache_name)
    rng = np.random.default_rng(3)
    with client.step(cache_name, [(1, 3)]) as step:
        q, k, v = random_qkv(rng, 3)
        with pytest.raises(attnd.AttndError) as error:
            step.forward(0, q[:2], k, v)
        assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "q" in error.value.message
        with pytest.raises(attnd.AttndError) as error:
            step.forward(5, q, k, v)
        assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT
        step.forward(0, q, k, v)
        step.forward(1, q, k, v)
    with pytest.raises(attnd.AttndError) as error:
        client.step(cache_name, [(1, 10 ** 6)])
    assert error.value.code in (grpc.StatusCode.RESOURCE_EXHAUSTED,
                                grpc.StatusCode.INVALID_ARGUMENT)


def test_torch_tensors_in_give_torch_bfloat16_out(client, cache_name):
    torch = pytest.importorskip("torch")
    create(client, cache_name, q_dtype="bfloat16", num_layers=1)
    generator = torch.Generator().manual_seed(4)
    q = torch.randn(3, HQ, DIM, generator=generator, dtype=torch.float32).to(torch.bfloat16)
    k = torch.randn(3, HKV, DIM, generator=generator).to(torch.bfloat16)
    v = torch.randn(3, HKV, DIM, generator=generator).to(torch.bfloat16)
    with client.step(cache_name, [(5, 3)]) as step:
        o = step.forward(0, q, k, v).o
    assert o.dtype == torch.bfloat16 and tuple(o.shape) == (3, HQ, DIM)
    expected, _ = attention(q.float().numpy(), k.float().numpy(), v.float().numpy())
    np.testing.assert_allclose(o.float().numpy(), expected, atol=2e-2, rtol=2e-2)


def test_stream_with_steps_and_layers_in_flight(client, cache_name):
    create(client, cache_name, num_layers=3)
    rng = np.random.default_rng(5)
    with client.stream(window=8) as stream:
        # Two micro-batches on disjoint sequences, planned before either runs; every layer
        # of both sent before any answer is read.
        plans = [stream.step_async(cache_name, [(10 + i, 4), (20 + i, 1)]) for i in range(2)]
        steps = [plan.result(10) for plan in plans]
        inputs = {(s, layer): random_qkv(rng, 5) for s in range(2) for layer in range(3)}
        futures = {(s, layer): steps[s].forward_async(layer, *inputs[(s, layer)])
                   for s in range(2) for layer in range(3)}
        results = {key: future.result(10) for key, future in futures.items()}
        # Layers in flight may run in any order: whichever ran last committed its step.
        for s in range(2):
            assert sum(results[(s, layer)].step_committed for layer in range(3)) == 1
        # Layer 0 of micro-batch 0: sequence 10's 4 tokens attend causally among themselves.
        q, k, v = inputs[(0, 0)]
        expected, _ = attention(f16(q[:4]), f16(k[:4]), f16(v[:4]))
        np.testing.assert_allclose(results[(0, 0)].o[:4], expected, atol=5e-3, rtol=5e-3)
        # A bad message fails alone; the stream lives on.
        with pytest.raises(attnd.AttndError) as error:
            stream.step(cache_name, [(10, 1), (10, 1)])
        assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert error.value.method == "ForwardStream/Plan"
        with stream.step(cache_name, [(10, 1)]) as step:
            assert step.entries[0].start_position == 4
            step.forward(0, *random_qkv(rng, 1))
        assert stream.in_flight == 0


def test_stream_steps_left_open_are_aborted_when_the_stream_ends(client, cache_name):
    create(client, cache_name)
    rng = np.random.default_rng(6)
    stream = client.stream()
    step = stream.step(cache_name, [(30, 4)])
    step.forward(0, *random_qkv(rng, 4))
    stream.cancel()
    with pytest.raises(attnd.AttndError):
        step.forward(1, *random_qkv(rng, 4))

    def rolled_back():
        return client.get_cache(cache_name).used_pages == 0 and \
            client.get_cache(cache_name).open_steps == 0
    deadline = threading.Event()
    for _ in range(100):
        if rolled_back():
            break
        deadline.wait(0.05)
    assert rolled_back()


def test_bearer_token_is_sent_and_checked(attnd_bin, tmp_path):
    from conftest import AttndProcess
    token_file = tmp_path / "tokens"
    token_file.write_text("alice s3cret-token-0123456789\n")
    process = AttndProcess(attnd_bin, [f"--token_file={token_file}"])
    try:
        with attnd.Client(process.address, token="s3cret-token-0123456789") as alice:
            alice.wait_for_ready(10)
            alice.create_cache("mine", num_layers=1, num_qo_heads=1, num_kv_heads=1,
                               head_dim=64, num_pages=4)
            assert [cache.name for cache in alice.list_caches()] == ["mine"]
        with attnd.Client(process.address, token="wrong-token-0123456789") as mallory:
            with pytest.raises(attnd.AttndError) as error:
                mallory.list_caches()
            assert error.value.code == grpc.StatusCode.UNAUTHENTICATED
            assert mallory.health() == "SERVING"  # health needs no token
    finally:
        process.stop()


def test_readme_python_quickstart_runs_as_written(server, capsys):
    import re
    from conftest import REPO
    with open(os.path.join(REPO, "README.md")) as f:
        readme = f.read()
    block = re.search(r"```python\n(import numpy as np\nimport attnd\n.*?)```", readme, re.S)
    assert block, "README.md lost its Python quickstart"
    exec(block.group(1).replace('"localhost:50051"', f'"{server.address}"'), {})
    assert float(capsys.readouterr().out.strip()) < 5e-4


def test_fork_export_import_round_trip(client, cache_name):
    create(client, cache_name)
    create(client, cache_name + "-b")
    rng = np.random.default_rng(5)
    q, k, v = random_qkv(rng, 6)
    with client.step(cache_name, [(1, 6)]) as step:
        for layer in range(2):
            step.forward(layer, q, k, v)
    forked = client.fork_sequence(cache_name, 1, 2)
    assert forked.num_tokens == 6 and forked.shared_pages == 2
    assert client.get_cache(cache_name).shared_pages == 2
    messages = list(client.export_sequence(cache_name, 2, max_chunk_bytes=1000))
    assert messages[0].header.num_tokens == 6 and messages[0].header.num_chunks == len(messages) - 1
    imported = client.import_sequence(cache_name + "-b", iter(messages), sequence_id=9)
    assert imported.sequence_id == 9 and imported.num_tokens == 6
    # The same next token on the source, the fork and the import: bitwise the same output.
    q1, k1, v1 = random_qkv(rng, 1)
    outputs = []
    for cache, sequence in ((cache_name, 1), (cache_name, 2), (cache_name + "-b", 9)):
        with client.step(cache, [(sequence, 1)], deterministic=True) as step:
            outputs.append([step.forward(layer, q1, k1, v1).o for layer in range(2)])
    for other in outputs[1:]:
        for layer in range(2):
            np.testing.assert_array_equal(outputs[0][layer], other[layer])
    # A corrupt chunk imports nothing.
    bad = [pb.ExportSequenceResponse() for _ in messages]
    for copy, message in zip(bad, messages):
        copy.CopyFrom(message)
    bad[1].chunk.crc32 ^= 1
    with pytest.raises(attnd.AttndError) as error:
        client.import_sequence(cache_name + "-b", iter(bad), sequence_id=10)
    assert error.value.code == grpc.StatusCode.DATA_LOSS and "crc32" in error.value.message
    assert client.get_cache(cache_name + "-b").num_sequences == 1
    client.delete_cache(cache_name, force=True)
    client.delete_cache(cache_name + "-b", force=True)
