#!/usr/bin/env python3
"""transformers' DeepSeek (V3, else V2) with every MLA layer served by attnd in absorbed form.

A small config built in code (4 layers, hidden 1024, 16 heads, q_lora_rank 384, kv_lora_rank
512, qk_nope 128 + qk_rope 64, v_head_dim 128, dense MLP in every layer, rope theta 10000,
interleaved rope), random weights from a fixed seed, never a download. The orchestrator runs
the model's own modules and, per layer, does the W_UK/W_UV absorption (mla_absorb.py): attnd
stores only the latent ckv and k_pe, applies RoPE to q_pe/k_pe and returns o in latent space.
Prefill in chunks, then greedy decoding with continuous batching; logits compared with
transformers running the model alone, greedy tokens identical.

    python3 client/python/examples/deepseek_mla_transformers.py --target localhost:50051 --transport grpc
    python3 client/python/examples/deepseek_mla_transformers.py --transport cuda_ipc

Prints the run, then one line `PASS ...` or `FAIL ...` (exit status 0 or 1).
"""
import common
import mla_absorb

TOLERANCES = {"float16": 0.02, "bfloat16": 0.1}


def build_model(seed, device):
    import torch
    import transformers
    if hasattr(transformers, "DeepseekV3ForCausalLM"):
        config_class, model_class = transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM
    elif hasattr(transformers, "DeepseekV2ForCausalLM"):
        config_class, model_class = transformers.DeepseekV2Config, transformers.DeepseekV2ForCausalLM
    else:
        raise SystemExit(f"transformers {transformers.__version__} has no DeepseekV3/V2 model "
                         "(DeepseekV3 needs transformers >= 4.51)")
    layers = 4
    config = config_class(
        vocab_size=4096, hidden_size=1024, intermediate_size=2816, moe_intermediate_size=256,
        num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=16,
        q_lora_rank=384, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
        first_k_dense_replace=layers,  # dense MLP everywhere: the test is about attention
        max_position_embeddings=4096, rope_theta=10000.0, rope_scaling=None,
        rms_norm_eps=1e-6, attention_bias=False, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = model_class(config)
    common.rescale_weights(model, seed)
    return model.to(device=device, dtype=torch.float32).eval()


def main():
    args = common.parse_args(__doc__.splitlines()[0], TOLERANCES)
    import torch
    device = common.torch_device(args)
    model = build_model(args.seed, device)
    config = model.config
    dims = mla_absorb.MlaDims.of(config)
    # transformers' DeepSeek rotates (2i, 2i+1) pairs (rope_interleave, default true: it
    # de-interleaves q_pe and k_pe alike before rotate_half, which leaves q_pe.k_pe as with
    # interleaved pairs).
    style = "interleaved" if getattr(config, "rope_interleave", True) else "neox"

    client = common.attnd.Client(args.target, token=args.token)
    client.wait_for_ready(30)
    cache = "deepseek-mla-example"
    common.fresh_cache(client, cache, **mla_absorb.cache_fields(
        dims, config.num_hidden_layers, args.dtype, common.rope_from_hf(config, style)))

    decoder = model.model

    @torch.no_grad()
    def forward(step, token_ids, positions):
        x = decoder.embed_tokens(torch.as_tensor(token_ids, device=device))
        for index, layer in enumerate(decoder.layers):
            x = x + mla_absorb.served_attention(step, index, layer.self_attn,
                                                layer.input_layernorm(x), dims)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return model.lm_head(decoder.norm(x)).float().cpu().numpy()

    @torch.no_grad()
    def reference(token_ids):
        ids = torch.as_tensor([token_ids], device=device)
        return model(input_ids=ids).logits[0].float().cpu().numpy()

    sequences = common.workload_for(args, config.vocab_size)
    status = common.run_and_report("deepseek MLA (transformers, absorbed)", args, client, cache,
                                   forward, reference, sequences,
                                   options={"sm_scale": dims.sm_scale})
    client.delete_cache(cache, force=True)
    return status


if __name__ == "__main__":
    raise SystemExit(main())
