"""DeepSeek multi-head latent attention served by attnd in absorbed form.

For an attention module shaped like transformers' DeepseekV2/V3Attention (q_proj, or
q_a_proj + q_a_layernorm + q_b_proj; kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj):

    q_nope, q_pe = split(q)                       [T, H, nope], [T, H, rope]
    ckv, k_pe    = kv_a_layernorm(c), k_pe          c, k_pe = split(kv_a_proj_with_mqa(h))
    W_UK, W_UV   = split(kv_b_proj.weight)         [H, nope, rank], [H, v, rank]
    q_absorbed   = q_nope . W_UK                   [T, H, rank]: q_nope . k_nope = q_absorbed . ckv
    o_latent     = attnd(q_absorbed, q_pe, ckv, k_pe)   [T, H, rank]; RoPE on q_pe/k_pe in attnd
    o            = o_proj(o_latent . W_UV^T)      v = W_UV . ckv, so p.v = W_UV . (p.ckv)

attnd keeps only ckv and k_pe per token (576 values instead of H * (nope + v + rope)).
No transformers import: tests/python runs the same functions on a plain-torch model in CI.
"""
import dataclasses


@dataclasses.dataclass(frozen=True)
class MlaDims:
    num_heads: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    kv_lora_rank: int

    @classmethod
    def of(cls, config):
        return cls(config.num_attention_heads, config.qk_nope_head_dim,
                   config.qk_rope_head_dim, config.v_head_dim, config.kv_lora_rank)

    @property
    def sm_scale(self):
        # DeepSeek's softmax scale without yarn mscale: 1/sqrt(nope + rope).
        return (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5


def absorbed_weights(attention, dims):
    """(W_UK [H, nope, rank], W_UV [H, v, rank]) from kv_b_proj's weight."""
    weight = attention.kv_b_proj.weight.view(
        dims.num_heads, dims.qk_nope_head_dim + dims.v_head_dim, dims.kv_lora_rank)
    return weight[:, :dims.qk_nope_head_dim], weight[:, dims.qk_nope_head_dim:]


def project_q(attention, hidden, dims):
    if getattr(attention, "q_a_proj", None) is not None:
        q = attention.q_b_proj(attention.q_a_layernorm(attention.q_a_proj(hidden)))
    else:
        q = attention.q_proj(hidden)
    q = q.view(hidden.shape[0], dims.num_heads, dims.qk_nope_head_dim + dims.qk_rope_head_dim)
    return q[..., :dims.qk_nope_head_dim], q[..., dims.qk_nope_head_dim:]


def project_latent(attention, hidden, dims):
    """(ckv [T, rank] after kv_a_layernorm, k_pe [T, rope] before RoPE)."""
    compressed = attention.kv_a_proj_with_mqa(hidden)
    ckv, k_pe = compressed.split([dims.kv_lora_rank, dims.qk_rope_head_dim], dim=-1)
    return attention.kv_a_layernorm(ckv), k_pe


def served_attention(step, layer, attention, hidden, dims):
    """One layer's attention output [T, hidden] with the latent cache and the attention in
    attnd (the step's cache: kind mla, kv_lora_rank and rope_dim as dims)."""
    import torch
    tokens = hidden.shape[0]
    w_uk, w_uv = absorbed_weights(attention, dims)
    q_nope, q_pe = project_q(attention, hidden, dims)
    ckv, k_pe = project_latent(attention, hidden, dims)
    q_absorbed = torch.einsum("thd,hdc->thc", q_nope, w_uk)
    o_latent = step.forward(layer, q_absorbed, q_pe=q_pe, ckv=ckv, kpe=k_pe).o
    o_latent = o_latent.to(device=hidden.device, dtype=hidden.dtype)
    o = torch.einsum("thc,hvc->thv", o_latent, w_uv).reshape(tokens, dims.num_heads * dims.v_head_dim)
    return attention.o_proj(o)


def cache_fields(dims, num_layers, q_dtype, rope):
    return dict(kind="mla", num_layers=num_layers, num_qo_heads=dims.num_heads,
                kv_lora_rank=dims.kv_lora_rank, rope_dim=dims.qk_rope_head_dim,
                q_dtype=q_dtype, page_size=16, num_pages=2048, rope=rope)
