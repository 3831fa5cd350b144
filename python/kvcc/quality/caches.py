"""What a measurement stores the model's keys and values in: the default
dense cache of transformers, or a `KvccCache` of one spec, tier and policy
with tables trained once per spec on a calibration text."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

import torch

from ..core import Format, Tables
from ..hf import KvccCache, KvccOptions, sliding_layers
from .models import QualityModel

# The policies every spec is measured under (sinks, window); "spec" is the
# spec's own `[cache]` table.
POLICIES = {"none": (0, 0), "spec": None, "s4w64": (4, 64)}


@dataclass
class CacheChoice:
    """One cache a measurement runs: `format` None is transformers' default
    dense cache; otherwise a kvcc cache of `format`'s `tier` with `sinks` and
    `window` exact tokens, reading `tables` (one per layer)."""

    label: str
    format: Optional[Format] = None
    tier: Optional[str] = None
    policy: str = "none"
    sinks: int = 0
    window: int = 0
    exact: str = "f16"
    tables: Optional[List[Tables]] = field(default=None, repr=False)
    check_finite: bool = False
    executor: str = "jit"
    select_from_layer: int = 0

    @staticmethod
    def dense() -> "CacheChoice":
        return CacheChoice(label="default")

    @staticmethod
    def kvcc(fmt: Format, tier: str, policy: str, tables, **kwargs) -> "CacheChoice":
        """`fmt`'s `tier` under a named policy of `POLICIES`."""
        spec_policy = fmt.policy()
        sinks, window = POLICIES[policy] or (spec_policy["sinks"], spec_policy["window"])
        dense_first = kwargs.get("select_from_layer", 0)
        shown = f"{policy}, select from layer {dense_first}" if dense_first else policy
        return CacheChoice(
            label=f"{fmt.name}:{tier}:{shown}",
            format=fmt,
            tier=tier,
            policy=shown,
            sinks=sinks,
            window=window,
            exact=spec_policy["exact"],
            tables=tables,
            **kwargs,
        )

    @property
    def tier_label(self) -> Optional[str]:
        """The tier, or `budget over a+b+c` where a `[cache.budget]` chooses."""
        if self.format is not None and self.format.budget():
            return "budget over " + "+".join(self.format.tiers)
        return self.tier

    @property
    def is_dense(self) -> bool:
        return self.format is None

    def bytes_per_token(self, qm: QualityModel, context: int) -> float:
        """Bytes per token per kv head per full-attention layer of a
        `context`-token sequence (exact rows of the model's dtype for the
        default cache; sliding-window layers hold a bounded exact window)."""
        if self.is_dense:
            element = torch.finfo(qm.model.dtype).bits // 8
            return 2 * qm.head_dim * element
        return self.format.bytes_per_token(
            self.tier, context, sinks=self.sinks, window=self.window, exact=self.exact
        )

    def open(self, qm: QualityModel, max_tokens: int, previous=None):
        """An empty cache for one sequence of at most `max_tokens` tokens: a
        kvcc cache `previous` opened by this choice for at least as many is
        emptied and reused (its live caches, tables and kernels stay)."""
        if previous is not None and not self.is_dense and previous.max_tokens >= max_tokens:
            previous.reset()
            return previous
        if self.is_dense:
            from transformers import DynamicCache

            return DynamicCache(config=qm.config)
        qm.check_format(self.format)
        options = KvccOptions(
            spec=self.format,
            tier=self.tier,
            sinks=self.sinks,
            window=self.window,
            exact=self.exact,
            executor=self.executor,
            check_finite=self.check_finite,
            select_from_layer=self.select_from_layer,
        )
        return KvccCache(qm.config, options, tables=self.tables, max_tokens=max_tokens)


def train_tables(qm: QualityModel, fmt: Format, kv: list, seed: int = 0) -> List[Optional[Tables]]:
    """`fmt`'s tables for every kvcc layer of `qm`, trained on that layer's
    keys and values (`[1, kv_heads, tokens, head_dim]` pairs, as
    `measure.Prefill` holds them); `None` for sliding-window layers."""
    return [
        None if sliding else fmt.train(k, v, seed=seed)
        for sliding, (k, v) in zip(sliding_layers(qm.config), kv)
    ]
