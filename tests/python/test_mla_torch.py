"""DeepSeek-style MLA served by attnd in absorbed form, in every CI run: a small plain-torch
model whose attention modules carry transformers' DeepseekV3Attention names (q_a_proj,
q_a_layernorm, q_b_proj, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj), run through
client/python/examples/mla_absorb.py (the W_UK/W_UV absorption the transformers example uses)
and compared with the same model computing full, non-absorbed MLA alone (interleaved RoPE on
the rope part, causal)."""
import os
import sys

import pytest

from conftest import REPO

torch = pytest.importorskip("torch")
sys.path.insert(0, os.path.join(REPO, "client", "python", "examples"))
import mla_absorb  # noqa: E402
import workload  # noqa: E402

HIDDEN, LAYERS, VOCAB, THETA = 256, 2, 512, 10000.0
DIMS = mla_absorb.MlaDims(num_heads=4, qk_nope_head_dim=32, qk_rope_head_dim=64, v_head_dim=32,
                          kv_lora_rank=256)


class RmsNorm(torch.nn.Module):
    def __init__(self, width):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(width))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class MlaAttention(torch.nn.Module):
    def __init__(self, q_lora_rank=128):
        super().__init__()
        heads, qk = DIMS.num_heads, DIMS.qk_nope_head_dim + DIMS.qk_rope_head_dim
        self.q_a_proj = torch.nn.Linear(HIDDEN, q_lora_rank, bias=False)
        self.q_a_layernorm = RmsNorm(q_lora_rank)
        self.q_b_proj = torch.nn.Linear(q_lora_rank, heads * qk, bias=False)
        self.kv_a_proj_with_mqa = torch.nn.Linear(
            HIDDEN, DIMS.kv_lora_rank + DIMS.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = RmsNorm(DIMS.kv_lora_rank)
        self.kv_b_proj = torch.nn.Linear(
            DIMS.kv_lora_rank, heads * (DIMS.qk_nope_head_dim + DIMS.v_head_dim), bias=False)
        self.o_proj = torch.nn.Linear(heads * DIMS.v_head_dim, HIDDEN, bias=False)


def rope_interleaved(x, positions):
    """Rotates (2i, 2i+1) pairs of the last dim at `positions` [T]."""
    dim = x.shape[-1]
    inv_freq = THETA ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]
    shape = (-1,) + (1,) * (x.dim() - 2) + (dim // 2,)
    cos, sin = angles.cos().float().view(shape), angles.sin().float().view(shape)
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack([even * cos - odd * sin, odd * cos + even * sin], dim=-1).flatten(-2)


def full_attention(attention, hidden):
    """Non-absorbed MLA over a whole sequence: k and v decompressed per head."""
    tokens, heads = hidden.shape[0], DIMS.num_heads
    positions = torch.arange(tokens)
    q_nope, q_pe = mla_absorb.project_q(attention, hidden, DIMS)
    ckv, k_pe = mla_absorb.project_latent(attention, hidden, DIMS)
    kv = attention.kv_b_proj(ckv).view(tokens, heads, DIMS.qk_nope_head_dim + DIMS.v_head_dim)
    k_nope, v = kv[..., :DIMS.qk_nope_head_dim], kv[..., DIMS.qk_nope_head_dim:]
    q = torch.cat([q_nope, rope_interleaved(q_pe, positions)], dim=-1)
    k_rope = rope_interleaved(k_pe, positions)[:, None, :].expand(tokens, heads, -1)
    k = torch.cat([k_nope, k_rope], dim=-1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * DIMS.sm_scale
    mask = torch.ones(tokens, tokens, dtype=torch.bool).tril()
    weights = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    o = torch.einsum("hqk,khd->qhd", weights, v).reshape(tokens, heads * DIMS.v_head_dim)
    return attention.o_proj(o)


class TinyDeepseek(torch.nn.Module):
    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
        self.attention = torch.nn.ModuleList(MlaAttention() for _ in range(LAYERS))
        self.norms = torch.nn.ModuleList(RmsNorm(HIDDEN) for _ in range(2 * LAYERS + 1))
        self.mlp = torch.nn.ModuleList(torch.nn.Sequential(
            torch.nn.Linear(HIDDEN, 512, bias=False), torch.nn.SiLU(),
            torch.nn.Linear(512, HIDDEN, bias=False)) for _ in range(LAYERS))
        self.lm_head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
        with torch.no_grad():  # logits of order one (see examples/common.rescale_weights)
            for name, parameter in self.named_parameters():
                if parameter.dim() == 2:
                    std = 1.0 if "embed" in name else parameter.shape[1] ** -0.5
                    parameter.normal_(0, std)

    def run(self, token_ids, attend):
        x = self.embed(torch.as_tensor(token_ids))
        for index in range(LAYERS):
            x = x + attend(index, self.attention[index], self.norms[2 * index](x))
            x = x + self.mlp[index](self.norms[2 * index + 1](x))
        return self.lm_head(self.norms[-1](x))

    @torch.no_grad()
    def reference(self, token_ids):
        return self.run(token_ids, lambda index, attention, h: full_attention(attention, h)).numpy()

    @torch.no_grad()
    def served(self, step, token_ids, positions):
        return self.run(token_ids, lambda index, attention, h: mla_absorb.served_attention(
            step, index, attention, h, DIMS)).numpy()


@pytest.mark.parametrize("q_dtype,tolerance", [("float16", 0.01), ("bfloat16", 0.05)])
def test_absorbed_mla_logits_match_the_full_model(client, cache_name, q_dtype, tolerance):
    fields = mla_absorb.cache_fields(DIMS, LAYERS, q_dtype,
                                     {"style": "interleaved", "theta": THETA})
    fields["num_pages"] = 64
    client.create_cache(cache_name, **fields)
    model = TinyDeepseek(seed=0)
    sequences = workload.make_sequences(VOCAB, prompt_lengths=[6, 30, 19], max_new_tokens=[8, 5, 6],
                                        arrivals=[0, 0, 3], seed=2)
    stats = workload.serve(
        lambda entries: client.step(cache_name, entries, sm_scale=DIMS.sm_scale), model.served,
        sequences, prefill_chunk=16, free=lambda ids: client.free_sequences(cache_name, ids))
    result = workload.compare(sequences, model.reference)
    print(f"MLA {q_dtype}: {result.positions} positions, max |logit error| "
          f"{result.max_abs_logit_error:.4f} (logits up to {result.logit_scale:.2f}), "
          f"{stats.tokens_per_second:.0f} tokens/s over unary gRPC on the CPU backend")
    assert result.max_abs_logit_error < tolerance
    assert result.greedy_mismatches == []
