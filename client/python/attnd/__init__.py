"""attnd: the Python client of the attnd attention-offload daemon.

    import attnd
    with attnd.Client("localhost:50051") as client:
        client.create_cache("llama", num_layers=2, num_qo_heads=8, num_kv_heads=2, head_dim=64,
                            q_dtype="float16", num_pages=256)
        with client.step("llama", [(1, 5)]) as step:          # sequence 1, 5 new tokens
            for layer in range(2):
                o = step.forward(layer, q, k, v).o              # numpy or torch in, same out

See client/python/README.md.
"""
from attnd.client import READINESS_SERVICE, Client, Tls
from attnd.config import attention_options, cache_config, plan_entry, rope_config
from attnd.errors import AttndError, StepAborted
from attnd.step import ForwardResult, Step
from attnd.stream import ForwardStream
from attnd.v1 import attnd_pb2 as pb

__version__ = "0.1.0"

__all__ = [
    "AttndError", "Client", "ForwardResult", "ForwardStream", "READINESS_SERVICE", "Step",
    "StepAborted", "Tls", "attention_options", "cache_config", "pb", "plan_entry", "rope_config",
]
