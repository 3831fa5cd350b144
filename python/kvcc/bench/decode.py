"""Decode speed in a model: a randomly initialised Llama-architecture model
(GQA, RoPE, head_dim 128) generating after a long prompt, with a kvcc cache
against transformers' default cache with SDPA.

    python -m kvcc.bench.decode --device cuda --contexts 8192,32768 --spec kivi --tier int4
    python -m kvcc.bench.decode --device cpu --tiny     # a small run that proves the path

Per context: the prompt is prefilled once per cache (not timed), then
`--new-tokens` greedy steps are timed (the device synchronized before and
after); tokens/s is batch x steps / seconds. The greedy tokens of the two
caches are compared too (equal for dense_f16; a compressed spec may
diverge).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from .. import hf


def build_model(args, device):
    from transformers import LlamaConfig, LlamaForCausalLM

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


def run(model, prompt, cache, attn, steps, device):
    """Prefill, then `steps` greedy decode steps; returns (tokens, seconds of the steps)."""
    model.config._attn_implementation = attn
    arg = {hf.cache_argument(model): cache}
    with torch.no_grad():
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
    parser.add_argument("--contexts", default="8192,32768")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--dtype", default="float16")
    parser.add_argument("--spec", default="kivi")
    parser.add_argument("--tier", default=None)
    parser.add_argument("--tiny", action="store_true", help="a small CPU-sized model and contexts")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    if args.tiny:
        args.contexts, args.layers, args.heads, args.kv_heads = "256,512", 2, 4, 2
        args.vocab, args.new_tokens, args.dtype = 512, 8, "float32"
    args.contexts = [int(c) for c in args.contexts.split(",")]
    args.dtype = getattr(torch, args.dtype)
    device = torch.device(args.device)
    model = build_model(args, device)
    from transformers import DynamicCache

    # Warm-up: the first calls of each path pay for kernel compilation and
    # allocator growth.
    warm = torch.randint(0, args.vocab, (args.batch, 80)).to(device)
    run(model, warm, DynamicCache(config=model.config), "sdpa", 3, device)
    run(model, warm, hf.KvccCache(model.config, spec=args.spec, tier=args.tier, batch=args.batch,
                                  max_tokens=128), "kvcc", 3, device)
    rows = []
    for context in args.contexts:
        gen = torch.Generator().manual_seed(context)
        prompt = torch.randint(0, args.vocab, (args.batch, context), generator=gen).to(device)
        base_tokens, base_s = run(model, prompt, DynamicCache(config=model.config), "sdpa", args.new_tokens, device)
        cache = hf.KvccCache(
            model.config, spec=args.spec, tier=args.tier, batch=args.batch,
            max_tokens=context + args.new_tokens,
        )
        kv_tokens, kv_s = run(model, prompt, cache, "kvcc", args.new_tokens, device)
        steps = args.batch * (args.new_tokens - 1)
        row = {
            "context": context,
            "batch": args.batch,
            "spec": args.spec,
            "tier": cache.format.tiers[cache.format.tier_index(args.tier)],
            "sdpa_tokens_per_s": steps / base_s,
            "kvcc_tokens_per_s": steps / kv_s,
            "same_tokens": float((base_tokens == kv_tokens).float().mean()),
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        }
        rows.append(row)
        print(
            f"context {context:6}: default cache + SDPA {row['sdpa_tokens_per_s']:9.1f} tok/s, "
            f"kvcc {args.spec}/{row['tier']} {row['kvcc_tokens_per_s']:9.1f} tok/s "
            f"({row['kvcc_tokens_per_s'] / row['sdpa_tokens_per_s']:.2f}x), "
            f"same greedy tokens {row['same_tokens']:.2f}",
            flush=True,
        )
    print()
    print(f"| context | default cache + SDPA tok/s | kvcc {args.spec} tok/s | speedup | same tokens |")
    print("|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['context']} | {r['sdpa_tokens_per_s']:.1f} | {r['kvcc_tokens_per_s']:.1f} | "
            f"{r['kvcc_tokens_per_s'] / r['sdpa_tokens_per_s']:.2f}x | {r['same_tokens']:.2f} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return rows


if __name__ == "__main__":
    main()
