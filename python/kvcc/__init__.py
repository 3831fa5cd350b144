"""kvcc: compressed-domain attention on torch tensors.

`Format.load(path_or_bundled_name)` compiles a KV code format;
`fmt.train(k, v)` fits its tables; `LiveCache(fmt, batch, kv_heads, capacity,
device=...)` is the runtime's live cache (`prefill`, `append`, `attend`);
`kvcc.ops` registers the same calls as `torch.library` custom ops; `kvcc.hf`
integrates with transformers; `kvcc.vllm` holds the glue of a vLLM attention
backend.
"""

from ._kvcc import CapacityError, KvccError, SpecError
from .core import Format, LiveCache, Pages, Tables
from . import ops  # registers the torch.library ops

__all__ = [
    "CapacityError",
    "Format",
    "KvccError",
    "LiveCache",
    "Pages",
    "SpecError",
    "Tables",
    "ops",
]
