#!/usr/bin/env python3
"""The markdown table of benches/fidelity/run.sh from its JSON reports.

    python3 benches/fidelity/table.py target/fidelity/json

Per spec and tier, one row per cache policy: none (every token in pages),
the spec's own `[cache]` policy where it has one other than 4 + 64, and
4 sinks + a 64-token window. Bytes per token are per kv head, K and V, exact
rows, page headers and tables included, at the 512 tokens measured and at a
32K context.
"""

import json
import sys
from pathlib import Path

SPECS = ["dense_f16", "spherical", "kivi", "kivi2", "fp8", "subspace", "shard", "mosaic"]


def load(folder, name):
    path = folder / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def exact_tokens(sinks, window, tokens, items):
    """Tokens a policy keeps exact in one sequence (kvcc's CachePolicy::split)."""
    sinks = min(sinks, tokens)
    rest = tokens - sinks
    pages = max(rest - window, 0) // items
    return sinks + rest - pages * items


def cells(fidelity):
    return [
        f"{fidelity['output_rel_error']:.4f}",
        f"{fidelity['max_logit_drift']:.2f}",
        f"{fidelity['mean_logit_drift']:.4f}",
        f"{fidelity['top8_overlap']:.3f}",
    ]


def main():
    folder = Path(sys.argv[1])
    header = [
        "spec", "tier", "policy", "exact tokens", "B/token (512)", "vs f16",
        "B/token (32K)", "out rel err", "max drift", "mean drift", "top-8",
    ]
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join(["---"] * 3 + ["---:"] * (len(header) - 3)) + "|")
    for spec in SPECS:
        check = load(folder, f"{spec}.check")
        none = load(folder, f"{spec}.none")
        if check is None or none is None:
            continue
        own = load(folder, f"{spec}.spec")
        s4w64 = load(folder, f"{spec}.s4w64")
        s4w64_32k = load(folder, f"{spec}.s4w64.32k")
        tokens, items = none["tokens"], check["cache"]["page_items"]
        dense = 4 * check["head_dim"]
        layouts = {t["tier"]: t for t in check["tiers"]}
        cache = {t["tier"]: t for t in check["cache"]["tiers"]}
        spec_policy = (check["cache"]["sinks"], check["cache"]["window"])
        for i, row in enumerate(none["rows"]):
            tier = row["tier"]
            long = layouts[tier]["effective_bytes_per_token"] if tier in layouts else None
            lines = [("none", 0, row["bytes_per_token"], long, row["fidelity"])]
            if check["cache"]["keeps_exact"] and spec_policy != (4, 64) and own and own["rows"][i].get("policy"):
                p = own["rows"][i]["policy"]
                label = f"spec: sinks {p['sinks']} + window {p['window']}"
                lines.append((label, exact_tokens(p["sinks"], p["window"], tokens, items),
                              p["bytes_per_token"], cache[tier]["bytes_per_token"], p["fidelity"]))
            if s4w64 and s4w64["rows"][i].get("policy"):
                p = s4w64["rows"][i]["policy"]
                label = "sinks 4 + window 64" + (" (spec)" if spec_policy == (4, 64) else "")
                long = s4w64_32k["rows"][i]["policy"]["bytes_per_token"] if s4w64_32k else None
                lines.append((label, exact_tokens(4, 64, tokens, items), p["bytes_per_token"], long,
                              p["fidelity"]))
            for label, exact, short, long, fidelity in lines:
                print("| " + " | ".join([
                    spec, tier, label, str(exact), f"{short:.2f}", f"{dense / short:.2f}x",
                    "—" if long is None else f"{long:.2f}", *cells(fidelity),
                ]) + " |")


if __name__ == "__main__":
    main()
