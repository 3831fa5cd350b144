"""CUDA tensors against the CPU path: every bundled tier to 1e-4 relative,
and a decode step captured in a CUDA graph. Skipped without a GPU; on a GPU
they fail until the CUDA live cache is wired in (python/src/device.rs)."""

import pytest
import torch

import kvcc

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

BUNDLED = ["dense_f16", "spherical", "kivi", "subspace", "shard", "mosaic"]


def data(seed=0, batch=2, kv_heads=2, tokens=300):
    g = torch.Generator().manual_seed(seed)
    basis = torch.randn(16, 128, generator=g)
    k = (torch.randn(batch, kv_heads, tokens, 16, generator=g) @ basis) / 4
    v = (torch.randn(batch, kv_heads, tokens, 16, generator=g) @ basis) / 4
    return k.half().float(), v.half().float()


@pytest.mark.parametrize("name", BUNDLED)
def test_cuda_attend_agrees_with_the_cpu_on_every_tier(name):
    fmt = kvcc.Format.load(name)
    k, v = data()
    tables = fmt.train(k, v)
    q = 0.2 * k[:, :, 123].repeat_interleave(4, dim=1)
    step_k, step_v = data(seed=1, tokens=3)
    for tier in fmt.tiers:
        caches = {}
        for device in ["cpu", "cuda"]:
            cache = kvcc.LiveCache(fmt, 2, 2, 64, device=device, tables=tables, tier=tier)
            cache.prefill(k.to(device), v.to(device))
            cache.append(step_k.to(device), step_v.to(device))
            caches[device] = cache.attend(q.to(device))
        (out, lse), (cuda_out, cuda_lse) = caches["cpu"], caches["cuda"]
        rel = ((cuda_out.cpu() - out).norm() / out.norm()).item()
        assert rel <= 1e-4, (name, tier, rel)
        torch.testing.assert_close(cuda_lse.cpu(), lse, rtol=1e-4, atol=1e-4)


def test_a_decode_step_is_captured_in_a_cuda_graph():
    fmt = kvcc.Format.load("kivi")
    k, v = data()
    cache = kvcc.LiveCache(fmt, 2, 2, 64, device="cuda", tier="int4")
    cache.prefill(k.cuda(), v.cuda())
    q = torch.randn(2, 8, 128, device="cuda")
    static_q = q.clone()
    cache.attend(static_q)  # warm-up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out, static_lse = cache.attend(static_q)
    q2 = torch.randn(2, 8, 128, device="cuda")
    static_q.copy_(q2)
    graph.replay()
    out, lse = cache.attend(q2)
    torch.testing.assert_close(static_out, out)
    torch.testing.assert_close(static_lse, lse)
