#!/usr/bin/env python3
"""Compares ncu's DRAM bytes read by each decode kernel with the bytes the layout
says a decode step must read (from `kvcc bench --json`): no hidden reconstruction.

Usage: ncu_bytes.py NCU_CSV BENCH_JSON   (both written by benches/gpu/run.sh ncu)
"""
import csv
import json
import sys

UNITS = {"byte": 1, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9}


def main(ncu_csv, bench_json):
    rows = [r for r in csv.reader(open(ncu_csv)) if len(r) > 5]
    header, data = rows[0], rows[1:]
    name, unit, value = (header.index(k) for k in ("Kernel Name", "Metric Unit", "Metric Value"))
    measured = {}
    for r in data:
        if r[name].endswith("_decode"):
            # The largest launch of a kernel is the timed step (the others verify on a small cache).
            b = float(r[value].replace(",", "")) * UNITS[r[unit]]
            measured[r[name]] = max(measured.get(r[name], 0), b)
    bench = json.load(open(bench_json))
    shape = bench["shape"]
    worst = 0.0
    print(f"{'kernel':<32} {'layout MB':>10} {'DRAM MB':>10} {'ratio':>7}")
    for row in bench["rows"]:
        kernel = f"kvcc_{row['format']}_{row['tier']}_decode"
        # kvcc bench defines TB/s as the layout's bytes per step over the median time.
        layout = row["tb_per_s"] * row["ms"] * 1e9
        got = measured.get(kernel)
        if got is None:
            print(f"{kernel:<32} {layout / 1e6:>10.1f} {'missing':>10}")
            worst = float("inf")
            continue
        ratio = got / layout
        worst = max(worst, abs(ratio - 1))
        print(f"{kernel:<32} {layout / 1e6:>10.1f} {got / 1e6:>10.1f} {ratio:>7.3f}")
    print(f"shape: {shape}; largest deviation {worst:.1%} (bar: 15%)")
    return 0 if worst <= 0.15 else 1


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
