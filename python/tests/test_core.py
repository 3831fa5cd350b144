"""Format, tables, the live cache and the one-shot paged cache on CPU tensors."""

import math

import pytest
import torch

import kvcc

BUNDLED = ["dense_f16", "spherical", "kivi", "subspace", "shard", "mosaic"]


def exact_attention(q, k, v):
    """q [b, hq, d], k/v [b, hk, t, d] -> out [b, hq, d], lse [b, hq]."""
    b, hq, d = q.shape
    group = hq // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    logits = torch.einsum("bhd,bhtd->bht", q.double(), k.double()) / math.sqrt(d)
    lse = torch.logsumexp(logits, dim=-1)
    out = torch.einsum("bht,bhtd->bhd", torch.softmax(logits, -1), v.double())
    return out.float(), lse.float()


def kv(batch, heads, tokens, d=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, heads, tokens, d, generator=g), torch.randn(batch, heads, tokens, d, generator=g)


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("name", BUNDLED)
def test_bundled_formats_load(name):
    fmt = kvcc.Format.load(name)
    assert fmt.name == name and fmt.head_dim == 128 and fmt.tiers
    assert fmt.bytes_per_token(None, 32768) > 0
    assert name in kvcc.Format.bundled()


def test_format_load_by_path_and_parse(tmp_path):
    source = kvcc.Format.bundled()["kivi"]
    path = tmp_path / "k.toml"
    path.write_text(source)
    assert kvcc.Format.load(str(path)).tiers == ["int8", "int4"]
    assert kvcc.Format.parse(source).tier_index("int4") == 1


def test_spec_errors_carry_the_cli_message():
    with pytest.raises(kvcc.SpecError, match="no bundled spec of that name"):
        kvcc.Format.load("no_such_spec")
    with pytest.raises(kvcc.SpecError, match=r"bad\.toml:\d+:\d+"):
        kvcc.Format.parse('name = "x"\nhead_dim = 100\n[page]\nitems = 64\n', "bad.toml")
    with pytest.raises(kvcc.KvccError, match="no tier `int2`"):
        kvcc.Format.load("kivi").tier_index("int2")


def test_train_returns_tables_per_tier_and_head():
    fmt = kvcc.Format.load("shard")
    k, v = kv(1, 2, 256)
    tables = fmt.train(k, v)
    assert (tables.tiers, tables.kv_heads) == (1, 2)
    arrays = tables.arrays(0, 1)
    assert arrays and all(a.dtype.name == "float32" for a in arrays)
    # [kv_heads, tokens, head_dim] gives the same tables as one sequence of a batch.
    same = fmt.train(k[0], v[0])
    assert all((a == b).all() for a, b in zip(same.arrays(0, 1), arrays))


def test_dense_live_cache_matches_exact_attention():
    fmt = kvcc.Format.load("dense_f16")
    k, v = kv(2, 2, 200)
    cache = kvcc.LiveCache(fmt, batch=2, kv_heads=2, capacity=64, sinks=4, window=32)
    assert cache.prefill(k, v) == [0, 1]
    k2, v2 = kv(2, 2, 3, seed=1)
    cache.append(k2, v2)
    assert cache.lengths() == [203, 203] and cache.state.tolist() == [203, 203]
    q = torch.randn(2, 8, 128, generator=torch.Generator().manual_seed(2))
    out, lse = cache.attend(q)
    ref, ref_lse = exact_attention(q, torch.cat([k, k2], 2), torch.cat([v, v2], 2))
    assert out.shape == q.shape and lse.shape == (2, 8)
    assert rel(out, ref) < 2e-3  # f16 pages and exact rows
    assert (lse - ref_lse).abs().max().item() < 1e-2
    # A 4-D decode query gives the same.
    out4, _ = cache.attend(q[:, :, None])
    assert out4.shape == (2, 8, 1, 128) and torch.equal(out4[:, :, 0], out)


@pytest.mark.parametrize("name", BUNDLED)
def test_every_bundled_tier_agrees_with_the_paged_cache(name):
    """The live cache with no exact rows attends exactly what the paged cache
    of the same tables and tier does; both stay near exact attention."""
    fmt = kvcc.Format.load(name)
    g = torch.Generator().manual_seed(3)
    # Low-rank keys and values, as real ones are, so PCA and codebooks have structure.
    basis = torch.randn(16, 128, generator=g)
    k = (torch.randn(1, 2, 256, 16, generator=g) @ basis) / 4
    v = (torch.randn(1, 2, 256, 16, generator=g) @ basis) / 4
    # The live cache stages tokens as f16 rows before it compresses them.
    k, v = k.half().float(), v.half().float()
    tables = fmt.train(k, v)
    q = 0.2 * k[:, :, 100].repeat_interleave(2, dim=1)  # 4 query heads, GQA 2
    ref, _ = exact_attention(q, k, v)
    for tier in fmt.tiers:
        cache = kvcc.LiveCache(fmt, 1, 2, 64, tables=tables, tier=tier, sinks=0, window=0)
        cache.prefill(k, v)
        out, lse = cache.attend(q)
        pages = kvcc.Pages(fmt, tables, tier)
        pages.add(k[0], v[0])
        out2, lse2 = pages.attend(q)
        torch.testing.assert_close(out, out2, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(lse, lse2, rtol=1e-4, atol=1e-4)
        assert rel(out, ref) < 1.0, (name, tier, rel(out, ref))


def test_ragged_prefill_release_and_set_tier():
    fmt = kvcc.Format.load("kivi")
    cache = kvcc.LiveCache(fmt, batch=3, kv_heads=1, capacity=32, window=0)
    ks = [torch.randn(1, n, 128) for n in (70, 130, 5)]
    vs = [torch.randn(1, n, 128) for n in (70, 130, 5)]
    assert cache.prefill(ks, vs) == [0, 1, 2]
    assert cache.lengths() == [70, 130, 5]
    cache.append(torch.randn(1, 1, 4, 128), torch.randn(1, 1, 4, 128), sequences=[2])
    assert cache.lengths() == [70, 130, 9]
    cache.set_tier("int4")
    assert cache.policy["tier"] == 1
    cache.release(1)
    assert cache.lengths() == [70, 9] and cache.state.tolist() == [70, 9, 0]
    out, lse = cache.attend(torch.randn(2, 2, 128))
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()


def test_policy_defaults_and_overrides():
    fmt = kvcc.Format.load("shard")
    cache = kvcc.LiveCache(fmt, 1, 1, 8)
    assert cache.policy == {"sinks": 4, "window": 64, "exact": "f16", "tier": 0}
    cache = kvcc.LiveCache(fmt, 1, 1, 8, sinks=0, window=16, exact="bf16")
    assert cache.policy == {"sinks": 0, "window": 16, "exact": "bf16", "tier": 0}


def test_errors_have_the_runtime_messages():
    fmt = kvcc.Format.load("kivi")
    cache = kvcc.LiveCache(fmt, batch=1, kv_heads=2, capacity=2, window=0)
    with pytest.raises(kvcc.KvccError, match="attend before prefill"):
        cache.attend(torch.randn(1, 2, 128))
    k, v = kv(1, 2, 64)
    bad = k.clone()
    bad[0, 1, 5, 7] = float("nan")
    with pytest.raises(kvcc.KvccError, match=r"keys is not finite \(NaN\) at kv_head 1, token 5, channel 7"):
        cache.prefill(bad, v)
    with pytest.raises(kvcc.KvccError, match=r"keys have shape \[1, 3, 64, 128\], which is not \[batch, kv_heads 2"):
        cache.prefill(torch.randn(1, 3, 64, 128), torch.randn(1, 3, 64, 128))
    with pytest.raises(TypeError, match=r"tensor `keys` has unsupported dtype INT64 \(supported: F32, F16, BF16\)"):
        cache.prefill(k.long(), v)
    cache.prefill(k, v)  # one page per head: both slots
    with pytest.raises(kvcc.CapacityError, match="tier `int8` needs 2 free pages but has 0 of 2"):
        cache.append(*kv(1, 2, 64, seed=5))
    assert cache.lengths() == [64]  # a failed call changes nothing
    q = torch.randn(1, 4, 128)
    q[0, 3, 9] = float("inf")
    with pytest.raises(kvcc.KvccError, match="query contains a non-finite value at sequence 0, head 3, channel 9"):
        cache.attend(q)
    with pytest.raises(kvcc.KvccError, match="which f16 exact rows cannot represent"):
        kvcc.LiveCache(fmt, 1, 2, 8).prefill(k * 1e6, v)


def test_tensors_on_another_device_are_refused():
    cache = kvcc.LiveCache("dense_f16", 1, 1, 8)
    k = torch.empty(1, 1, 4, 128, device="meta")
    with pytest.raises(kvcc.KvccError, match="tensor `keys` is on meta but the cache is on cpu"):
        cache.prefill(k, k)


def test_half_precision_inputs_and_outputs():
    fmt = kvcc.Format.load("dense_f16")
    k, v = kv(1, 1, 40)
    cache = kvcc.LiveCache(fmt, 1, 1, 8)
    cache.prefill(k.half(), v.bfloat16())
    out, lse = cache.attend(torch.randn(1, 2, 128, dtype=torch.bfloat16))
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_cuda_without_a_gpu_is_refused_before_training():
    with pytest.raises(kvcc.KvccError, match="CUDA driver|no GPU|GPU 0"):
        kvcc.LiveCache("dense_f16", 1, 1, 8, device="cuda")


def test_an_unknown_device_is_refused():
    with pytest.raises(kvcc.KvccError, match="no device `tpu`"):
        kvcc._kvcc.check_device("tpu")


def test_pages_compress_every_token():
    fmt = kvcc.Format.load("dense_f16")
    k, v = kv(1, 2, 10)
    tables = fmt.train(k, v)
    pages = kvcc.Pages(fmt, tables)
    assert pages.add(k[0], v[0]) == 0
    assert pages.page_bytes > 0
    q = torch.randn(1, 4, 128)
    out, lse = pages.attend(q)
    ref, ref_lse = exact_attention(q, k, v)
    assert rel(out, ref) < 2e-3 and (lse - ref_lse).abs().max() < 1e-2
