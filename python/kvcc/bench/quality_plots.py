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

    fig, ax = plt.subplots(figsize=(9, 6))
    for r in rows:
        ax.scatter(
            r["bytes_per_token"], max(r["delta_ppl"], 1e-3), marker=MARKERS.get(r["policy"], "o"),
            s=90 if r["spec"] == "default" else 45,
            color="black" if r["spec"] == "default" else None,
        )
        ax.annotate(f"{r['spec']}:{r['tier']}:{r['policy']}", (r["bytes_per_token"], max(r["delta_ppl"], 1e-3)),
                    fontsize=6, xytext=(3, 2), textcoords="offset points")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("bytes per token per kv head per layer")
    ax.set_ylabel("ΔPPL against the default cache (floored at 1e-3)")
    ax.set_title(f"{about['model']} on {about['device']}: ΔPPL vs bytes/token "
                 "(o none, ■ spec policy, ▲ sinks 4 + window 64, ★ default)")
    fig.tight_layout()
    paths.append(os.path.join(folder, "quality_ppl_vs_bytes.png"))
    fig.savefig(paths[-1], dpi=130)
    plt.close(fig)

    lengths = about["settings"]["lengths"]
    depths = about["settings"]["depths"]
    specs = []
    for r in rows:
        if r["spec"] not in specs:
            specs.append(r["spec"])
    for spec in specs:
        mine = [r for r in rows if r["spec"] == spec]
        fig, axes = plt.subplots(1, len(mine), figsize=(2.6 * len(mine) + 0.5, 2.8), squeeze=False)
        for ax, r in zip(axes[0], mine):
            grid = [[0.0] * len(lengths) for _ in depths]
            for cell in r["needles"]:
                grid[depths.index(cell["depth"])][lengths.index(cell["length"])] = float(cell["found"])
            ax.imshow(grid, cmap="RdYlGn", vmin=0, vmax=1, aspect="auto")
            ax.set_xticks(range(len(lengths)), [f"{n // 1024}K" if n >= 1024 else str(n) for n in lengths], fontsize=7)
            ax.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths], fontsize=7)
            ax.set_title(f"{r['tier']} / {r['policy']}: {r['needle_accuracy']:.2f}", fontsize=8)
            ax.set_xlabel("context", fontsize=7)
        axes[0][0].set_ylabel("needle depth", fontsize=7)
        fig.suptitle(f"needle retrieval, {spec} ({about['model']})", fontsize=9)
        fig.tight_layout()
        paths.append(os.path.join(folder, f"quality_needles_{spec}.png"))
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths
