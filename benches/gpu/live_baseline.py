#!/usr/bin/env python3
"""Dense serving-loop baselines for `kvcc bench --live`.

Each step appends one token per sequence to a KV cache of `--ctx` tokens and
decodes one query token per sequence, as `kvcc bench --live` does on the
compressed live cache:

- `sdpa_live`: a preallocated f16 cache [batch, kv_heads, capacity, dim]; the
  new K/V written in place, then PyTorch SDPA over the filled prefix (a view),
  each kv head's query group as its query rows (so the flash kernel serves
  GQA without repeating K/V). SDPA may use the flash and memory-efficient
  kernels only: its cuDNN kernel builds a new graph for every new length
  (tens of ms a step), which no serving loop would accept.
- `flashinfer_live` / `flashinfer_fp8_live`: FlashInfer's paged cache
  (`--fi-page` tokens a page, NHD), `append_paged_kv_cache` then
  `BatchDecodeWithPagedKVCacheWrapper` planned for the new lengths, in f16 and
  in fp8 e4m3 (keys and values converted before the append, scale 1). Page
  tables and lengths of every step are prepared before timing (host copies
  for `plan`, device copies for the kernels), as a serving loop keeps them.

CUDA events around every step, steps enqueued back to back, the mean over
`--steps` steps after a warm-up; never zeros. Writes JSON that `kvcc bench
--live --baseline` reads (the same shape as baseline.py's).
"""
import argparse

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from baseline import write_results


def timed(step, warmup, steps):
    for i in range(warmup):
        step(i)
    torch.cuda.synchronize()
    events = []
    for i in range(warmup, warmup + steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step(i)
        end.record()
        events.append((start, end))
    torch.cuda.synchronize()
    times = [s.elapsed_time(e) for s, e in events]
    return sum(times) / len(times), min(times), max(times)


def new_tokens(args, total, g):
    """One token per sequence per step: [steps, batch, kv_heads, dim] K and V."""
    shape = (total, args.batch, args.kv_heads, args.dim)
    k = torch.randn(shape, device="cuda", dtype=torch.float16, generator=g)
    v = torch.randn(shape, device="cuda", dtype=torch.float16, generator=g)
    return k, v


def sdpa_live(args, ctx, q, k_new, v_new, g):
    total = args.warmup + args.steps
    shape = (args.batch, args.kv_heads, ctx + total, args.dim)
    k_cache = torch.randn(shape, device="cuda", dtype=torch.float16, generator=g)
    v_cache = torch.randn(shape, device="cuda", dtype=torch.float16, generator=g)
    group = args.q_heads // args.kv_heads
    # Query head h serves kv head h // group: a kv head's group as query rows.
    q_rows = q.reshape(args.batch, args.kv_heads, group, args.dim)

    backends = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]

    def step(i):
        pos = ctx + i
        k_cache[:, :, pos] = k_new[i]
        v_cache[:, :, pos] = v_new[i]
        with sdpa_kernel(backends):
            return torch.nn.functional.scaled_dot_product_attention(
                q_rows, k_cache[:, :, : pos + 1], v_cache[:, :, : pos + 1])

    # Correctness on the first step against fp32, so a fast wrong path never counts.
    out = step(0).float().reshape(args.batch, args.q_heads, 1, args.dim)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.float().reshape(args.batch, args.q_heads, 1, args.dim),
        k_cache[:, :, : ctx + 1].float().repeat_interleave(group, 1),
        v_cache[:, :, : ctx + 1].float().repeat_interleave(group, 1))
    err = ((out - ref).norm() / ref.norm()).item()
    assert err < 1e-2, f"SDPA error {err}"
    result = timed(step, args.warmup, args.steps)
    del k_cache, v_cache
    return result, err


def flashinfer_live(args, ctx, q, k_new, v_new, g, dtype):
    import flashinfer
    page = args.fi_page
    total = args.warmup + args.steps
    pages_per_seq = (ctx + total + page - 1) // page
    cache = torch.randn(args.batch * pages_per_seq, 2, page, args.kv_heads, args.dim,
                        device="cuda", dtype=torch.float16, generator=g).to(dtype)
    workspace = torch.empty(256 * 1024 * 1024, dtype=torch.uint8, device="cuda")
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
    batch_indices = torch.arange(args.batch, dtype=torch.int32, device="cuda")
    k_in, v_in = k_new.to(dtype), v_new.to(dtype)
    # Each sequence owns pages [s * pages_per_seq, (s + 1) * pages_per_seq).
    starts = torch.arange(args.batch, dtype=torch.int32) * pages_per_seq
    tables = []
    for i in range(total):
        length = ctx + i + 1
        used = (length + page - 1) // page
        host = {
            "indptr": torch.arange(args.batch + 1, dtype=torch.int32) * used,
            "indices": (starts[:, None] + torch.arange(used, dtype=torch.int32)[None, :]).reshape(-1),
            "last": torch.full((args.batch,), length - (used - 1) * page, dtype=torch.int32),
            "positions": torch.full((args.batch,), length - 1, dtype=torch.int32),
        }
        tables.append((host, {k: v.to("cuda") for k, v in host.items()}))
    torch.cuda.synchronize()

    def step(i):
        host, dev = tables[i]
        flashinfer.append_paged_kv_cache(k_in[i], v_in[i], batch_indices, dev["positions"], cache,
                                         dev["indices"], dev["indptr"], dev["last"])
        wrapper.plan(host["indptr"], dev["indices"], host["last"], args.q_heads, args.kv_heads,
                     args.dim, page, q_data_type=torch.float16, kv_data_type=dtype)
        return wrapper.run(q, cache)

    return timed(step, args.warmup, args.steps)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--q-heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--ctx", default="8192,32768,131072")
    p.add_argument("--warmup", type=int, default=64)
    p.add_argument("--steps", type=int, default=256)
    p.add_argument("--fi-page", type=int, default=64)
    p.add_argument("--json", required=True)
    args = p.parse_args()
    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "timing": "queued", "rows": []}
    for ctx in [int(c) for c in args.ctx.split(",")]:
        g = torch.Generator(device="cuda").manual_seed(1234 + ctx)
        q = torch.randn(args.batch, args.q_heads, args.dim, device="cuda", dtype=torch.float16, generator=g)
        k_new, v_new = new_tokens(args, args.warmup + args.steps, g)
        (mean, lo, hi), err = sdpa_live(args, ctx, q, k_new, v_new, g)
        results["rows"].append({"baseline": "sdpa_live", "ctx": ctx, "ms": mean, "min_ms": lo, "max_ms": hi,
                                "rel_error": err})
        torch.cuda.empty_cache()
        for name, dtype in [("flashinfer_live", torch.float16), ("flashinfer_fp8_live", torch.float8_e4m3fn)]:
            try:
                mean, lo, hi = flashinfer_live(args, ctx, q, k_new, v_new, g, dtype)
                results["rows"].append({"baseline": name, "ctx": ctx, "ms": mean, "min_ms": lo, "max_ms": hi})
            except Exception as e:  # FlashInfer is optional: report why it is missing.
                results["rows"].append({"baseline": name, "ctx": ctx, "error": repr(e)[:300]})
            torch.cuda.empty_cache()
    write_results(results, args.json)


if __name__ == "__main__":
    main()
