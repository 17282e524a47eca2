"""Tensor conversion and request builders (no server)."""
import numpy as np
import pytest

import attnd
from attnd import tensors
from attnd.v1 import attnd_pb2 as pb


def test_bfloat16_rounds_to_nearest_even_and_keeps_nan():
    values = np.array([1.0, 1.00390625, 1.01171875, -2.5, np.inf, np.nan, 3.0e38],
                      dtype=np.float32)
    bits = tensors.float32_to_bfloat16_bits(values)
    back = tensors.bfloat16_bits_to_float32(bits)
    # 1 + 2^-8 is a tie: rounds to the even 1.0; 1 + 3*2^-8 rounds up to 1 + 2^-6.
    assert back[0] == 1.0 and back[1] == 1.0 and back[2] == 1.015625
    assert back[3] == -2.5 and np.isinf(back[4]) and np.isnan(back[5])
    assert abs(back[6] - 3.0e38) / 3.0e38 < 2 ** -8


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_numpy_round_trip_is_exact_for_representable_values(dtype):
    values = (np.arange(24, dtype=np.float32).reshape(2, 3, 4) - 12) / 8
    message = tensors.to_proto(values, dtype)
    assert list(message.shape) == [2, 3, 4]
    assert len(message.data) == 24 * tensors.ELEMENT_BYTES[message.dtype]
    np.testing.assert_array_equal(tensors.to_numpy(message), values)


def test_float16_bytes_are_little_endian_row_major():
    message = tensors.to_proto(np.array([[1.0, -2.0]], dtype=np.float16))
    assert message.dtype == pb.DTYPE_FLOAT16
    assert message.data == b"\x00\x3c\x00\xc0"


def test_torch_round_trip_keeps_bfloat16_and_matches_numpy_rounding():
    torch = pytest.importorskip("torch")
    values = torch.randn(3, 2, 8, generator=torch.Generator().manual_seed(0))
    message = tensors.to_proto(values.to(torch.bfloat16))
    assert message.dtype == pb.DTYPE_BFLOAT16
    assert message.data == tensors.to_proto(values.numpy(), "bf16").data
    back = tensors.to_torch(message)
    assert back.dtype == torch.bfloat16 and back.shape == (3, 2, 8)
    assert torch.equal(back, values.to(torch.bfloat16))
    assert tensors.like(message, values).dtype == torch.bfloat16


def test_unsupported_dtype_is_refused_by_name():
    with pytest.raises(ValueError, match="dtype"):
        tensors.to_proto(np.zeros(3, dtype=np.int32))
    with pytest.raises(ValueError, match="expected one of"):
        tensors.dtype_enum("int8")


def test_cache_config_takes_short_enum_names():
    config = attnd.cache_config(kind="mla", num_layers=2, num_qo_heads=16, q_dtype="bf16",
                                kv_dtype="fp8_e4m3", layout="hnd", num_pages=8,
                                rope={"style": "neox", "theta": 5e5, "scaling": "llama3",
                                      "factor": 8},
                                page_table_mode="external", page_table_form="separate_kv")
    assert config.kind == pb.ATTENTION_KIND_MLA
    assert config.kv_dtype == pb.DTYPE_FLOAT8_E4M3 and config.q_dtype == pb.DTYPE_BFLOAT16
    assert config.layout == pb.KV_LAYOUT_HND
    assert config.rope.scaling == pb.ROPE_SCALING_LLAMA3 and config.rope.factor == 8
    assert config.page_table_form == pb.PAGE_TABLE_FORM_SEPARATE_KV
    with pytest.raises(ValueError, match="kind: expected one of"):
        attnd.cache_config(kind="mqa")


def test_plan_entries_from_pairs_and_dicts():
    assert attnd.plan_entry((7, 3)) == pb.PlanEntry(sequence_id=7, num_new_tokens=3)
    entry = attnd.plan_entry({"sequence_id": 1, "num_new_tokens": 2, "page_ids": [4, 5],
                              "kv_len": 20})
    assert list(entry.pages.page_ids) == [4, 5] and entry.pages.kv_len == 20
    options = attnd.attention_options({"causal": False}, return_lse=True)
    assert options.HasField("causal") and not options.causal and options.return_lse


def test_error_carries_code_message_and_method():
    import grpc
    error = attnd.AttndError(5, "name: no cache named 'x'", "GetCache")
    assert error.code == grpc.StatusCode.NOT_FOUND
    assert error.message == "name: no cache named 'x'"
    assert str(error) == "GetCache: NOT_FOUND: name: no cache named 'x'"
