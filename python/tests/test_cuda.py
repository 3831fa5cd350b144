"""CUDA tensors against the CPU path: every bundled tier to 1e-4 relative,
f32/f16/bf16 inputs, a decode step captured in a CUDA graph and replayed
across appends, the CLI's messages for bad inputs, and the torch ops.
Skipped without a CUDA device."""

import pytest
import torch

import kvcc
import kvcc.ops  # noqa: F401  (registers torch.ops.kvcc)

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="no CUDA device: the CUDA live cache runs on an NVIDIA GPU (the CPU path is tested elsewhere)",
)

BUNDLED = ["dense_f16", "spherical", "kivi", "subspace", "shard", "mosaic"]


def data(seed=0, batch=2, kv_heads=2, tokens=300):
    g = torch.Generator().manual_seed(seed)
    basis = torch.randn(16, 128, generator=g)
    k = (torch.randn(batch, kv_heads, tokens, 16, generator=g) @ basis) / 4
    v = (torch.randn(batch, kv_heads, tokens, 16, generator=g) @ basis) / 4
    return k, v


def rel(a, b):
    return ((a.float().cpu() - b.float().cpu()).norm() / b.float().cpu().norm()).item()


def pair(fmt, tables, tier=None, window=None, **kw):
    """The same cache on the CPU and on CUDA."""
    return {
        device: kvcc.LiveCache(fmt, 2, 2, 64, device=device, tables=tables, tier=tier, window=window, **kw)
        for device in ["cpu", "cuda"]
    }


@pytest.mark.parametrize("name", BUNDLED)
def test_cuda_attend_agrees_with_the_cpu_on_every_tier(name):
    fmt = kvcc.Format.load(name)
    k, v = data()
    tables = fmt.train(k, v)
    q = 0.2 * k[:, :, 123].repeat_interleave(4, dim=1)
    steps_k, steps_v = data(seed=1, tokens=80)
    for tier in fmt.tiers:
        caches = pair(fmt, tables, tier, window=32)
        for device, cache in caches.items():
            cache.prefill(k.to(device), v.to(device))
            cache.append(steps_k[:, :, :3].to(device), steps_v[:, :, :3].to(device))
        # Token by token across page fills and compressions.
        for t in range(3, 80):
            for device, cache in caches.items():
                cache.append(steps_k[:, :, t : t + 1].to(device), steps_v[:, :, t : t + 1].to(device))
            if t % 19 == 0 or t == 79:
                (out, lse), (cuda_out, cuda_lse) = (c.attend(q.to(d)) for d, c in caches.items())
                assert cuda_out.device.type == "cuda" and cuda_out.dtype == torch.float32
                assert rel(cuda_out, out) <= 1e-4, (name, tier, t, rel(cuda_out, out))
                torch.testing.assert_close(cuda_lse.cpu(), lse, rtol=1e-4, atol=1e-4)
        assert caches["cuda"].lengths() == caches["cpu"].lengths() == [380, 380]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("exact", ["f16", "bf16"])
def test_model_dtypes_round_like_the_cpu(dtype, exact):
    fmt = kvcc.Format.load("kivi")
    k, v = data()
    k, v = k.to(dtype), v.to(dtype)
    tables = fmt.train(k, v)
    step_k, step_v = (t.to(dtype) for t in data(seed=2, tokens=70))
    q = (0.2 * k[:, :, 7].float().repeat_interleave(4, dim=1)).to(dtype)
    results = {}
    for device, cache in pair(fmt, tables, "int4", window=32, exact=exact).items():
        cache.prefill(k.to(device), v.to(device))
        cache.append(step_k.to(device), step_v.to(device))
        results[device] = cache.attend(q.to(device)), cache.attend(q.float().to(device))
    ((_, _), (out, lse)), ((cuda_low, _), (cuda_out, cuda_lse)) = results["cpu"], results["cuda"]
    assert rel(cuda_out, out) <= 1e-4, (dtype, exact, rel(cuda_out, out))
    torch.testing.assert_close(cuda_lse.cpu(), lse, rtol=1e-4, atol=1e-4)
    assert cuda_low.dtype == dtype
    torch.testing.assert_close(cuda_low.cpu(), out.to(dtype))


def test_ragged_prefill_and_release_on_cuda():
    fmt = kvcc.Format.load("shard")
    k, v = data(tokens=400)
    tables = fmt.train(k, v)
    q = 0.2 * k[:, :, 9].repeat_interleave(4, dim=1)
    results = {}
    for device, cache in pair(fmt, tables).items():
        cache.prefill([k[0, :, :400].to(device), k[1, :, :151].to(device)],
                      [v[0, :, :400].to(device), v[1, :, :151].to(device)])
        out, _ = cache.attend(q.to(device))
        cache.release(0)
        out1, _ = cache.attend(q[1:].to(device))
        results[device] = out, out1, cache.lengths()
    assert results["cuda"][2] == results["cpu"][2] == [151]
    assert rel(results["cuda"][0], results["cpu"][0]) <= 1e-4
    assert rel(results["cuda"][1], results["cpu"][1]) <= 1e-4


def test_a_captured_decode_step_replays_right_across_appends():
    fmt = kvcc.Format.load("kivi")
    k, v = data()
    tables = fmt.train(k, v)
    steps_k, steps_v = data(seed=3, tokens=150)
    caches = pair(fmt, tables, "int4", window=32, check_finite=False)
    for device, cache in caches.items():
        cache.prefill(k.to(device), v.to(device))
    cuda = caches["cuda"]
    static_q = torch.randn(2, 8, 128, device="cuda")
    cuda.attend(static_q)  # the first step for 8 query heads plans outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out, static_lse = cuda.attend(static_q)
    generation = cuda.generation
    g = torch.Generator().manual_seed(5)
    for t in range(150):
        for device, cache in caches.items():
            cache.append(steps_k[:, :, t : t + 1].to(device), steps_v[:, :, t : t + 1].to(device))
        q = torch.randn(2, 8, 128, generator=g)
        static_q.copy_(q)
        graph.replay()
        if t % 10 == 9:
            eager_out, eager_lse = cuda.attend(q.cuda())
            torch.testing.assert_close(static_out, eager_out, rtol=0, atol=0)
            torch.testing.assert_close(static_lse, eager_lse, rtol=0, atol=0)
            out, lse = caches["cpu"].attend(q)
            assert rel(static_out, out) <= 1e-4, (t, rel(static_out, out))
    # Pages were allocated and compressed while the one graph kept replaying.
    assert cuda.generation > generation


def test_another_query_head_count_reloads_the_kernels_on_any_stream():
    fmt = kvcc.Format.load("kivi")
    k, v = data()
    cache = kvcc.LiveCache(fmt, 2, 2, 64, device="cuda", tier="int4")
    cache.prefill(k.cuda(), v.cuda())
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        # Outside a capture the first step plans and loads; a second query-head
        # count reloads the kernels, also eagerly.
        out4, _ = cache.attend(torch.randn(2, 4, 128, device="cuda"))
        out8, _ = cache.attend(torch.randn(2, 8, 128, device="cuda"))
    torch.cuda.synchronize()
    assert out4.shape == (2, 4, 128) and out8.shape == (2, 8, 128)
    assert torch.isfinite(out4).all() and torch.isfinite(out8).all()


def messages(fmt_name, call):
    """The error messages of `call(cache, device)` on a CPU and a CUDA cache."""
    fmt = kvcc.Format.load(fmt_name)
    k, v = data()
    tables = fmt.train(k, v)
    found = {}
    for device, cache in pair(fmt, tables).items():
        cache.prefill(k.to(device), v.to(device))
        with pytest.raises((kvcc.KvccError, TypeError)) as error:
            call(cache, device)
        found[device] = (type(error.value), str(error.value))
    return found


def test_bad_inputs_raise_the_cpu_messages():
    k, v = data(tokens=2)
    nan = k.clone()
    nan[1, 1, 1, 7] = float("nan")
    big = k.clone()
    big[0, 0, 1, 3] = 1e6
    q = torch.randn(2, 8, 128)
    bad_q = q.clone()
    bad_q[1, 3, 9] = float("inf")
    cases = {
        "nan keys": lambda c, d: c.append(nan.to(d), v.to(d)),
        "beyond f16": lambda c, d: c.append(big.to(d), v.to(d)),
        "inf query": lambda c, d: c.attend(bad_q.to(d)),
        "head_dim": lambda c, d: c.append(k[..., :64].to(d), v[..., :64].to(d)),
        "batch": lambda c, d: c.attend(q[:1].to(d)),
        "grouping": lambda c, d: c.attend(torch.randn(2, 3, 128).to(d)),
        "dtype": lambda c, d: c.append(k.to(d).int(), v.to(d)),
    }
    for what, call in cases.items():
        found = messages("kivi", call)
        assert found["cuda"] == found["cpu"], (what, found)
    expected = {
        "nan keys": "keys is not finite (NaN) at kv_head 1, token 1, channel 7",
        "beyond f16": "keys hold 1000000, which f16 exact rows cannot represent",
        "inf query": "query contains a non-finite value at sequence 1, head 3, channel 9",
    }
    for what, text in expected.items():
        assert text in messages("kivi", cases[what])["cuda"][1], what


def test_tensors_of_another_device_are_refused():
    fmt = kvcc.Format.load("kivi")
    k, v = data()
    cache = kvcc.LiveCache(fmt, 2, 2, 64, device="cuda")
    with pytest.raises(kvcc.KvccError, match="tensor `keys` is on cpu but the cache is on cuda"):
        cache.prefill(k, v)
    cache.prefill(k.cuda(), v.cuda())
    with pytest.raises(kvcc.KvccError, match="tensor `queries` is on cpu but the cache is on cuda"):
        cache.attend(torch.randn(2, 8, 128))
    cpu = kvcc.LiveCache(fmt, 2, 2, 64, tables=fmt.train(k, v))
    with pytest.raises(kvcc.KvccError, match="tensor `keys` is on cuda:0 but the cache is on cpu"):
        cpu.prefill(k.cuda(), v.cuda())


def test_the_torch_ops_run_on_cuda_tensors():
    fmt = kvcc.Format.load("kivi")
    k, v = data()
    tables = fmt.train(k, v)
    step_k, step_v = data(seed=4, tokens=1)
    q = torch.randn(2, 8, 128, device="cuda")
    direct = kvcc.LiveCache(fmt, 2, 2, 64, device="cuda", tables=tables)
    direct.prefill(k.cuda(), v.cuda())
    direct.append(step_k.cuda(), step_v.cuda())
    cache = kvcc.LiveCache(fmt, 2, 2, 64, device="cuda", tables=tables)
    torch.ops.kvcc.prefill(cache.state, cache.handle, k.cuda(), v.cuda())
    torch.ops.kvcc.append(cache.state, cache.handle, step_k.cuda(), step_v.cuda())
    out, lse = torch.ops.kvcc.attend(cache.state, cache.handle, q)
    assert cache.state.tolist() == [301, 301]
    want, want_lse = direct.attend(q)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=0)


def test_what_cannot_be_captured_says_so():
    # Last in the file: an error inside a capture ends it early.
    fmt = kvcc.Format.load("kivi")
    k, v = data()
    cache = kvcc.LiveCache(fmt, 2, 2, 64, device="cuda", check_finite=False)
    cache.prefill(k.cuda(), v.cuda())
    q = torch.randn(2, 8, 128, device="cuda")
    step_k, step_v = k[:, :, :1].cuda(), v[:, :, :1].cuda()
    torch.cuda.synchronize()
    with pytest.raises(kvcc.KvccError, match="an append cannot be captured"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            cache.append(step_k, step_v)
    with pytest.raises(kvcc.KvccError, match="run it once before capturing"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            cache.attend(q)
    out, _ = cache.attend(q)  # the cache still works eagerly
    assert torch.isfinite(out).all()
