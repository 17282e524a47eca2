"""What the transformers examples share: flags, the transports a step can travel on, the
serving run and the PASS/FAIL report. transformers is imported by the examples themselves, and
only inside main(), so this file and workload.py import without it."""
import argparse
import contextlib
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout's attnd

import attnd  # noqa: E402
import workload  # noqa: E402

TRANSPORTS = ("grpc", "stream", "cuda_ipc", "host_shm", "nccl")


def parse_args(description, default_tolerances):
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--target", default="localhost:50051", help="attnd's gRPC address")
    parser.add_argument("--transport", choices=TRANSPORTS, default="grpc",
                        help="grpc: unary Plan/Forward; stream: one ForwardStream; cuda_ipc / "
                             "host_shm / nccl: a channel (the tensors never cross the socket; "
                             "nccl: the model on another GPU than attnd's, --device cuda:1)")
    parser.add_argument("--dtype", choices=("float16", "bfloat16"), default="bfloat16",
                        help="q/k/v/o and KV dtype in attnd (the model itself runs in float32)")
    parser.add_argument("--device", default=None, help="torch device (default: cuda if any)")
    parser.add_argument("--decode-steps", type=int, default=64)
    parser.add_argument("--prefill-chunk", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tolerance", type=float, default=None,
                        help="max |logit error| (default per dtype: "
                             + ", ".join(f"{k} {v}" for k, v in default_tolerances.items()) + ")")
    parser.add_argument("--token", default=None, help="bearer token (attnd --token_file)")
    args = parser.parse_args()
    if args.tolerance is None:
        args.tolerance = default_tolerances[args.dtype]
    return args


def torch_device(args):
    import torch
    if args.device:
        return torch.device(args.device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def workload_for(args, vocab_size):
    """Four prompts of 7..150 tokens (chunked), then decoding with sequences joining and
    leaving: about args.decode_steps serving steps of decode in all."""
    steps = args.decode_steps
    return workload.make_sequences(
        vocab_size, prompt_lengths=[7, 150, 61, 33, 90, 12],
        max_new_tokens=[steps, steps // 2, steps - 8, steps // 3, steps // 2, steps // 4],
        arrivals=[0, 0, 0, 0, steps // 4, steps // 2], seed=args.seed)


@contextlib.contextmanager
def step_factory(client, cache, transport, max_tokens, options=None, channel_kwargs=None):
    """Yields begin_step(entries) -> Step for the chosen transport."""
    options = options or {}
    if transport == "grpc":
        yield lambda entries: client.step(cache, entries, **options)
    elif transport == "stream":
        with client.stream() as stream:
            yield lambda entries: stream.step(cache, entries, **options)
    else:
        kind = transport if transport in ("cuda_ipc", "nccl") else "host_shm"
        with client.open_channel(cache, kind, max_tokens=max_tokens,
                                 **(channel_kwargs or {})) as channel:
            yield lambda entries: client.step(cache, entries, channel=channel, **options)


def run_and_report(name, args, client, cache, forward, reference, sequences, options=None):
    # An NCCL channel's slots live on the model's GPU (which must not be attnd's).
    channel_kwargs = {"device": str(torch_device(args))} if args.transport == "nccl" else None
    with step_factory(client, cache, args.transport, args.prefill_chunk * len(sequences),
                      options, channel_kwargs) as begin_step:
        stats = workload.serve(begin_step, forward, sequences, prefill_chunk=args.prefill_chunk,
                               free=lambda ids: client.free_sequences(cache, ids))
    result = workload.compare(sequences, reference)
    ok = result.max_abs_logit_error <= args.tolerance and not result.greedy_mismatches
    info = client.server_info()
    print(f"{name}: backend {info.backend} ({info.device}), transport {args.transport}, "
          f"{args.dtype}")
    print(f"  {stats.steps} steps, {stats.prefill_tokens} prefill + {stats.decode_tokens} decode "
          f"tokens, batch up to {stats.max_batch}, {stats.seconds:.2f} s: "
          f"{stats.tokens_per_second:.0f} tokens/s ({stats.decode_tokens_per_second:.0f} decode "
          f"tokens/s; model and attnd together)")
    print(f"  logits at {result.positions} positions: max |error| {result.max_abs_logit_error:.4f}"
          f" (tolerance {args.tolerance}, logits up to {result.logit_scale:.2f}); greedy "
          f"mismatches: {len(result.greedy_mismatches)} (near-ties within the logit error, "
          f"not counted: {len(result.near_ties)})")
    print(f"{'PASS' if ok else 'FAIL'} {name} transport={args.transport} dtype={args.dtype} "
          f"tokens/s={stats.tokens_per_second:.0f}")
    return 0 if ok else 1


def rope_from_hf(config, style):
    """attnd's RopeConfig of a transformers config (rope_theta, rope_scaling)."""
    # transformers 5 keeps theta and the scaling in config.rope_parameters; 4.x in rope_theta
    # and rope_scaling.
    parameters = getattr(config, "rope_parameters", None) or {}
    theta = parameters.get("rope_theta", getattr(config, "rope_theta", None))
    rope = {"style": style, "theta": float(theta if theta is not None else 10000.0)}
    scaling = parameters or getattr(config, "rope_scaling", None) or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "llama3":
        rope.update(scaling="llama3", factor=scaling["factor"],
                    low_freq_factor=scaling["low_freq_factor"],
                    high_freq_factor=scaling["high_freq_factor"],
                    original_max_position=scaling["original_max_position_embeddings"])
    elif kind == "linear":
        rope.update(scaling="linear", factor=scaling["factor"])
    elif kind != "default":
        raise SystemExit(f"rope_scaling {kind!r} has no attnd equivalent")
    return rope


def fresh_cache(client, name, **config):
    try:
        client.delete_cache(name, force=True)
    except attnd.AttndError:
        pass
    return client.create_cache(name, **config)


def rescale_weights(model, seed):
    """Redraws every matrix with std 1/sqrt(fan_in) (embeddings std 1), norms left at one.
    transformers' init (std 0.02) gives near-zero logits, where greedy choices are coin flips
    that any rounding changes; these give logits of order one, like a trained model's spread."""
    import torch
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.dim() != 2:
                continue
            std = 1.0 if "embed" in name else parameter.shape[1] ** -0.5
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * std)
