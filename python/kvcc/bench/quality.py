"""Model quality of every bundled spec, tier and policy on a real decoder.

    python -m kvcc.bench.quality [--model smollm2] [--device cpu|cuda] [--specs all]
        [--policies none,spec,s4w64] [--json out.json] [--markdown out.md] [--plots DIR]
    python -m kvcc.bench.quality --plot-from out.json --plots DIR
    python -m kvcc.bench.quality --compare cuda.json cpu.json

Each cache is measured as generation runs it (docs/quality.md): perplexity
of teacher-forced decode steps after a prefill, needle retrieval over a
length x depth grid with the question decoded through the cache, and greedy
agreement with transformers' default dense cache, on the same tokens. The
bundled specs are written for head_dim 128 and are re-stated at the model's
(kvcc.specs). Policies: `none` (every whole page compressed), `spec` (the
spec's `[cache]` table, where it has one), `s4w64` (4 exact sinks and a
64-token exact window).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from .. import Format
from ..quality import Harness, Settings, load_model
from ..specs import bundled_at


def _floats(text):
    return tuple(float(x) for x in text.split(","))


def _ints(text):
    return tuple(int(x) for x in text.split(","))


def choices(harness, specs, policies, tiers=None, executor="jit", select_from_layer=0):
    """Every (spec, tier, policy) to measure; a spec without a `[cache]`
    table has no `spec` policy, and one whose table is sinks 4 + window 64
    is measured once under `s4w64`. A spec with a `[cache.budget]` is one
    cache whatever the tier (its controller chooses a tier per state)."""
    qm = harness.qm
    out = []
    for name in specs:
        fmt = bundled_at(name, qm.head_dim) if name in Format.bundled() else Format.load(name)
        own = fmt.policy()
        for tier in fmt.tiers[:1] if fmt.budget() else fmt.tiers:
            if tiers and tier not in tiers and f"{fmt.name}:{tier}" not in tiers:
                continue
            for policy in policies:
                if policy == "spec" and (own["sinks"], own["window"]) in [(0, 0), (4, 64)]:
                    continue
                out.append((fmt, tier, policy))
    return [
        harness.choice(fmt, tier, policy, executor=executor, select_from_layer=select_from_layer)
        for fmt, tier, policy in out
    ]


def table(rows, about) -> str:
    """The markdown table of `rows`."""
    kvcc_layers = about.get("kvcc_layers", about["layers"])
    sliding = about["layers"] - kvcc_layers
    layers = f"{about['layers']} layers" + (
        f" ({kvcc_layers} full-attention layers through kvcc, {sliding} sliding-window layers exact)"
        if sliding else ""
    )
    lines = [
        f"{about['model']} ({layers}, {about['q_heads']} query / "
        f"{about['kv_heads']} kv heads of {about['head_dim']}), {about['dtype']}, on "
        f"{about['device']}; perplexity over {about['settings']['steps']} decode steps after "
        f"{about['settings']['prefill']} tokens; needles: {len(about['settings']['lengths'])} "
        f"lengths x {len(about['settings']['depths'])} depths, question "
        f"{'prefilled' if about['settings'].get('question') == 'prefill' else 'decoded'}; greedy: "
        f"{about['settings']['generate']} tokens.",
        "",
        "| spec | tier | policy | B/token/head | vs f16 | PPL | ΔPPL | top-1 agree | needles | "
        "answers as default | greedy agree | first diff |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['spec']} | {r['tier']} | {r['policy']} | {r['bytes_per_token']:.1f} | "
            f"{r['compression']:.2f}x | {r['ppl']:.3f} | {r['delta_ppl']:+.3f} | "
            f"{r['top1_agreement']:.3f} | {r['needle_accuracy']:.2f} | "
            f"{r['needle_same_as_reference']:.2f} | "
            f"{r['greedy_agreement']:.3f} | {r['greedy_first_difference']} |"
        )
    return "\n".join(lines)


def compare(a: dict, b: dict) -> str:
    """Rows of two runs (say CUDA and CPU) measured for the same caches, side by side."""
    theirs = {r["cache"]: r for r in b["rows"]}
    lines = [
        f"{a['about']['device']} against {b['about']['device']}",
        "",
        "| cache | PPL (a) | PPL (b) | relative difference | needle answers equal | "
        "same greedy agreement |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in a["rows"]:
        s = theirs.get(r["cache"])
        if s is None:
            continue
        cells = {(c["length"], c["depth"]): c["generated"] for c in s["needles"]}
        both = [c for c in r["needles"] if (c["length"], c["depth"]) in cells]
        same = sum(c["generated"] == cells[(c["length"], c["depth"])] for c in both)
        lines.append(
            f"| {r['cache']} | {r['ppl']:.4f} | {s['ppl']:.4f} | "
            f"{abs(r['ppl'] / s['ppl'] - 1):.2e} | {same}/{len(both)} | "
            f"{'yes' if r['greedy_first_difference'] == s['greedy_first_difference'] and r['greedy_agreement'] == s['greedy_agreement'] else 'no'} |"
        )
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", help="bundled model name or a path")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--specs", default="all", help="comma-separated bundled names or paths")
    parser.add_argument("--tiers", help="only these tiers (names, or spec:tier)")
    parser.add_argument("--policies", default="none,spec,s4w64")
    parser.add_argument("--executor", default="jit", help="CPU caches: jit or interp")
    parser.add_argument("--select-from-layer", type=int, default=0,
                        help="a spec's [cache.select] applies from this layer on (earlier layers read every page)")
    defaults = Settings()
    parser.add_argument("--prefill", type=int, default=defaults.prefill)
    parser.add_argument("--steps", type=int, default=defaults.steps)
    parser.add_argument("--lengths", type=_ints, default=defaults.lengths)
    parser.add_argument("--depths", type=_floats, default=defaults.depths)
    parser.add_argument("--generate-prompt", type=int, default=defaults.generate_prompt)
    parser.add_argument("--generate", type=int, default=defaults.generate)
    parser.add_argument("--calibration", type=int, default=defaults.calibration)
    parser.add_argument("--question", choices=("decode", "prefill"), default=defaults.question,
                        help="decode a needle's question through the cache, or prefill it "
                        "with the haystack (Quest's protocol: only the answer is decoded)")
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--markdown", help="write the table here")
    parser.add_argument("--plots", help="write the pictures (PNG) into this folder")
    parser.add_argument("--plot-from", help="draw the pictures of a --json file; measure nothing")
    parser.add_argument("--compare", nargs=2, metavar=("A", "B"), help="two --json files, side by side")
    parser.add_argument(
        "--merge", nargs="+", metavar="JSON",
        help="runs of one model and device over other specs: one --json/--markdown of them all",
    )
    parser.add_argument(
        "--jobs", type=int, default=1,
        help="measure in this many processes, the specs dealt among them (a GPU run is "
        "bound by one core's launches), then merge",
    )
    args = parser.parse_args(argv)

    if args.compare:
        with open(args.compare[0]) as fa, open(args.compare[1]) as fb:
            print(compare(json.load(fa), json.load(fb)))
        return None
    if args.merge:
        result = merge(args.merge)
        write(result, args)
        return result
    if args.plot_from:
        from .quality_plots import draw

        with open(args.plot_from) as f:
            result = json.load(f)
        for path in draw(result, args.plots or "."):
            print(path)
        return result

    if args.jobs > 1:
        result = in_processes(args, argv if argv is not None else sys.argv[1:])
        write(result, args)
        return result
    settings = Settings(
        prefill=args.prefill, steps=args.steps, lengths=args.lengths, depths=args.depths,
        generate_prompt=args.generate_prompt, generate=args.generate, calibration=args.calibration,
        question=args.question,
    )
    torch.manual_seed(0)
    start = time.perf_counter()
    qm = load_model(args.model, device=args.device, dtype=getattr(torch, args.dtype))
    specs = list(Format.bundled()) if args.specs == "all" else args.specs.split(",")
    policies = args.policies.split(",")
    tiers = args.tiers.split(",") if args.tiers else None

    from tqdm import tqdm

    bar = tqdm(desc="reference", unit="step", disable=not sys.stderr.isatty(), file=sys.stderr)

    def progress(label, n):
        bar.set_description(label)
        bar.update(n)

    harness = Harness(qm, settings, progress=progress)
    measured = choices(harness, specs, policies, tiers, args.executor, args.select_from_layer)
    bar.reset(total=len(measured) * harness.steps_per_cache)
    rows = [harness.reference_row()]
    about = harness.describe()
    for choice in measured:
        rows.append(harness.row(choice))
        if args.json:  # every row as soon as it is measured
            with open(args.json, "w") as f:
                json.dump({"about": about, "rows": rows}, f, indent=1)
        r = rows[-1]
        bar.write(
            f"{r['cache']:28} {r['bytes_per_token']:7.1f} B/token  PPL {r['ppl']:9.3f} "
            f"({r['delta_ppl']:+.3f})  top-1 {r['top1_agreement']:.3f}  needles "
            f"{r['needle_accuracy']:.2f}  greedy {r['greedy_agreement']:.3f}  ({r['seconds']:.1f} s)"
        )
    bar.close()
    about["seconds"] = time.perf_counter() - start
    result = {"about": about, "rows": rows}
    write(result, args)
    return result


def in_processes(args, argv) -> dict:
    """The same run in `args.jobs` processes, each measuring a share of the
    specs (dealt by their tier count), merged into one result."""
    import subprocess
    import tempfile

    specs = list(Format.bundled()) if args.specs == "all" else args.specs.split(",")
    weight = {name: len(Format.load(name).tiers) for name in specs}
    shares = [[] for _ in range(min(args.jobs, len(specs)))]
    for name in sorted(specs, key=lambda n: -weight[n]):
        min(shares, key=lambda share: sum(weight[n] for n in share)).append(name)
    own = _without(argv, {"--jobs": 1, "--specs": 1, "--json": 1, "--markdown": 1, "--plots": 1})
    # The CPU's cores shared among the processes, not each taking them all.
    env = dict(os.environ)
    if args.device == "cpu":
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // len(shares))))
    with tempfile.TemporaryDirectory() as scratch:
        # Each share's rows beside --json as they are measured (kept if a process fails).
        folder = os.path.dirname(os.path.abspath(args.json)) if args.json else scratch
        stem = os.path.basename(args.json) if args.json else "quality"
        paths, children = [], []
        for i, share in enumerate(shares):
            paths.append(os.path.join(folder, f"{stem}.share{i}.json"))
            command = [sys.executable, "-m", "kvcc.bench.quality", *own, "--specs", ",".join(share),
                       "--json", paths[-1]]
            # Rows and progress go to this process's stderr; the merged table to stdout.
            children.append(subprocess.Popen(command, stdout=sys.stderr, env=env))
        failed = [c.args for c in children if c.wait() != 0]
        if failed:
            raise SystemExit(f"{len(failed)} of {len(children)} processes failed: {failed[0]}")
        result = merge(paths)
        for path in paths:
            os.remove(path)
        return result


def _without(argv, options) -> list:
    """`argv` less `options` (name -> how many values follow it)."""
    out, skip = [], 0
    for word in argv:
        if skip:
            skip -= 1
            continue
        name = word.split("=", 1)[0]
        if name in options:
            skip = 0 if "=" in word else options[name]
            continue
        out.append(word)
    return out


def merge(paths) -> dict:
    """One result of several runs on one model and device: the first run's
    reference row, then every run's measured rows."""
    runs = []
    for path in paths:
        with open(path) as f:
            runs.append(json.load(f))
    first = runs[0]["about"]
    for run in runs[1:]:
        about = run["about"]
        for key in ("model", "device", "dtype", "settings"):
            if about[key] != first[key]:
                raise SystemExit(f"cannot merge runs whose {key} differs: {first[key]} and {about[key]}")
    # The reference, then the specs in bundled order (each spec's tiers as measured).
    order = {name: i for i, name in enumerate(Format.bundled())}
    measured = [r for run in runs for r in run["rows"][1:]]
    measured.sort(key=lambda r: order.get(r["spec"], len(order)))
    rows = [runs[0]["rows"][0]] + measured
    about = dict(first, seconds=max(run["about"].get("seconds", 0.0) for run in runs))
    return {"about": about, "rows": rows}


def write(result, args) -> None:
    """The table on stdout and where --markdown says, the rows where --json
    says, the pictures where --plots says."""
    text = table(result["rows"], result["about"])
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text + "\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if args.plots:
        from .quality_plots import draw

        for path in draw(result, args.plots):
            print(path)


if __name__ == "__main__":
    main()
