"""The pictures of a quality run (`kvcc.bench.quality --json`): ΔPPL against
bytes per token, and each spec's needle grid (depth x length)."""

from __future__ import annotations

import os
from typing import List

MARKERS = {"none": "o", "spec": "s", "s4w64": "^", "-": "*"}


def draw(result: dict, folder: str) -> List[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(folder, exist_ok=True)
    rows, about = result["rows"], result["about"]
    paths = []

    fig, ax = plt.subplots(figsize=(10, 6.5))
    specs = list(dict.fromkeys(r["spec"] for r in rows))
    colors = {spec: plt.cm.tab10(i % 10) for i, spec in enumerate(specs)}
    colors["default"] = "black"
    for r in rows:
        ax.scatter(r["bytes_per_token"], r["delta_ppl"], marker=MARKERS.get(r["policy"], "o"),
                   s=110 if r["spec"] == "default" else 50, color=colors[r["spec"]])
        ax.annotate(f"{r['tier']}:{r['policy']}", (r["bytes_per_token"], r["delta_ppl"]),
                    fontsize=6, xytext=(4, 2), textcoords="offset points")
    for spec in specs:
        ax.scatter([], [], color=colors[spec], marker="o", label=spec)
    for policy, name in [("none", "no exact tokens"), ("spec", "the spec's [cache]"),
                         ("s4w64", "sinks 4 + window 64"), ("-", "default cache")]:
        ax.scatter([], [], color="grey", marker=MARKERS[policy], label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("symlog", linthresh=0.01)
    ax.axhline(0.0, color="grey", linewidth=0.5)
    ax.set_xlabel("bytes per token per kv head per layer")
    ax.set_ylabel("ΔPPL against the default cache (symlog)")
    ax.set_title(f"{about['model']} on {about['device']}\nperplexity change against bytes per token",
                 fontsize=10)
    ax.legend(fontsize=7, loc="upper right", ncol=2)
    fig.tight_layout()
    paths.append(os.path.join(folder, "quality_ppl_vs_bytes.png"))
    fig.savefig(paths[-1], dpi=130)
    plt.close(fig)

    lengths = about["settings"]["lengths"]
    depths = about["settings"]["depths"]
    # Each spec's grids beside the reference cache's (the model misses some
    # needles with any cache).
    reference = [r for r in rows if r["spec"] == "default"]
    for spec in specs:
        if spec == "default":
            continue
        mine = reference + [r for r in rows if r["spec"] == spec]
        fig, axes = plt.subplots(1, len(mine), figsize=(2.6 * len(mine) + 0.5, 2.8), squeeze=False)
        for ax, r in zip(axes[0], mine):
            grid = [[0.0] * len(lengths) for _ in depths]
            for cell in r["needles"]:
                grid[depths.index(cell["depth"])][lengths.index(cell["length"])] = float(cell["found"])
            ax.imshow(grid, cmap="RdYlGn", vmin=0, vmax=1, aspect="auto")
            ax.set_xticks(range(len(lengths)), [f"{n // 1024}K" if n >= 1024 else str(n) for n in lengths], fontsize=7)
            ax.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths], fontsize=7)
            name = "default cache" if r["spec"] == "default" else f"{r['tier']} / {r['policy']}"
            ax.set_title(f"{name}: {r['needle_accuracy']:.2f}", fontsize=8)
            ax.set_xlabel("context", fontsize=7)
        axes[0][0].set_ylabel("needle depth", fontsize=7)
        fig.suptitle(f"needle retrieval, {spec} ({about['model']})", fontsize=9)
        fig.tight_layout()
        paths.append(os.path.join(folder, f"quality_needles_{spec}.png"))
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths
