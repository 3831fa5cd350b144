"""The torch.library ops: eager calls, fake implementations, torch.compile."""

import torch

import kvcc


def make_cache(batch=2, kv_heads=2):
    return kvcc.LiveCache("kivi", batch, kv_heads, 64, window=64)


def test_ops_match_the_methods():
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(2, 2, 150, 128, generator=g), torch.randn(2, 2, 150, 128, generator=g)
    a, b = make_cache(), make_cache()
    a.prefill(k, v)
    torch.ops.kvcc.prefill(b.state, b.handle, k, v)
    assert b.state.tolist() == [150, 150]
    step = torch.randn(2, 2, 1, 128, generator=g), torch.randn(2, 2, 1, 128, generator=g)
    a.append(*step)
    torch.ops.kvcc.append(b.state, b.handle, *step)
    assert b.state.tolist() == [151, 151]
    q = torch.randn(2, 8, 128, generator=g)
    out_a, lse_a = a.attend(q)
    out_b, lse_b = torch.ops.kvcc.attend(b.state, b.handle, q)
    assert torch.equal(out_a, out_b) and torch.equal(lse_a, lse_b)


def test_fake_implementations_give_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    cache = make_cache()
    with FakeTensorMode():
        q = torch.empty(2, 8, 128)
        out, lse = torch.ops.kvcc.attend(torch.empty(2, dtype=torch.int64), cache.handle, q)
        assert out.shape == (2, 8, 128) and lse.shape == (2, 8) and lse.dtype == torch.float32


class Decoder(torch.nn.Module):
    """A decode step: project, append the new key and value, attend, project."""

    def __init__(self, cache, d=128):
        super().__init__()
        self.cache = cache
        self.qkv = torch.nn.Linear(d, 3 * d, bias=False)
        self.out = torch.nn.Linear(d, d, bias=False)

    def forward(self, x):  # x [batch, d]
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        torch.ops.kvcc.append(self.cache.state, self.cache.handle, k[:, None, None], v[:, None, None])
        o, lse = torch.ops.kvcc.attend(self.cache.state, self.cache.handle, q[:, None])
        return self.out(o[:, 0]), lse


def test_torch_compile_traces_the_ops_fullgraph():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    eager_cache, compiled_cache = make_cache(kv_heads=1), make_cache(kv_heads=1)
    prompt = torch.randn(2, 1, 100, 128, generator=g), torch.randn(2, 1, 100, 128, generator=g)
    eager_cache.prefill(*prompt)
    compiled_cache.prefill(*prompt)
    eager = Decoder(eager_cache)
    compiled_module = Decoder(compiled_cache)
    compiled_module.load_state_dict(eager.state_dict())
    torch._dynamo.reset()
    compiled = torch.compile(compiled_module, backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(2, 128, generator=g)
            ye, le = eager(x)
            yc, lc = compiled(x)
            torch.testing.assert_close(yc, ye)
            torch.testing.assert_close(lc, le)
    # Every step appended once: the mutation was neither dropped nor repeated.
    assert compiled_cache.lengths() == [103, 103] == eager_cache.lengths()
    assert compiled_cache.state.tolist() == [103, 103]
