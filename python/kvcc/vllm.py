"""Glue between vLLM's paged KV cache and kvcc's live cache (docs/vllm.md).

vLLM hands an attention backend a flat batch — tokens of every request back
to back (`query_start_loc`), each request's context length (`seq_lens`), its
physical blocks (`block_table`) and each new token's cache slot
(`slot_mapping`, `block * block_size + offset`, -1 for padding). kvcc keeps,
per (sequence, kv head), exact sink and recent rows and a page table of
compressed pages. This module translates between the two; it needs neither
vLLM nor a GPU, so every piece is tested on the CPU (python/tests/test_vllm.py).

The layout it assumes (the design note's): a vLLM block is one kvcc page
per kv head (`block_size == items_per_page`); page `block * kv_heads + head`
of the tier's pool belongs to block `block`; sinks are rounded up to whole
blocks, so block boundaries are page boundaries.

`register()` is the `vllm.general_plugins` entry point: with vLLM installed
it registers `AttentionBackendEnum.CUSTOM` as kvcc's backend class path.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from . import _kvcc
from ._kvcc import KvccError
from .core import Format, LiveCache

BACKEND_CLASS = "kvcc.vllm_backend.KvccAttentionBackend"


@dataclass(frozen=True)
class BlockLayout:
    """How one layer's vLLM blocks hold kvcc pages."""

    format: Format
    tier: int
    block_size: int
    kv_heads: int
    sinks: int
    window: int

    @staticmethod
    def of(fmt, block_size: int, kv_heads: int, tier=None, sinks=None, window=None) -> "BlockLayout":
        fmt = fmt if isinstance(fmt, Format) else Format.load(fmt)
        tier = fmt.tier_index(tier)
        items = fmt.items_per_page(tier)
        if block_size != items:
            raise KvccError(
                f"vLLM block size {block_size} differs from the pages of tier "
                f"`{fmt.tiers[tier]}` ({items} tokens); set --block-size {items} "
                f"or the spec's [page] items to {block_size}"
            )
        policy = fmt.policy()
        sinks = policy["sinks"] if sinks is None else sinks
        window = policy["window"] if window is None else window
        # Whole blocks of sinks: block boundaries stay page boundaries.
        sinks = math.ceil(sinks / block_size) * block_size
        return BlockLayout(fmt, tier, block_size, kv_heads, sinks, window)

    @property
    def page_bytes(self) -> int:
        return self.format.page_bytes(self.tier)

    def kv_cache_shape(self, num_blocks: int) -> Tuple[int, int, int]:
        """`get_kv_cache_shape`: uint8 `[num_blocks, kv_heads, page_bytes]`."""
        return (num_blocks, self.kv_heads, self.page_bytes)

    def split(self, tokens: int) -> Tuple[int, int, int]:
        """Blocks of a `tokens`-token sequence: `(exact head blocks,
        compressed blocks, exact tail blocks)`, from the runtime's split."""
        sinks, pages, tail = _kvcc.policy_split(self.sinks, self.window, tokens, self.block_size)
        return (
            math.ceil(sinks / self.block_size),
            pages,
            math.ceil(tail / self.block_size),
        )


def requests(query_start_loc: Sequence[int], seq_lens: Sequence[int]) -> List[Tuple[int, int, int]]:
    """Per request of a flat batch: `(first token, new tokens, context before)`."""
    q = [int(x) for x in query_start_loc]
    if len(q) != len(seq_lens) + 1:
        raise KvccError(f"query_start_loc has {len(q)} entries for {len(seq_lens)} requests")
    out = []
    for r, seq_len in enumerate(seq_lens):
        new = q[r + 1] - q[r]
        if new < 0 or new > int(seq_len):
            raise KvccError(f"request {r}: {new} new tokens but a context of {int(seq_len)}")
        out.append((q[r], new, int(seq_len) - new))
    return out


def slot_positions(
    slot_mapping: torch.Tensor, block_table: torch.Tensor, query_start_loc, seq_lens, block_size: int
) -> List[List[Tuple[int, int]]]:
    """Per request, each new token's `(physical block, offset)` from its slot,
    checked against the block table at the token's position (padding slots,
    -1, must not occur inside a request)."""
    out = []
    slots = slot_mapping.tolist()
    for r, (first, new, before) in enumerate(requests(query_start_loc, seq_lens)):
        row = []
        for i in range(new):
            slot = slots[first + i]
            position = before + i
            block, offset = divmod(slot, block_size)
            expected = int(block_table[r, position // block_size])
            if slot < 0 or block != expected or offset != position % block_size:
                raise KvccError(
                    f"request {r}, token {position}: slot {slot} is not block {expected} "
                    f"offset {position % block_size}"
                )
            row.append((block, offset))
        out.append(row)
    return out


@dataclass
class PageTables:
    """One request's view in kvcc terms: per kv head the pool pages of its
    compressed blocks (in token order), and the physical blocks whose rows
    are exact (head sinks, then the tail)."""

    pages: List[List[int]]
    exact_head: List[int]
    exact_tail: List[int]


def page_tables(block_table: torch.Tensor, seq_lens: Sequence[int], layout: BlockLayout) -> List[PageTables]:
    """vLLM's block table -> kvcc page tables, per request."""
    out = []
    for r, seq_len in enumerate(seq_lens):
        head, pages, tail = layout.split(int(seq_len))
        row = [int(b) for b in block_table[r, : head + pages + tail].tolist()]
        compressed = row[head : head + pages]
        out.append(
            PageTables(
                pages=[[b * layout.kv_heads + h for b in compressed] for h in range(layout.kv_heads)],
                exact_head=row[:head],
                exact_tail=row[head + pages :],
            )
        )
    return out


def newly_compressed(before: int, after: int, layout: BlockLayout) -> range:
    """Logical blocks that leave the window while a sequence grows from
    `before` to `after` tokens: what `do_kv_cache_update` encodes this step."""
    head, was, _ = layout.split(before)
    _, now, _ = layout.split(after)
    return range(head + was, head + now)


class ReferenceBackend:
    """The backend's forward on the CPU: vLLM's flat batch in, attention out,
    through one kvcc `LiveCache` per request. What a GPU backend computes,
    in a form the tests can compare with exact attention; requests are named
    by the caller (vLLM's impl would key them by their first block)."""

    def __init__(self, layout: BlockLayout, capacity: int, tables=None):
        self.layout = layout
        self.capacity = capacity
        self.tables = tables
        self.caches: Dict[object, LiveCache] = {}

    def forward(
        self,
        request_ids: Sequence[object],
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        query_start_loc,
        seq_lens,
    ) -> torch.Tensor:
        """`query` `[tokens, q_heads, head_dim]`, `key`/`value` `[tokens,
        kv_heads, head_dim]` (vLLM's layout); returns `[tokens, q_heads,
        head_dim]`. A request's first call is its prompt (prefilled, then
        attended causally token by token); later calls append and attend."""
        out = torch.empty_like(query)
        for rid, (first, new, before) in zip(request_ids, requests(query_start_loc, seq_lens)):
            k = key[first : first + new].transpose(0, 1)  # [kv_heads, new, d]
            v = value[first : first + new].transpose(0, 1)
            cache = self.caches.get(rid)
            if cache is None:
                if before != 0:
                    raise KvccError(f"request {rid!r} is new but has {before} tokens of context")
                # Tables fitted to this prompt unless the backend was given some.
                tables = self.tables if self.tables is not None else self.layout.format.train(k, v)
                cache = LiveCache(
                    self.layout.format, 1, self.layout.kv_heads, self.capacity,
                    tables=tables, tier=self.layout.tier,
                    sinks=self.layout.sinks, window=self.layout.window,
                )
                self.caches[rid] = cache
                # Causal prompt: token by token through the cache.
                cache.prefill(k[:, :1][None], v[:, :1][None])
                out[first] = cache.attend(query[first][None])[0][0]
                start = 1
            else:
                if cache.lengths()[0] != before:
                    raise KvccError(
                        f"request {rid!r}: the cache holds {cache.lengths()[0]} tokens, vLLM {before}"
                    )
                start = 0
            for i in range(start, new):
                cache.append(k[:, i : i + 1][None], v[:, i : i + 1][None])
                out[first + i] = cache.attend(query[first + i][None])[0][0]
        return out

    def free(self, request_id) -> None:
        self.caches.pop(request_id, None)


def register() -> None:
    """The `vllm.general_plugins` entry point: makes `--attention-backend
    CUSTOM` select kvcc's backend. Without vLLM it does nothing."""
    try:
        from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
    except ImportError:
        return
    register_backend(AttentionBackendEnum.CUSTOM, BACKEND_CLASS)


def backend_options(additional_config: Optional[dict]) -> dict:
    """kvcc's options from vLLM's `--additional-config '{"kvcc": {...}}'`:
    `spec` (bundled name or path), `tier`, `sinks`, `window`."""
    options = dict((additional_config or {}).get("kvcc", {}))
    unknown = set(options) - {"spec", "tier", "sinks", "window"}
    if unknown:
        raise KvccError(f"unknown kvcc options {sorted(unknown)}; known: spec, tier, sinks, window")
    options.setdefault("spec", "kivi")
    return options
