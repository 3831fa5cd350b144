#!/usr/bin/env python3
"""What bounds each decode kernel, from ncu: per kernel (its longest launch,
the timed step) the share of DRAM and SM peak, how busy the issue slots
are, shared-memory bank conflicts per shared wavefront, the tensor pipe and
the occupancy. Written by `benches/gpu/run.sh ncu-bound`.

Usage: ncu_bound.py NCU_CSV [--json OUT]
"""
import csv
import json
import sys

METRICS = {
    "gpu__time_duration.sum": "us",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed": "dram %",
    "sm__throughput.avg.pct_of_peak_sustained_elapsed": "sm %",
    "smsp__issue_active.avg.pct_of_peak_sustained_active": "issue %",
    "l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum": "conflicts",
    "l1tex__data_pipe_lsu_wavefronts_mem_shared.sum": "shared wavefronts",
    "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active": "tensor %",
    "sm__warps_active.avg.pct_of_peak_sustained_active": "occupancy %",
}


def number(text):
    return float(text.replace(",", "")) if text not in ("", "n/a") else float("nan")


def main(path, out=None):
    rows = [r for r in csv.reader(open(path)) if len(r) > 5]
    header, data = rows[0], rows[1:]
    at = {k: header.index(k) for k in ("ID", "Kernel Name", "Metric Name", "Metric Unit", "Metric Value")}
    launches = {}
    for r in data:
        launch = launches.setdefault((r[at["Kernel Name"]], r[at["ID"]]), {})
        value = number(r[at["Metric Value"]])
        if r[at["Metric Name"]] == "gpu__time_duration.sum":
            value *= {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3}.get(r[at["Metric Unit"]], 1.0)
        launch[r[at["Metric Name"]]] = value
    kernels = {}
    for (name, _), m in launches.items():
        if name.endswith("_decode") and m.get("gpu__time_duration.sum", 0) > kernels.get(name, {}).get("gpu__time_duration.sum", -1):
            kernels[name] = m
    columns = list(METRICS.values()) + ["conflicts / wavefront"]
    print(f"{'kernel':<36}" + "".join(f"{c:>19}" for c in columns))
    report = []
    for name, m in sorted(kernels.items()):
        row = {label: m.get(metric, float("nan")) for metric, label in METRICS.items()}
        waves = row["shared wavefronts"]
        row["conflicts / wavefront"] = row["conflicts"] / waves if waves else 0.0
        report.append({"kernel": name, **row})
        print(f"{name:<36}" + "".join(f"{row[c]:>19.3g}" for c in columns))
    if out:
        json.dump(report, open(out, "w"), indent=1)


if __name__ == "__main__":
    args = sys.argv[1:]
    out = args[args.index("--json") + 1] if "--json" in args else None
    main(args[0], out)
