#!/usr/bin/env python3
"""Dense f16 decode baselines for `kvcc bench`: PyTorch SDPA and FlashInfer paged decode.

Times one decode step (one query token per sequence) over a KV cache of
`--ctx` tokens, on the shape given, with CUDA events: warm-up, median of many
runs, inputs rotated across several KV sets so L2 (50-60 MB) cannot serve them,
never zeros. Prints a table and writes JSON for `kvcc bench --baseline`.
"""
import argparse
import json
import statistics
import sys

import torch


def timed(fn, sets, warmup, iters, timing):
    """Median milliseconds of fn(set) over `iters` runs, rotating through sets.

    queued (as `kvcc bench --timing queued`): runs enqueued back to back, each
    between its own events, so the host's launch work overlaps the run before
    and the events time the GPU's work while the host keeps ahead. synced: each
    run is waited for first. graph: each set's run captured once as a CUDA
    graph (as serving stacks run decode) and replayed queued, so the host's
    launch work is gone even where it is slower than the GPU (batch 1).
    """
    for i in range(warmup):
        fn(sets[i % len(sets)])
    torch.cuda.synchronize()
    run = fn
    if timing == "graph":
        graphs = []
        for s in sets:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                fn(s)
            graphs.append(g)
        by_set = {id(s): g for s, g in zip(sets, graphs)}
        run = lambda s: by_set[id(s)].replay()  # noqa: E731
        for i in range(warmup):
            run(sets[i % len(sets)])
        torch.cuda.synchronize()
    events = []
    for i in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run(sets[i % len(sets)])
        end.record()
        if timing == "synced":
            end.synchronize()
        events.append((start, end))
    torch.cuda.synchronize()
    times = [start.elapsed_time(end) for start, end in events]
    return statistics.median(times), min(times), max(times)


def make_sets(batch, q_heads, kv_heads, ctx, dim, count):
    sets = []
    for s in range(count):
        g = torch.Generator(device="cuda").manual_seed(1234 + s)
        q = torch.randn(batch, q_heads, 1, dim, device="cuda", dtype=torch.float16, generator=g)
        k = torch.randn(batch, kv_heads, ctx, dim, device="cuda", dtype=torch.float16, generator=g)
        v = torch.randn(batch, kv_heads, ctx, dim, device="cuda", dtype=torch.float16, generator=g)
        sets.append((q, k, v))
    return sets


def sdpa(args, ctx, sets):
    def run(s):
        q, k, v = s
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    # Correctness against an fp32 reference on one set, so a fast wrong path never counts.
    q, k, v = sets[0]
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.float(), k.float().repeat_interleave(args.q_heads // args.kv_heads, 1),
        v.float().repeat_interleave(args.q_heads // args.kv_heads, 1))
    err = ((run(sets[0]).float() - ref).norm() / ref.norm()).item()
    assert err < 1e-2, f"SDPA error {err}"
    return timed(run, sets, args.warmup, args.iters, args.timing), err


def flashinfer_decode(args, ctx, sets):
    import flashinfer
    page = args.fi_page
    pages_per_seq = (ctx + page - 1) // page
    workspace = torch.empty(256 * 1024 * 1024, dtype=torch.uint8, device="cuda")
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
    indptr = torch.arange(0, args.batch + 1, dtype=torch.int32, device="cuda") * pages_per_seq
    indices = torch.arange(0, args.batch * pages_per_seq, dtype=torch.int32, device="cuda")
    last = torch.full((args.batch,), ctx - (pages_per_seq - 1) * page, dtype=torch.int32, device="cuda")
    wrapper.plan(indptr, indices, last, args.q_heads, args.kv_heads, args.dim, page,
                 q_data_type=torch.float16, kv_data_type=torch.float16)
    paged = []
    for q, k, v in sets:
        # [batch, kv_heads, ctx, dim] -> pages [batch*pages, 2, page, kv_heads, dim] (NHD).
        pad = pages_per_seq * page - ctx
        kk = torch.nn.functional.pad(k, (0, 0, 0, pad)).permute(0, 2, 1, 3)
        vv = torch.nn.functional.pad(v, (0, 0, 0, pad)).permute(0, 2, 1, 3)
        kv = torch.stack([kk, vv], 1).reshape(args.batch, 2, pages_per_seq, page, args.kv_heads, args.dim)
        kv = kv.permute(0, 2, 1, 3, 4, 5).reshape(args.batch * pages_per_seq, 2, page, args.kv_heads, args.dim).contiguous()
        paged.append((q.reshape(args.batch, args.q_heads, args.dim).contiguous(), kv))
    del sets

    def run(s):
        return wrapper.run(s[0], s[1])
    return timed(run, paged, args.warmup, args.iters, args.timing)


def write_results(results, path):
    """Writes the JSON `kvcc bench --baseline` reads and prints a table on stderr."""
    with open(path, "w") as f:
        json.dump(results, f, indent=2)
    print(f"{'baseline':<20} {'ctx':>7} {'ms':>9} {'TB/s':>6}", file=sys.stderr)
    for r in results["rows"]:
        if "ms" in r:
            rate = f"{r['tb_per_s']:>6.2f}" if "tb_per_s" in r else f"{'-':>6}"
            print(f"{r['baseline']:<20} {r['ctx']:>7} {r['ms']:>9.4f} {rate}", file=sys.stderr)
        else:
            print(f"{r['baseline']:<20} {r['ctx']:>7} unavailable: {r['error']}", file=sys.stderr)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--q-heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--ctx", default="8192,32768,131072")
    p.add_argument("--sets", type=int, default=3)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--fi-page", type=int, default=16)
    p.add_argument("--timing", choices=["queued", "synced", "graph"], default="queued")
    p.add_argument("--json", required=True)
    args = p.parse_args()
    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "timing": args.timing, "rows": []}
    dense_bytes_per_token = 2 * 2 * args.dim  # K + V, f16, per kv head
    for ctx in [int(c) for c in args.ctx.split(",")]:
        sets = make_sets(args.batch, args.q_heads, args.kv_heads, ctx, args.dim, args.sets)
        bytes_read = args.batch * args.kv_heads * ctx * dense_bytes_per_token
        (med, lo, hi), err = sdpa(args, ctx, sets)
        results["rows"].append({"baseline": "sdpa", "ctx": ctx, "ms": med, "min_ms": lo, "max_ms": hi,
                                "bytes": bytes_read, "tb_per_s": bytes_read / med / 1e9, "rel_error": err})
        try:
            med, lo, hi = flashinfer_decode(args, ctx, sets)
            results["rows"].append({"baseline": "flashinfer", "ctx": ctx, "ms": med, "min_ms": lo, "max_ms": hi,
                                    "bytes": bytes_read, "tb_per_s": bytes_read / med / 1e9})
        except Exception as e:  # FlashInfer is optional: report why it is missing.
            results["rows"].append({"baseline": "flashinfer", "ctx": ctx, "error": repr(e)[:300]})
        del sets
        torch.cuda.empty_cache()
    write_results(results, args.json)


if __name__ == "__main__":
    main()
