"""Decode speed in a model: a randomly initialised Llama-architecture model
(GQA, RoPE, head_dim 128) generating after a long prompt, with a kvcc cache
against transformers' default cache with SDPA.

    python -m kvcc.bench.decode --device cuda --contexts 8192,32768 --spec kivi --tier int4
    python -m kvcc.bench.decode --device cpu --tiny     # a small run that proves the path

Per context: the prompt is prefilled once per cache (not timed), then
`--new-tokens` greedy steps are timed (the device synchronized before and
after); tokens/s is batch x steps / seconds. The greedy tokens of the two
caches are compared too (equal for dense_f16; a compressed spec may
diverge). On CUDA the kvcc cache skips its per-step NaN/Inf scans unless
`--check-finite` (each scan waits for the GPU; the default cache does none).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from .. import Format, hf


def build_model(args, device):
    from transformers import LlamaConfig, LlamaForCausalLM

    hf.register()
    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.heads * 128,
        intermediate_size=args.heads * 128 * 2,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=128,
        max_position_embeddings=max(args.contexts) + args.new_tokens + 8,
        rope_theta=500000.0,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(device=device, dtype=args.dtype)
    model.eval()
    return model


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def sdpa_backends(names):
    """A context limiting SDPA to `names` (flash, efficient, cudnn, math), or
    torch's own choice for `auto`."""
    import contextlib

    if names == "auto":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    table = {
        "flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH,
    }
    return sdpa_kernel([table[n] for n in names.split(",")])


def run(model, prompt, cache, attn, steps, device, backends="auto"):
    """Prefill, then `steps` greedy decode steps; returns (tokens, seconds of the steps)."""
    model.config._attn_implementation = attn
    arg = {hf.cache_argument(model): cache}
    with torch.no_grad(), sdpa_backends(backends):
        out = model(input_ids=prompt, use_cache=True, **arg)
        token = out.logits[:, -1:].argmax(-1)
        tokens = [token]
        sync(device)
        start = time.perf_counter()
        for _ in range(steps - 1):
            out = model(input_ids=token, use_cache=True, **arg)
            token = out.logits[:, -1:].argmax(-1)
            tokens.append(token)
        sync(device)
        seconds = time.perf_counter() - start
    return torch.cat(tokens, dim=1), seconds


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--contexts", default=None, help="default 8192,32768 (--tiny: 256,512)")
    parser.add_argument("--new-tokens", type=int, default=None, help="default 64 (--tiny: 8)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--dtype", default="float16")
    parser.add_argument("--spec", default="kivi")
    parser.add_argument("--tier", default=None)
    parser.add_argument("--caches", default="sdpa,kvcc", help="which of sdpa,kvcc to time")
    parser.add_argument("--tiny", action="store_true", help="a small CPU-sized model and contexts")
    parser.add_argument("--check-finite", action="store_true", help="scan kvcc's inputs for NaN/Inf")
    parser.add_argument(
        "--sdpa-backend", default="auto",
        help="SDPA kernels for the default cache: auto (torch's choice) or a list of "
        "flash,efficient,cudnn,math",
    )
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    if args.tiny:
        args.layers, args.heads, args.kv_heads, args.vocab, args.dtype = 2, 4, 2, 512, "float32"
        args.contexts = args.contexts or "256,512"
        args.new_tokens = args.new_tokens or 8
    args.contexts = args.contexts or "8192,32768"
    args.new_tokens = args.new_tokens or 64
    args.contexts = [int(c) for c in args.contexts.split(",")]
    args.dtype = getattr(torch, args.dtype)
    device = torch.device(args.device)
    model = build_model(args, device)
    from transformers import DynamicCache

    # Warm-up: the first calls of each path pay for kernel compilation and
    # allocator growth.
    caches = args.caches.split(",")
    fmt = Format.load(args.spec)
    tier = fmt.tiers[fmt.tier_index(args.tier)]

    def kvcc_cache(tokens):
        options = hf.KvccOptions(
            spec=fmt, tier=args.tier, check_finite=args.check_finite or device.type == "cpu"
        )
        return hf.KvccCache(model.config, options, batch=args.batch, max_tokens=tokens)

    warm = torch.randint(0, args.vocab, (args.batch, 80)).to(device)
    if "sdpa" in caches:
        run(model, warm, DynamicCache(config=model.config), "sdpa", 3, device, args.sdpa_backend)
    if "kvcc" in caches:
        run(model, warm, kvcc_cache(128), "kvcc", 3, device)
    rows = []
    for context in args.contexts:
        gen = torch.Generator().manual_seed(context)
        prompt = torch.randint(0, args.vocab, (args.batch, context), generator=gen).to(device)
        steps = args.batch * (args.new_tokens - 1)
        row = {
            "context": context, "batch": args.batch, "spec": args.spec, "tier": tier,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "layers": args.layers, "heads": args.heads, "kv_heads": args.kv_heads,
            "dtype": str(args.dtype).removeprefix("torch."), "new_tokens": args.new_tokens,
            "sdpa_backend": args.sdpa_backend,
        }
        tokens = {}
        if "sdpa" in caches:
            tokens["sdpa"], seconds = run(
                model, prompt, DynamicCache(config=model.config), "sdpa", args.new_tokens, device,
                args.sdpa_backend,
            )
            row["sdpa_tokens_per_s"] = steps / seconds
        if "kvcc" in caches:
            tokens["kvcc"], seconds = run(
                model, prompt, kvcc_cache(context + args.new_tokens), "kvcc", args.new_tokens, device
            )
            row["kvcc_tokens_per_s"] = steps / seconds
        if len(tokens) == 2:
            row["same_tokens"] = float((tokens["sdpa"] == tokens["kvcc"]).float().mean())
        rows.append(row)
        print(f"context {context:6}: " + ", ".join(
            f"{k} {v:.4g}" for k, v in row.items() if k.endswith("per_s") or k == "same_tokens"
        ), flush=True)
    print()
    print(
        f"{rows[0]['device'] if rows else device}: Llama {args.layers} layers, {args.heads} query / "
        f"{args.kv_heads} kv heads of 128, {rows[0]['dtype'] if rows else ''}, batch {args.batch}, "
        f"{args.new_tokens} new tokens; SDPA backend {args.sdpa_backend}"
    )
    print(f"| context | default cache + SDPA tok/s | kvcc {args.spec}/{tier} tok/s | speedup | same tokens |")
    print("|---:|---:|---:|---:|---:|")
    for r in rows:
        sdpa, kv = r.get("sdpa_tokens_per_s"), r.get("kvcc_tokens_per_s")
        speedup = f"{kv / sdpa:.2f}x" if sdpa and kv else "-"
        same = f"{r['same_tokens']:.2f}" if "same_tokens" in r else "-"
        print(
            f"| {r['context']} | {f'{sdpa:.1f}' if sdpa else '-'} | {f'{kv:.1f}' if kv else '-'} "
            f"| {speedup} | {same} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return rows


if __name__ == "__main__":
    main()
