"""The vLLM glue on the CPU: block layout, batch and slot translation, page
tables, blocks to encode, and a reference forward against exact attention."""

import math

import pytest
import torch

import kvcc
from kvcc import vllm as glue


def test_block_layout_checks_the_block_size_and_rounds_sinks():
    layout = glue.BlockLayout.of("shard", block_size=64, kv_heads=8)
    assert (layout.sinks, layout.window) == (64, 64)  # 4 sinks -> one whole block
    assert layout.kv_cache_shape(100) == (100, 8, kvcc.Format.load("shard").page_bytes())
    with pytest.raises(kvcc.KvccError, match="vLLM block size 16 differs from the pages of tier `pca64_vq` \\(64 tokens\\)"):
        glue.BlockLayout.of("shard", block_size=16, kv_heads=8)


@pytest.mark.parametrize("tokens", [0, 1, 63, 64, 65, 127, 128, 129, 200, 257, 1000])
def test_split_covers_every_token_with_whole_blocks(tokens):
    layout = glue.BlockLayout.of("shard", 64, 2)
    head, pages, tail = layout.split(tokens)
    assert (head + pages + tail) == math.ceil(tokens / 64)
    # The compressed blocks are whole and out of the window.
    assert pages * 64 <= max(0, tokens - 64 - layout.window)
    # The tail keeps at least the window (once there are that many tokens).
    assert tokens - min(tokens, (head + pages) * 64) >= min(layout.window, max(0, tokens - 64))


def test_requests_and_slot_positions():
    block_table = torch.tensor([[7, 3, 0], [5, 9, 0]])
    # Request 0: prompt of 70 tokens; request 1: decode token 65 (66 in context).
    qsl, seq_lens = [0, 70, 71], [70, 66]
    assert glue.requests(qsl, seq_lens) == [(0, 70, 0), (70, 1, 65)]
    slots = [7 * 64 + i for i in range(64)] + [3 * 64 + i for i in range(6)] + [9 * 64 + 1]
    pos = glue.slot_positions(torch.tensor(slots), block_table, qsl, seq_lens, 64)
    assert pos[0][63] == (7, 63) and pos[0][64] == (3, 0) and pos[1] == [(9, 1)]
    bad = slots.copy()
    bad[-1] = 5 * 64 + 1
    with pytest.raises(kvcc.KvccError, match="request 1, token 65: slot 321 is not block 9 offset 1"):
        glue.slot_positions(torch.tensor(bad), block_table, qsl, seq_lens, 64)


def test_page_tables_follow_the_block_table():
    layout = glue.BlockLayout.of("kivi", 64, kv_heads=2, window=64)
    block_table = torch.tensor([[4, 8, 15, 16, 23, 42]])
    (view,) = glue.page_tables(block_table, [64 * 5 + 10], layout)
    # 330 tokens, window 64: blocks 0..3 compressed, 4 and 5 exact.
    assert view.exact_head == [] and view.exact_tail == [23, 42]
    assert view.pages == [[8, 16, 30, 32], [9, 17, 31, 33]]


def test_newly_compressed_blocks():
    layout = glue.BlockLayout.of("kivi", 64, 1, window=64)
    assert list(glue.newly_compressed(191, 192, layout)) == [1]
    assert list(glue.newly_compressed(192, 193, layout)) == []
    assert list(glue.newly_compressed(0, 300, layout)) == [0, 1, 2]


def exact_causal(q, k, v, scale):
    """q [t, hq, d], k/v [t, hk, d] -> causal attention [t, hq, d]."""
    t, hq, d = q.shape
    group = hq // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    logits = torch.einsum("qhd,khd->hqk", q, k) * scale
    mask = torch.ones(t, t, dtype=torch.bool).tril()
    logits = logits.masked_fill(~mask, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(logits, -1), v)


def test_reference_forward_matches_exact_attention_over_steps():
    """Two requests, a prompt step then decode steps in vLLM's flat batch; the
    dense spec gives exact causal attention."""
    layout = glue.BlockLayout.of("dense_f16", 64, kv_heads=2, window=32)
    backend = glue.ReferenceBackend(layout, capacity=64)
    g = torch.Generator().manual_seed(0)
    lens = [150, 90]
    total = [lens[0] + 3, lens[1] + 3]
    q = [torch.randn(n, 4, 128, generator=g) for n in total]
    k = [torch.randn(n, 2, 128, generator=g) for n in total]
    v = [torch.randn(n, 2, 128, generator=g) for n in total]
    # Prompt step: both prompts back to back.
    out = backend.forward(
        ["a", "b"],
        torch.cat([q[0][:150], q[1][:90]]), torch.cat([k[0][:150], k[1][:90]]),
        torch.cat([v[0][:150], v[1][:90]]), [0, 150, 240], lens,
    )
    ref = [exact_causal(q[i], k[i], v[i], 128 ** -0.5) for i in range(2)]
    torch.testing.assert_close(out[:150], ref[0][:150], rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(out[150:], ref[1][:90], rtol=2e-3, atol=2e-3)
    for step in range(3):
        at = [lens[0] + step, lens[1] + step]
        out = backend.forward(
            ["a", "b"],
            torch.stack([q[0][at[0]], q[1][at[1]]]), torch.stack([k[0][at[0]], k[1][at[1]]]),
            torch.stack([v[0][at[0]], v[1][at[1]]]), [0, 1, 2], [at[0] + 1, at[1] + 1],
        )
        torch.testing.assert_close(out[0], ref[0][at[0]], rtol=2e-3, atol=2e-3)
        torch.testing.assert_close(out[1], ref[1][at[1]], rtol=2e-3, atol=2e-3)
    with pytest.raises(kvcc.KvccError, match="the cache holds 153 tokens, vLLM 160"):
        backend.forward(["a"], q[0][:1], k[0][:1], v[0][:1], [0, 1], [161])


def test_options_and_plugin_entry_point():
    assert glue.backend_options(None) == {"spec": "kivi"}
    assert glue.backend_options({"kvcc": {"spec": "shard", "window": 128}})["window"] == 128
    with pytest.raises(kvcc.KvccError, match="unknown kvcc options \\['block'\\]"):
        glue.backend_options({"kvcc": {"block": 1}})
    glue.register()  # without vLLM: nothing to register, no error
