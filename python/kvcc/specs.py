"""Bundled specs re-stated at another head width.

The bundled specs are written for head_dim 128; a model whose heads are
another width gets each spec with every per-dimension quantity kept (bits per
element, group sizes, the kept fraction of bitmap groups) and every rank
scaled with the width (PCA rank 64 -> 32 at head_dim 64), so a tier's
compression against dense f16 stays what it is at 128, up to page headers and
tables.
"""

from __future__ import annotations

import re

from ._kvcc import KvccError
from .core import Format


def restate(source: str, head_dim: int) -> str:
    """A spec's TOML re-stated at `head_dim`: ranks and bitmap `keep` counts
    scale with it, group sizes and bits stay."""
    match = re.search(r"^head_dim\s*=\s*(\d+)", source, re.M)
    if match is None:
        raise KvccError("the spec states no head_dim to re-state")
    old = int(match.group(1))
    scale = lambda m: f"{m.group(1)}{max(1, int(m.group(2)) * head_dim // old)}"  # noqa: E731
    source = re.sub(r"^head_dim\s*=\s*\d+", f"head_dim = {head_dim}", source, flags=re.M)
    source = re.sub(r"(rank\s*=\s*)(\d+)", scale, source)
    source = re.sub(r"(keep\s*=\s*)(\d+)", scale, source)
    return source


def bundled_at(name: str, head_dim: int) -> Format:
    """The bundled spec `name` re-stated at `head_dim` (as it is at its own)."""
    sources = Format.bundled()
    if name not in sources:
        raise KvccError(f"no bundled spec `{name}` (bundled: {', '.join(sorted(sources))})")
    return Format.parse(restate(sources[name], head_dim), f"{name}.toml")
