"""float64 numpy oracles for the tests: RoPE (neox) and causal GQA attention over a history."""
import numpy as np


def rope_neox(x, positions, theta=10000.0):
    """x [T, H, D] rotated at `positions` [T]: dims (i, i + D/2) as pairs."""
    dim = x.shape[-1]
    frequencies = theta ** (-np.arange(0, dim, 2, dtype=np.float64) / dim)
    angles = np.asarray(positions, dtype=np.float64)[:, None] * frequencies[None, :]
    cos, sin = np.cos(angles)[:, None, :], np.sin(angles)[:, None, :]
    first, second = x[..., : dim // 2], x[..., dim // 2:]
    return np.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)


def attention(q, k, v, sm_scale=None, causal=True):
    """One sequence: q [Tq, Hq, D] (the last Tq positions), k and v [Tk, Hkv, D] (the whole
    history). Returns o [Tq, Hq, D] and lse [Tq, Hq] in float64."""
    q, k, v = (np.asarray(t, dtype=np.float64) for t in (q, k, v))
    num_q, num_heads, dim = q.shape
    num_k, num_kv_heads = k.shape[0], k.shape[1]
    group = num_heads // num_kv_heads
    scale = 1.0 / np.sqrt(dim) if sm_scale is None else sm_scale
    k = np.repeat(k, group, axis=1)
    v = np.repeat(v, group, axis=1)
    scores = np.einsum("qhd,khd->hqk", q, k) * scale
    if causal:
        visible = np.arange(num_k)[None, :] <= (num_k - num_q + np.arange(num_q))[:, None]
        scores = np.where(visible[None], scores, -np.inf)
    peak = scores.max(axis=-1, keepdims=True)
    weights = np.exp(scores - peak)
    total = weights.sum(axis=-1, keepdims=True)
    o = np.einsum("hqk,khd->qhd", weights / total, v)
    lse = (np.log(total) + peak)[..., 0].T
    return o, lse
