#!/usr/bin/env python3
"""transformers' LlamaForCausalLM with every attention layer served by attnd.

A small Llama 3.1-style config built in code (4 layers, hidden 1024, 16 q / 4 kv heads,
head_dim 64, rope theta 500000 with llama3 scaling), random weights from a fixed seed, never a
download. The orchestrator runs the model's own modules (embeddings, norms, q/k/v/o
projections, MLP, lm_head) and sends each layer's q/k/v *before* RoPE to attnd, which applies
RoPE (the config's theta and scaling), appends k/v to its paged cache and returns o. Prompts of
different lengths are prefilled in chunks, then decoded greedily with continuous batching. The
logits are compared with transformers running the same model alone (model(input_ids).logits),
and the greedy tokens must be identical.

    python3 client/python/examples/llama_transformers.py --target localhost:50051 --transport grpc
    python3 client/python/examples/llama_transformers.py --transport cuda_ipc --dtype float16

Prints the run, then one line `PASS ...` or `FAIL ...` (exit status 0 or 1).
"""
import numpy as np

import common

TOLERANCES = {"float16": 0.02, "bfloat16": 0.1}


def build_model(seed, device):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(
        vocab_size=4096, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
        num_attention_heads=16, num_key_value_heads=4, head_dim=64,
        max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        attention_bias=False, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    common.rescale_weights(model, seed)
    return model.to(device=device, dtype=torch.float32).eval()


def main():
    args = common.parse_args(__doc__.splitlines()[0], TOLERANCES)
    import torch
    device = common.torch_device(args)
    model = build_model(args.seed, device)
    config = model.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads

    client = common.attnd.Client(args.target, token=args.token)
    client.wait_for_ready(30)
    cache = "llama-example"
    common.fresh_cache(client, cache, num_layers=config.num_hidden_layers, num_qo_heads=heads,
                       num_kv_heads=kv_heads, head_dim=head_dim, q_dtype=args.dtype,
                       page_size=16, num_pages=2048,
                       rope=common.rope_from_hf(config, "neox"))  # HF rotate_half = neox

    decoder = model.model

    @torch.no_grad()
    def forward(step, token_ids, positions):
        ids = torch.as_tensor(token_ids, device=device)
        x = decoder.embed_tokens(ids)
        tokens = x.shape[0]
        for index, layer in enumerate(decoder.layers):
            attention = layer.self_attn
            h = layer.input_layernorm(x)
            q = attention.q_proj(h).view(tokens, heads, head_dim)
            k = attention.k_proj(h).view(tokens, kv_heads, head_dim)
            v = attention.v_proj(h).view(tokens, kv_heads, head_dim)
            o = step.forward(index, q, k, v).o  # RoPE, KV cache and attention in attnd
            x = x + attention.o_proj(o.to(device=device, dtype=x.dtype).reshape(tokens, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return model.lm_head(decoder.norm(x)).float().cpu().numpy()

    @torch.no_grad()
    def reference(token_ids):
        ids = torch.as_tensor([token_ids], device=device)
        return model(input_ids=ids).logits[0].float().cpu().numpy()

    sequences = common.workload_for(args, config.vocab_size)
    status = common.run_and_report("llama (transformers LlamaForCausalLM)", args, client, cache,
                                   forward, reference, sequences)
    client.delete_cache(cache, force=True)
    return status


if __name__ == "__main__":
    raise SystemExit(main())
