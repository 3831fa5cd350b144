"""The live cache as `torch.library` custom ops, with fake implementations so
`torch.compile` traces models that call them.

A cache is named by its integer `handle` (ops take no Python objects) and
its `state` tensor (`LiveCache.state`, the lengths of its sequences): `prefill`
and `append` mutate `state`, `attend` reads it, so the traced graph keeps
them in program order.

    torch.ops.kvcc.prefill(cache.state, cache.handle, k, v)
    torch.ops.kvcc.append(cache.state, cache.handle, k, v)
    out, lse = torch.ops.kvcc.attend(cache.state, cache.handle, q)
"""

from __future__ import annotations

from typing import Tuple

import torch

from .core import live_cache


@torch.library.custom_op("kvcc::prefill", mutates_args=("state",))
def prefill(state: torch.Tensor, handle: int, k: torch.Tensor, v: torch.Tensor) -> None:
    """Adds `[batch, kv_heads, tokens, head_dim]` prompts to cache `handle`."""
    cache = live_cache(handle)
    cache.prefill(k, v)
    state.copy_(cache.state)


@prefill.register_fake
def _(state, handle, k, v) -> None:
    return None


@torch.library.custom_op("kvcc::append", mutates_args=("state",))
def append(state: torch.Tensor, handle: int, k: torch.Tensor, v: torch.Tensor) -> None:
    """Adds `[batch, kv_heads, tokens, head_dim]` tokens to every sequence."""
    cache = live_cache(handle)
    cache.append(k, v)
    state.copy_(cache.state)


@append.register_fake
def _(state, handle, k, v) -> None:
    return None


@torch.library.custom_op("kvcc::attend", mutates_args=())
def attend(state: torch.Tensor, handle: int, q: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """One decode step: `(out, lse)` for queries `[batch, q_heads, head_dim]`."""
    return live_cache(handle).attend(q)


@attend.register_fake
def _(state, handle, q):
    return torch.empty_like(q), q.new_empty(q.shape[:2], dtype=torch.float32)
