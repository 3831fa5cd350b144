"""Decode times of two builds measured in one call, alternating runs.

Usage: before_after.py LIMIT BEFORE.json... -- AFTER.json...
Each file is a `kvcc bench --save` result; runs of one build are combined by
their median per (format, tier, context). Prints one row per tier and context
and exits 1 if any tier of the after build is more than LIMIT (e.g. 0.02)
slower than before.
"""
import json
import statistics
import sys

limit = float(sys.argv[1])
files = sys.argv[2:]
split = files.index("--")
key = lambda r: (r["format"], r["tier"], r["context"])


def medians(paths):
    runs = {}
    for p in paths:
        for r in json.load(open(p))["rows"]:
            runs.setdefault(key(r), []).append(r["ms"])
    return {k: statistics.median(v) for k, v in runs.items()}


before, after = medians(files[:split]), medians(files[split + 1:])
worst = 0.0
print(f"{'format/tier':24} {'ctx':>7} {'before ms':>10} {'after ms':>9} {'after/before':>13}")
for k in sorted(after):
    if k not in before:
        print(f"{k[0] + '/' + k[1]:24} {k[2]:>7} {'-':>10} {after[k]:>9.4f}  (new)")
        continue
    ratio = after[k] / before[k]
    worst = max(worst, ratio - 1)
    print(f"{k[0] + '/' + k[1]:24} {k[2]:>7} {before[k]:>10.4f} {after[k]:>9.4f} {ratio:>12.3f}x")
print(f"largest slowdown after vs before: {100 * worst:.1f}% (limit {100 * limit:.0f}%)")
sys.exit(1 if worst > limit else 0)
