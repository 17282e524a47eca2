"""A real model's attention served by attnd, in every CI run: a small Llama written in plain
torch (CPU; the math of HF LlamaAttention: RoPE with theta in rotate_half (neox) layout, GQA,
causal), random weights from a fixed seed. Prompts of different lengths are prefilled in chunks,
then decoded greedily with continuous batching; the logits of the served run must match the
model run alone and the greedy tokens must be identical.

client/python/examples/llama_transformers.py is the same check with transformers'
LlamaForCausalLM, for the GPU machine.
"""
import os
import sys

import numpy as np
import pytest

from conftest import REPO, require_extension

torch = pytest.importorskip("torch")
sys.path.insert(0, os.path.join(REPO, "client", "python", "examples"))
import workload  # noqa: E402

HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB = 256, 2, 8, 2, 64, 512, 512
THETA = 10000.0


class TinyLlama(torch.nn.Module):
    def __init__(self, seed=0):
        super().__init__()
        generator = torch.Generator().manual_seed(seed)

        def weight(*shape, scale=None):
            scale = scale or shape[-1] ** -0.5
            return torch.nn.Parameter(torch.randn(*shape, generator=generator) * scale)

        self.embed = weight(VOCAB, HIDDEN, scale=1.0)
        self.layers = []
        for _ in range(LAYERS):
            self.layers.append({
                "norm1": torch.ones(HIDDEN), "norm2": torch.ones(HIDDEN),
                "q": weight(HEADS * HEAD_DIM, HIDDEN), "k": weight(KV_HEADS * HEAD_DIM, HIDDEN),
                "v": weight(KV_HEADS * HEAD_DIM, HIDDEN), "o": weight(HIDDEN, HEADS * HEAD_DIM),
                "gate": weight(FFN, HIDDEN), "up": weight(FFN, HIDDEN),
                "down": weight(HIDDEN, FFN)})
        self.final_norm = torch.ones(HIDDEN)
        self.lm_head = weight(VOCAB, HIDDEN)

    @staticmethod
    def rms_norm(x, weight, eps=1e-5):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight

    @staticmethod
    def rope(x, positions):
        # HF: inv_freq = theta^(-2i/d); q * cos + rotate_half(q) * sin.
        inv_freq = THETA ** (-torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM)
        angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]
        emb = torch.cat([angles, angles], dim=-1)
        cos, sin = emb.cos().float()[:, None, :], emb.sin().float()[:, None, :]
        rotated = torch.cat([-x[..., HEAD_DIM // 2:], x[..., :HEAD_DIM // 2]], dim=-1)
        return x * cos + rotated * sin

    def run(self, token_ids, attend):
        """attend(layer, q, k, v) -> o [T, HEADS, HEAD_DIM], q/k/v before RoPE."""
        x = self.embed[torch.as_tensor(token_ids)]
        tokens = x.shape[0]
        for index, layer in enumerate(self.layers):
            h = self.rms_norm(x, layer["norm1"])
            q = (h @ layer["q"].T).view(tokens, HEADS, HEAD_DIM)
            k = (h @ layer["k"].T).view(tokens, KV_HEADS, HEAD_DIM)
            v = (h @ layer["v"].T).view(tokens, KV_HEADS, HEAD_DIM)
            o = attend(index, q, k, v).reshape(tokens, HEADS * HEAD_DIM)
            x = x + o @ layer["o"].T
            h = self.rms_norm(x, layer["norm2"])
            x = x + (torch.nn.functional.silu(h @ layer["gate"].T) * (h @ layer["up"].T)) @ layer["down"].T
        return self.rms_norm(x, self.final_norm) @ self.lm_head.T

    @torch.no_grad()
    def reference(self, token_ids):
        """The model alone over one whole sequence (causal attention in float32)."""
        positions = torch.arange(len(token_ids))

        def attend(layer, q, k, v):
            q, k = self.rope(q, positions), self.rope(k, positions)
            k = k.repeat_interleave(HEADS // KV_HEADS, dim=1)
            v = v.repeat_interleave(HEADS // KV_HEADS, dim=1)
            scores = torch.einsum("qhd,khd->hqk", q, k) / HEAD_DIM ** 0.5
            mask = torch.ones(len(token_ids), len(token_ids), dtype=torch.bool).tril()
            weights = scores.masked_fill(~mask, float("-inf")).softmax(-1)
            return torch.einsum("hqk,khd->qhd", weights, v)
        return self.run(token_ids, attend).numpy()

    @torch.no_grad()
    def served(self, step, token_ids, positions):
        """One step's new tokens with attention (RoPE, KV cache) in attnd."""
        return self.run(token_ids, lambda layer, q, k, v: step.forward(layer, q, k, v).o.float()).numpy()


# Logits here reach ~4.3; measured errors (CPU backend) are ~0.002 (float16) and ~0.01
# (bfloat16, 8-bit mantissa on q/k/v/o). The bounds leave ~5x room, and are far below what a
# wrong RoPE position, theta or causal mask produces (errors of order 1).
@pytest.mark.parametrize("q_dtype,tolerance", [("float16", 0.01), ("bfloat16", 0.05)])
@pytest.mark.parametrize("transport", ["stream", "host_shm"])
def test_llama_logits_match_with_attention_served_by_attnd(client, cache_name, q_dtype,
                                                           tolerance, transport):
    if transport == "host_shm":
        require_extension(client, "channel_host_shm")
    client.create_cache(cache_name, num_layers=LAYERS, num_qo_heads=HEADS,
                        num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, q_dtype=q_dtype,
                        page_size=16, num_pages=64, rope={"style": "neox", "theta": THETA})
    model = TinyLlama(seed=0)
    # Three prompts at once (chunked in 16s), two joining during decoding; all leave at
    # different steps.
    sequences = workload.make_sequences(VOCAB, prompt_lengths=[5, 23, 40, 9, 17],
                                        max_new_tokens=[12, 6, 10, 8, 5],
                                        arrivals=[0, 0, 0, 4, 7], seed=1)
    free = lambda ids: client.free_sequences(cache_name, ids)  # noqa: E731
    if transport == "stream":
        with client.stream() as stream:
            stats = workload.serve(lambda entries: stream.step(cache_name, entries),
                                   model.served, sequences, prefill_chunk=16, free=free)
    else:  # every layer's q/k/v and o through the shared ring and its flags
        with client.open_channel(cache_name, "host_shm", max_tokens=64) as channel:
            stats = workload.serve(lambda entries: client.step(cache_name, entries,
                                                               channel=channel),
                                   model.served, sequences, prefill_chunk=16, free=free)
    assert stats.max_batch >= 3 and stats.decode_tokens == sum(s.max_new_tokens - 1
                                                               for s in sequences)
    assert client.get_cache(cache_name).used_pages == 0  # every sequence freed
    result = workload.compare(sequences, model.reference)
    print(f"{q_dtype} {transport}: {result.positions} positions, max |logit error| "
          f"{result.max_abs_logit_error:.4f} (logits up to {result.logit_scale:.2f}), "
          f"{stats.tokens_per_second:.0f} tokens/s ({transport}, CPU backend)")
    assert result.max_abs_logit_error < tolerance
    assert result.greedy_mismatches == []
