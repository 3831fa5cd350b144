"""transformers integration: the `kvcc` attention implementation and
`KvccCache`, a `Cache` whose every layer is a kvcc `LiveCache`.

    import kvcc.hf
    kvcc.hf.register()                                   # AttentionInterface "kvcc"
    model = AutoModelForCausalLM.from_pretrained(..., attn_implementation="kvcc")
    model.config.kvcc = {"spec": "kivi", "tier": "int4", "window": 64}   # or KvccCache(spec=...)
    cache = kvcc.hf.KvccCache(model.config)
    out = model.generate(ids, cache=cache, ...)   # past_key_values=cache before transformers 5

The prompt is attended exactly (SDPA over its own keys and values) while the
cache compresses it; every later token attends through the live cache: the
exact sinks and window, the compressed pages. Several new tokens in one step
are appended and attended one at a time, so the step stays causal. Padded
batches are not supported (every sequence of a batch has the prompt's
length); a padded attention mask in a decode step raises.
"""

from __future__ import annotations

import math
import threading
import weakref
from typing import Optional

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from ._kvcc import KvccError
from .core import Format, LiveCache, Pages

# Keys a KvccLayer handed to the model in this step, by id: the attention
# function finds its layer from them (it is not passed the cache).
_PENDING = threading.local()


def _pending() -> dict:
    if not hasattr(_PENDING, "by_key"):
        _PENDING.by_key = {}
    return _PENDING.by_key


def cache_argument(model) -> str:
    """The name `forward` and `generate` take the cache under: `cache` in
    recent transformers, `past_key_values` before."""
    import inspect

    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def config_options(config) -> dict:
    """The kvcc options of a model config: `config.kvcc` (a dict with `spec`
    and any of `tier`, `sinks`, `window`, `exact`, `capacity`, `executor`)."""
    options = getattr(config, "kvcc", None) or {}
    if not isinstance(options, dict):
        raise KvccError("config.kvcc must be a dict such as {'spec': 'kivi', 'tier': 'int4'}")
    return dict(options)


class KvccLayer(CacheLayerMixin):
    """One layer's live cache. The first update (the prompt) trains the tables
    on the prompt and prefills; later updates are handed to the `kvcc`
    attention function, which appends and attends."""

    is_compileable = False
    is_sliding = False
    is_croppable = False

    def __init__(
        self,
        fmt: Format,
        capacity: int,
        policy: dict,
        executor: str = "jit",
        q_heads: Optional[int] = None,
        check_finite: bool = True,
    ):
        super().__init__()
        self.format = fmt
        self.capacity = capacity
        self.policy = policy
        self.executor = executor
        self.q_heads = q_heads
        self.check_finite = check_finite
        self.live: Optional[LiveCache] = None
        self.tokens = 0

    def lazy_initialization(self, key_states, value_states) -> None:
        batch, kv_heads = key_states.shape[:2]
        self.dtype, self.device = key_states.dtype, key_states.device
        self.live = LiveCache(
            self.format,
            batch,
            kv_heads,
            self.capacity,
            device=key_states.device,
            executor=self.executor,
            q_heads=self.q_heads,
            check_finite=self.check_finite,
            **self.policy,
        )
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            self.live.prefill(key_states, value_states)
            self.tokens += key_states.shape[-2]
            return key_states, value_states
        pending = _pending()
        if any(layer is self for layer, _, _ in pending.values()):
            pending.clear()
            raise KvccError(
                "the last step's new keys of this layer did not reach the kvcc attention: "
                'a KvccCache needs the model loaded with attn_implementation="kvcc"'
            )
        self.tokens += key_states.shape[-2]
        pending[id(key_states)] = (self, key_states, value_states)
        return key_states, value_states

    def get_mask_sizes(self, query_length: int):
        return self.tokens + query_length, 0

    def get_seq_length(self) -> int:
        return self.tokens

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.live, self.tokens, self.is_initialized = None, 0, False

    def reorder_cache(self, beam_idx) -> None:
        raise NotImplementedError("KvccCache does not reorder sequences (beam search)")


class KvccCache(Cache):
    """A transformers `Cache` of kvcc live caches, one per layer. The spec and
    policy come from the arguments or else `config.kvcc`; `capacity` is the
    page slots of every tier per layer (default: enough for `max_tokens`
    tokens of `batch` sequences). On CUDA, `check_finite=False` skips the
    NaN/Inf scan of every step's keys, values and queries (each scan waits for
    the GPU)."""

    def __init__(
        self,
        config=None,
        *,
        spec=None,
        tier=None,
        sinks=None,
        window=None,
        exact=None,
        capacity: Optional[int] = None,
        batch: int = 1,
        max_tokens: int = 32768,
        executor: Optional[str] = None,
        check_finite: bool = True,
    ):
        options = config_options(config) if config is not None else {}
        spec = spec if spec is not None else options.get("spec", "dense_f16")
        fmt = spec if isinstance(spec, Format) else Format.load(spec)
        policy = {
            "tier": tier if tier is not None else options.get("tier"),
            "sinks": sinks if sinks is not None else options.get("sinks"),
            "window": window if window is not None else options.get("window"),
            "exact": exact if exact is not None else options.get("exact"),
        }
        kv_heads, q_heads = 1, None
        if config is not None:
            kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
            q_heads = config.num_attention_heads
        if capacity is None:
            capacity = options.get("capacity") or (
                batch * kv_heads * math.ceil(max_tokens / fmt.items_per_page(policy["tier"]))
            )
        executor = executor or options.get("executor", "jit")
        self.format = fmt

        def layer():
            return KvccLayer(fmt, capacity, policy, executor, q_heads, check_finite)

        super().__init__(layer_class_to_replicate=layer)


# The last attention mask found free of padding, with what it was checked
# for: every layer of a forward pass gets the same mask, and on CUDA each
# check waits for the GPU, so a pass checks it once rather than per layer.
_CHECKED = threading.local()


def _hides_cached(mask: torch.Tensor, queries: int, tokens: int) -> bool:
    """Whether `mask` hides from one of the last `queries` queries a cached
    token or the first new one (a causal mask over the new tokens hides
    neither; padding does)."""
    seen = mask[..., -queries:, : tokens - queries + 1]
    if seen.dtype != torch.bool:
        seen = seen > torch.finfo(seen.dtype).min / 2
    return not bool(seen.all())


def _check_no_padding(mask: torch.Tensor, queries: int, tokens: int) -> None:
    try:
        version = mask._version  # bumped by in-place changes
    except RuntimeError:  # inference tensors keep no version counter
        version = None
    key = (queries, tokens, version)
    last = getattr(_CHECKED, "last", None)
    if last is not None and last[0]() is mask and last[1] == key:
        return
    if _hides_cached(mask, queries, tokens):
        raise KvccError(
            "KvccCache does not support padded batches (an attention mask hides cached tokens)"
        )
    _CHECKED.last = (weakref.ref(mask), key)


def kvcc_attention(
    module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    **kwargs,
):
    """The `kvcc` attention implementation: decode steps of a `KvccCache`
    attend through its live cache; anything else (the prompt, a model run
    without a cache) is SDPA."""
    entry = _pending().pop(id(key), None)
    if entry is None or entry[1] is not key:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    layer, _, _ = entry
    d = query.shape[-1]
    if attention_mask is not None:
        _check_no_padding(attention_mask, query.shape[-2], layer.tokens)
    if scaling is not None and abs(scaling * math.sqrt(d) - 1.0) > 1e-6:
        query = query * (scaling * math.sqrt(d))
    outputs = []
    for t in range(query.shape[-2]):
        layer.live.append(key[:, :, t : t + 1], value[:, :, t : t + 1])
        out, _ = layer.live.attend(query[:, :, t])
        outputs.append(out)
    out = torch.stack(outputs, dim=2)  # [batch, q_heads, tokens, head_dim]
    return out.transpose(1, 2).contiguous(), None


# The one-shot "every token on the codes" attention of fidelity measurements.
class CodesContext:
    """What `codes_attention` reads: per layer the tables, the tier, and the
    real length of every sequence of the batch being run."""

    def __init__(self):
        self.format: Optional[Format] = None
        self.tier = None
        self.tables = {}
        self.lengths = None
        self.capture = None  # layer_idx -> list of (k, v) per sequence, to train on


CODES = CodesContext()


def codes_attention(
    module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    **kwargs,
):
    """Bidirectional attention whose keys and values are every token's codes:
    each sequence's tokens compressed into `CODES.tier` (partial pages
    included, no exact rows) and every query attending them through the JIT.
    With `CODES.capture` set, records keys and values and runs SDPA instead."""
    layer = module.layer_idx
    lengths = CODES.lengths or [key.shape[-2]] * key.shape[0]
    if CODES.capture is not None:
        CODES.capture.setdefault(layer, []).extend(
            (key[i, :, :n].detach().clone(), value[i, :, :n].detach().clone())
            for i, n in enumerate(lengths)
        )
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    batch, heads, tokens, d = query.shape
    if scaling is not None and abs(scaling * math.sqrt(d) - 1.0) > 1e-6:
        query = query * (scaling * math.sqrt(d))
    pages = Pages(CODES.format, CODES.tables[layer], CODES.tier)
    for i, n in enumerate(lengths):
        pages.add(key[i, :, :n], value[i, :, :n])
    # Every token's query of a head is one query head of that head's group.
    q = query.reshape(batch, heads * tokens, d)
    out, _ = pages.attend(q)
    return out.view(batch, heads, tokens, d).transpose(1, 2).contiguous(), None


def register() -> None:
    """Registers `kvcc` (live cache decode) and `kvcc_codes` (every token on
    the codes) with transformers' `AttentionInterface`."""
    AttentionInterface.register("kvcc", kvcc_attention)
    AttentionInterface.register("kvcc_codes", codes_attention)
    # Both take SDPA's masks (boolean, None where nothing is masked): without a
    # registered mask function transformers passes no mask, padding included.
    try:
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    except ImportError:  # older transformers build SDPA's mask for any name
        return
    AttentionMaskInterface.register("kvcc", sdpa_mask)
    AttentionMaskInterface.register("kvcc_codes", sdpa_mask)


register()
