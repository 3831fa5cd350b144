"""transformers integration: the `kvcc` attention implementation and
`KvccCache`, a `Cache` whose every layer is a kvcc `LiveCache`.

    import kvcc.hf
    kvcc.hf.register()                                   # AttentionInterface "kvcc", "kvcc_codes"
    model = AutoModelForCausalLM.from_pretrained(..., attn_implementation="kvcc")
    options = kvcc.hf.KvccOptions(spec="kivi", tier="int4", window=64)
    cache = kvcc.hf.KvccCache(model.config, options, max_tokens=4096)
    out = model.generate(ids, cache=cache, ...)   # past_key_values=cache before transformers 5

The prompt is attended exactly (SDPA over its own keys and values) while the
cache compresses it; every later token attends through the live cache: the
exact sinks and window, the compressed pages. Several new tokens in one step
are appended and attended one at a time, so the step stays causal. Padded
batches are not supported (every sequence of a batch has the prompt's
length); a padded attention mask in a decode step raises.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
import weakref
from typing import Optional, Sequence, Union

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from ._kvcc import KvccError
from .core import Format, LiveCache, Pages, Tables

# The attribute of a decode step's key tensor that names its cache: the
# attention function is passed the keys and the module, not the cache.
_STEP_CACHE = "_kvcc_cache"

# Where `capture_queries` collects each layer's last query rows.
_QUERY_CAPTURE = contextvars.ContextVar("kvcc_query_capture", default=None)


@contextlib.contextmanager
def capture_queries(rows: int):
    """Within it, every `kvcc` attention call records its layer's last
    `rows` query rows (scaled for a plain `1/sqrt(head_dim)`) in the yielded
    dict, `layer_idx -> [batch, q_heads, rows, head_dim]`: what a
    `[cache.budget]` prefill weighs states by, passed to `KvccCache.update`
    as `cache_kwargs={"kvcc_queries": ...}`."""
    captured = {}
    token = _QUERY_CAPTURE.set((rows, captured))
    try:
        yield captured
    finally:
        _QUERY_CAPTURE.reset(token)


def cache_argument(model) -> str:
    """The name `forward` and `generate` take the cache under: `cache` in
    recent transformers, `past_key_values` before."""
    import inspect

    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


@dataclasses.dataclass(frozen=True)
class KvccOptions:
    """How a `KvccCache` stores every layer: the spec (a bundled name, a path
    or a `Format`), the tier whole pages are compressed into, and the exact
    sinks, window and exact dtype. `None` keeps the spec's `[cache]` value.
    `capacity` is the page slots of every tier per layer (default: enough for
    the cache's `max_tokens` of each of its sequences); `executor` runs CPU
    caches (`"jit"` or `"interp"`); `check_finite=False` skips the NaN/Inf
    scan of every CUDA step's inputs (each scan waits for the GPU). A spec's
    `[cache.select]` applies from layer `select_from_layer` on; earlier layers
    read every page (Quest keeps the first two dense)."""

    spec: Union[str, Format] = "dense_f16"
    tier: Union[int, str, None] = None
    sinks: Optional[int] = None
    window: Optional[int] = None
    exact: Optional[str] = None
    capacity: Optional[int] = None
    executor: str = "jit"
    check_finite: bool = True
    select_from_layer: int = 0

    def format(self) -> Format:
        return self.spec if isinstance(self.spec, Format) else Format.load(self.spec)

    def policy(self) -> dict:
        """The `LiveCache` keyword arguments of these options."""
        return {"tier": self.tier, "sinks": self.sinks, "window": self.window, "exact": self.exact}


class KvccLayer(CacheLayerMixin):
    """One layer's live cache. The first update (the prompt) trains the tables
    on the prompt unless given, and prefills; each later update is a decode
    step, which the `kvcc` attention function appends and attends."""

    is_compileable = False
    is_sliding = False
    is_croppable = False

    def __init__(
        self,
        options: KvccOptions,
        fmt: Format,
        capacity: int,
        q_heads: Optional[int],
        tables: Optional[Tables],
    ):
        super().__init__()
        self.options = options
        self.format = fmt
        self.capacity = capacity
        self.q_heads = q_heads
        self.tables = tables
        self.live: Optional[LiveCache] = None
        self.tokens = 0
        # The keys of the decode step the attention function has not taken yet.
        self.step: Optional[torch.Tensor] = None
        # A `[cache.budget]` weighs the prompt's states by its last queries:
        # the prompt waits here for the attention function to bring them.
        self.budget = fmt.budget()
        self.prompt: Optional[tuple] = None

    def lazy_initialization(self, key_states, value_states) -> None:
        batch, kv_heads = key_states.shape[:2]
        self.dtype, self.device = key_states.dtype, key_states.device
        self.live = LiveCache(
            self.format,
            batch,
            kv_heads,
            self.capacity,
            device=key_states.device,
            tables=self.tables,
            executor=self.options.executor,
            q_heads=self.q_heads,
            check_finite=self.options.check_finite,
            **self.options.policy(),
        )
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.prompt is not None:
            self.prompt = None
            raise KvccError(
                "the prompt's queries did not reach the kvcc attention: a KvccCache with a "
                '[cache.budget] needs the model loaded with attn_implementation="kvcc" (or '
                'cache_kwargs={"kvcc_queries": ...} with the prompt)'
            )
        if self.tokens == 0:
            cache_kwargs = (args[0] if args else kwargs.get("cache_kwargs")) or {}
            queries = cache_kwargs.get("kvcc_queries")
            if self.budget is not None and queries is None:
                self.prompt = (key_states, value_states)
            else:
                self.live.prefill(key_states, value_states, queries)
            self.tokens += key_states.shape[-2]
            return key_states, value_states
        if self.step is not None:
            self.step = None
            raise KvccError(
                "the last step's new keys of this layer did not reach the kvcc attention: "
                'a KvccCache needs the model loaded with attn_implementation="kvcc" '
                "(after kvcc.hf.register())"
            )
        self.tokens += key_states.shape[-2]
        self.step = key_states
        return key_states, value_states

    def take_prompt(self, queries: torch.Tensor) -> None:
        """Prefills the waiting prompt, its states weighed by `queries`
        (`[batch, q_heads, tokens, head_dim]`, unit-scaled; the last
        `observe` rows are used)."""
        keys, values = self.prompt
        self.prompt = None
        rows = min(self.budget["observe"], queries.shape[-2])
        self.live.prefill(keys, values, queries[..., -rows:, :].contiguous())

    def take_step(self, key: torch.Tensor) -> None:
        """Marks the step's keys `key` as handed to the attention."""
        if self.step is not key:
            raise KvccError(
                "the kvcc attention was given keys its layer's cache did not return "
                "(a module's layer_idx must be its cache layer)"
            )
        self.step = None

    def get_mask_sizes(self, query_length: int):
        return self.tokens + query_length, 0

    def get_seq_length(self) -> int:
        return self.tokens

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        """Drops every sequence; the live cache, its tables and its kernels
        stay for the next prompt (of at most as many sequences)."""
        if self.live is not None:
            for _ in self.live.lengths():
                self.live.release(0)
        self.tokens, self.step, self.prompt = 0, None, None

    def reorder_cache(self, beam_idx) -> None:
        raise NotImplementedError("KvccCache does not reorder sequences (beam search)")


def sliding_layers(config) -> list:
    """Which layers of `config`'s model attend over a sliding window (Gemma's
    local layers): they keep transformers' own window of exact rows."""
    types = getattr(config, "layer_types", None) or []
    return [t == "sliding_attention" for t in types] or [False] * config.num_hidden_layers


class KvccCache(Cache):
    """A transformers `Cache` of kvcc live caches, one per full-attention
    layer of the model whose `config` it is given, stored as `options` say;
    sliding-window layers keep transformers' exact window. `tables` holds
    every kvcc layer's trained tables (`Format.train` on that layer's keys
    and values; `None` for sliding layers); without them each layer trains
    its own on the prompt. `batch` and `max_tokens` size the default
    capacity."""

    def __init__(
        self,
        config,
        options: Optional[KvccOptions] = None,
        *,
        tables: Optional[Sequence[Tables]] = None,
        batch: int = 1,
        max_tokens: int = 32768,
    ):
        options = options if options is not None else KvccOptions()
        if not isinstance(options, KvccOptions):
            raise KvccError(f"options must be a kvcc.hf.KvccOptions, not {type(options).__name__}")
        fmt = options.format()
        layers = config.num_hidden_layers
        if tables is not None and len(tables) != layers:
            raise KvccError(f"tables for {len(tables)} layers given for a model of {layers}")
        q_heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or q_heads
        capacity = options.capacity or (
            batch * kv_heads * math.ceil(max_tokens / fmt.items_per_page(options.tier))
        )
        self.options, self.format, self.max_tokens = options, fmt, max_tokens
        # The last attention mask found free of padding, with what it was
        # checked for: every layer of a pass gets the same mask, and on CUDA
        # each check waits for the GPU, so a pass checks it once.
        self.checked_mask = None
        self.sliding = sliding_layers(config)
        self.sliding_window = getattr(config, "sliding_window", None)

        every_page = fmt.without_select() if options.select_from_layer > 0 else fmt

        def layer(i):
            if self.sliding[i]:
                return self._window_layer()
            own = every_page if i < options.select_from_layer else fmt
            return KvccLayer(options, own, capacity, q_heads, tables[i] if tables else None)

        super().__init__(layers=[layer(i) for i in range(layers)])

    def _window_layer(self):
        from transformers.cache_utils import DynamicSlidingWindowLayer

        return DynamicSlidingWindowLayer(sliding_window=self.sliding_window)

    @property
    def kvcc_layers(self) -> list:
        """The layers whose keys and values are in kvcc live caches."""
        return [layer for layer in self.layers if isinstance(layer, KvccLayer)]

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        keys, values = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        layer = self.layers[layer_idx]
        prompt = getattr(layer, "prompt", None)
        if getattr(layer, "step", None) is keys or (prompt is not None and prompt[0] is keys):
            setattr(keys, _STEP_CACHE, self)
        return keys, values

    def reset(self) -> None:
        """Drops every sequence: kvcc layers keep their live caches, tables
        and kernels; sliding-window layers start empty."""
        for i, layer in enumerate(self.layers):
            if isinstance(layer, KvccLayer):
                layer.reset()
            else:
                self.layers[i] = self._window_layer()


def _hides_cached(mask: torch.Tensor, queries: int, tokens: int) -> bool:
    """Whether `mask` hides from one of the last `queries` queries a cached
    token or the first new one (a causal mask over the new tokens hides
    neither; padding does)."""
    seen = mask[..., -queries:, : tokens - queries + 1]
    if seen.dtype != torch.bool:
        seen = seen > torch.finfo(seen.dtype).min / 2
    return not bool(seen.all())


def _check_no_padding(cache: KvccCache, mask: torch.Tensor, queries: int, tokens: int) -> None:
    try:
        version = mask._version  # bumped by in-place changes
    except RuntimeError:  # inference tensors keep no version counter
        version = None
    key = (queries, tokens, version)
    last = cache.checked_mask
    if last is not None and last[0]() is mask and last[1] == key:
        return
    if _hides_cached(mask, queries, tokens):
        raise KvccError(
            "KvccCache does not support padded batches (an attention mask hides cached tokens)"
        )
    cache.checked_mask = (weakref.ref(mask), key)


def _unit_scaled(query: torch.Tensor, scaling: Optional[float]) -> torch.Tensor:
    """Queries whose plain 1/sqrt(d) scaling (the kernels') gives `scaling`."""
    d = query.shape[-1]
    if scaling is not None and abs(scaling * math.sqrt(d) - 1.0) > 1e-6:
        return query * (scaling * math.sqrt(d))
    return query


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
    attend through the live cache of layer `module.layer_idx`; anything else
    (the prompt, another cache, no cache) is SDPA."""
    capture = _QUERY_CAPTURE.get()
    if capture is not None:
        rows, captured = capture
        captured[module.layer_idx] = _unit_scaled(query[..., -rows:, :], scaling).detach().clone()
    cache = getattr(key, _STEP_CACHE, None)
    if cache is not None and cache.layers[module.layer_idx].prompt is not None:
        delattr(key, _STEP_CACHE)
        cache.layers[module.layer_idx].take_prompt(_unit_scaled(query, scaling))
        cache = None
    if cache is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    layer = cache.layers[module.layer_idx]
    layer.take_step(key)
    delattr(key, _STEP_CACHE)
    if attention_mask is not None:
        _check_no_padding(cache, attention_mask, query.shape[-2], layer.tokens)
    query = _unit_scaled(query, scaling)
    outputs = []
    for t in range(query.shape[-2]):
        layer.live.append(key[:, :, t : t + 1], value[:, :, t : t + 1])
        out, _ = layer.live.attend(query[:, :, t])
        if layer.budget is not None:
            layer.live.observe(query[:, :, t])
        outputs.append(out)
    out = torch.stack(outputs, dim=2)  # [batch, q_heads, tokens, head_dim]
    return out.transpose(1, 2).contiguous(), None


@dataclasses.dataclass
class CodesContext:
    """What the `kvcc_codes` attention reads, passed to the model's forward as
    `kvcc_codes=`: per layer the tables, the tier, and the real length of
    every sequence of the batch. With `capture` set to a dict it records each
    layer's keys and values (to train on) and runs SDPA instead."""

    format: Optional[Format] = None
    tier: Union[int, str, None] = None
    tables: dict = dataclasses.field(default_factory=dict)
    lengths: Optional[list] = None
    capture: Optional[dict] = None  # layer_idx -> list of (k, v) per sequence


def codes_attention(
    module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    kvcc_codes: Optional[CodesContext] = None,
    **kwargs,
):
    """Bidirectional attention whose keys and values are every token's codes:
    each sequence's tokens compressed into `kvcc_codes.tier` (partial pages
    included, no exact rows) and every query attending them through the JIT."""
    codes = kvcc_codes
    if codes is None:
        raise KvccError(
            'the "kvcc_codes" attention needs its context: model(..., kvcc_codes=kvcc.hf.CodesContext(...))'
        )
    layer = module.layer_idx
    lengths = codes.lengths or [key.shape[-2]] * key.shape[0]
    if codes.capture is not None:
        codes.capture.setdefault(layer, []).extend(
            (key[i, :, :n].detach().clone(), value[i, :, :n].detach().clone())
            for i, n in enumerate(lengths)
        )
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    batch, heads, tokens, d = query.shape
    query = _unit_scaled(query, scaling)
    pages = Pages(codes.format, codes.tables[layer], codes.tier)
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
