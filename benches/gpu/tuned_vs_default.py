"""Tuned vs default decode times from two `kvcc bench --save` files of one call.

Usage: tuned_vs_default.py DEFAULT.json TUNED.json
Prints one row per tier and context; exits 1 if a tuned configuration is more
than 3% slower than the default (beyond run-to-run noise of one call).
"""
import json
import sys

default, tuned = (json.load(open(p)) for p in sys.argv[1:3])
key = lambda r: (r["format"], r["tier"], r["context"])
base = {key(r): r for r in default["rows"]}
worst = 0.0
print(f"{'format/tier':24} {'ctx':>7} {'default ms':>11} {'tuned ms':>9} {'speedup':>8}  config")
for r in tuned["rows"]:
    d = base.get(key(r))
    if d is None:
        continue
    speedup = d["ms"] / r["ms"]
    worst = max(worst, r["ms"] / d["ms"] - 1)
    config = r["config"] + (" (tuned)" if r["tuned"] else " (default: no entry)")
    print(f"{r['format'] + '/' + r['tier']:24} {r['context']:>7} {d['ms']:>11.4f} {r['ms']:>9.4f} {speedup:>7.2f}x  {config}")
print(f"largest slowdown of tuned vs default: {100 * worst:.1f}%")
sys.exit(1 if worst > 0.03 else 0)
