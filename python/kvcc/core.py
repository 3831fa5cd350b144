"""Formats, trained tables, the live cache and the one-shot paged cache on
torch tensors.

Layouts follow transformers: keys and values `[batch, kv_heads, tokens,
head_dim]`, queries `[batch, q_heads, head_dim]` (or `[batch, q_heads, 1,
head_dim]`, one decode step). CPU tensors run the runtime's CPU live cache on
the Cranelift JIT; CUDA tensors run the generated kernels on torch's current
stream, reading and writing the tensors' device memory. The device is chosen
in one place of the native module (`python/src/device.rs`).
"""

from __future__ import annotations

import weakref
from pathlib import Path
from typing import Optional, Sequence, Union

import torch

from . import _kvcc
from ._kvcc import KvccError
from ._tensors import check_finite, check_shape, check_tensor, host_f32

Tables = _kvcc.Tables


class Format:
    """A compiled KV code format: a spec file or a bundled spec by name."""

    def __init__(self, native: "_kvcc.Format", source: Optional[str] = None, file: str = "<string>"):
        self._native = native
        self._source, self._file = source, file

    @staticmethod
    def load(path_or_name: str) -> "Format":
        native = _kvcc.Format.load(str(path_or_name))
        path = Path(path_or_name)
        source = path.read_text() if path.is_file() else Format.bundled().get(str(path_or_name))
        return Format(native, source, str(path_or_name))

    @staticmethod
    def parse(source: str, file: str = "<string>") -> "Format":
        return Format(_kvcc.Format.parse(source, file), source, file)

    def without_select(self) -> "Format":
        """The same format without its `[cache.select]` table: every page read."""
        if self._source is None:
            raise KvccError(f"{self.name}: its spec source is not known (load or parse it)")
        kept, inside = [], False
        for line in self._source.splitlines(keepends=True):
            header = line.strip()
            if header.startswith("["):
                inside = header == "[cache.select]"
            if not inside:
                kept.append(line)
        return Format.parse("".join(kept), self._file)

    @staticmethod
    def bundled() -> dict:
        """Bundled spec name -> TOML source."""
        return {
            file.rsplit("/", 1)[-1].removesuffix(".toml"): source
            for file, source in _kvcc.bundled_specs()
        }

    name = property(lambda self: self._native.name)
    head_dim = property(lambda self: self._native.head_dim)
    tiers = property(lambda self: self._native.tiers)

    def tier_index(self, tier: Union[int, str, None]) -> int:
        """A tier by index or name; `None` is the spec's `[cache]` tier."""
        if tier is None:
            return self._native.policy()[3]
        if isinstance(tier, str):
            return self._native.tier_index(tier)
        return int(tier)

    def items_per_page(self, tier=None) -> int:
        return self._native.items_per_page(self.tier_index(tier))

    def page_bytes(self, tier=None) -> int:
        return self._native.page_bytes(self.tier_index(tier))

    def bytes_per_token(
        self,
        tier=None,
        context: int = 32768,
        *,
        sinks: Optional[int] = None,
        window: Optional[int] = None,
        exact: Optional[str] = None,
    ) -> float:
        """Bytes per token per kv head of a `context`-token sequence under the
        spec's `[cache]` policy, `sinks`, `window` and `exact` replacing its
        own where given (tables amortized over the context)."""
        return self._native.bytes_per_token(self.tier_index(tier), context, sinks, window, exact)

    def policy(self) -> dict:
        """The spec's `[cache]` policy."""
        sinks, window, exact, tier = self._native.policy()
        return {"sinks": sinks, "window": window, "exact": exact, "tier": tier}

    def budget(self) -> Optional[dict]:
        """The spec's `[cache.budget]` (a tier per compressed state under a
        byte budget), or None."""
        b = self._native.budget()
        if b is None:
            return None
        keys = ("bytes_per_token", "drop", "score", "protect", "refresh", "observe")
        return dict(zip(keys, b))

    def train(self, k: torch.Tensor, v: torch.Tensor, seed: Optional[int] = None) -> Tables:
        """Fits every tier's tables (codebooks, PCA bases, scales) per kv head
        to keys and values `[kv_heads, tokens, head_dim]`, or `[batch,
        kv_heads, tokens, head_dim]` (every sequence's tokens together)."""
        k, v = check_tensor(k, "keys"), check_tensor(v, "values")
        if k.dim() == 4:
            k = k.transpose(0, 1).reshape(k.shape[1], -1, k.shape[-1])
        if v.dim() == 4:
            v = v.transpose(0, 1).reshape(v.shape[1], -1, v.shape[-1])
        check_shape(k, "keys", ["kv_heads", "tokens", ("head_dim", self.head_dim)])
        check_shape(v, "values", ["kv_heads", "tokens", ("head_dim", self.head_dim)])
        # Training runs on the CPU: device tensors are copied once.
        k, v = k.detach().cpu(), v.detach().cpu()
        return self._native.train(host_f32(k, "keys"), host_f32(v, "values"), k.shape[0], seed)

    def __repr__(self):
        return repr(self._native)


def _format(fmt) -> Format:
    return fmt if isinstance(fmt, Format) else Format.load(fmt)


def _sequences(k, v, kv_heads, head_dim):
    """Per sequence `(keys, values)` `[kv_heads, tokens, head_dim]` tensors from
    a `[batch, kv_heads, tokens, head_dim]` pair or from lists (ragged)."""
    if isinstance(k, torch.Tensor):
        check_tensor(k, "keys")
        check_tensor(v, "values")
        shape = ["batch", ("kv_heads", kv_heads), "tokens", ("head_dim", head_dim)]
        check_shape(k, "keys", shape)
        check_shape(v, "values", shape)
        return list(zip(k.unbind(0), v.unbind(0)))
    if len(k) != len(v):
        raise KvccError(f"{len(k)} key blocks but {len(v)} value blocks")
    pairs = []
    for kk, vv in zip(k, v):
        check_tensor(kk, "keys")
        check_tensor(vv, "values")
        shape = [("kv_heads", kv_heads), "tokens", ("head_dim", head_dim)]
        check_shape(kk, "keys", shape)
        check_shape(vv, "values", shape)
        pairs.append((kk, vv))
    return pairs


def _queries(q, head_dim):
    """`[batch, q_heads, head_dim]` from a decode step's query (a 4-D query
    must have one token)."""
    check_tensor(q, "queries")
    if q.dim() == 4:
        check_shape(q, "queries", ["batch", "q_heads", ("tokens", 1), ("head_dim", head_dim)])
        q = q[:, :, 0]
    check_shape(q, "queries", ["batch", "q_heads", ("head_dim", head_dim)])
    return q


def _same_device(a: torch.device, b: torch.device) -> bool:
    index = lambda d: d.index if d.index is not None else (0 if d.type == "cuda" else None)  # noqa: E731
    return a.type == b.type and index(a) == index(b)


# Live caches by handle, for the torch ops (which take plain ints).
_LIVE: "weakref.WeakValueDictionary[int, LiveCache]" = weakref.WeakValueDictionary()
_NEXT_HANDLE = [0]


class LiveCache:
    """The live compressed KV cache of one layer: `batch` sequences of their
    own lengths, `kv_heads` kv heads, `capacity` page slots per tier. Per
    sequence the first `sinks` tokens and the recent window stay exact; whole
    pages leaving the window are compressed into the policy's tier.

    The policy is the spec's `[cache]` table; `tier`, `sinks`, `window` and
    `exact` override it. Tables are trained on the prompts of the first
    `prefill` unless given (on the CPU, for a CUDA cache too).

    On `device="cuda[:N]"` every call takes CUDA tensors of that device
    (float32, float16 or bfloat16) and runs on torch's current stream with
    no host copy. `q_heads` names the query heads the kernels are first
    loaded for (another count reloads them on its first `attend`).
    `check_finite` scans CUDA inputs for NaN/Inf before each call, which
    waits for the GPU; turn it off for speed once inputs are trusted (it is
    skipped while a CUDA graph is captured)."""

    def __init__(
        self,
        fmt,
        batch: int,
        kv_heads: int,
        capacity: int,
        device: Union[str, torch.device] = "cpu",
        *,
        tables: Optional[Tables] = None,
        tier=None,
        sinks: Optional[int] = None,
        window: Optional[int] = None,
        exact: Optional[str] = None,
        executor: str = "jit",
        seed: Optional[int] = None,
        q_heads: Optional[int] = None,
        check_finite: bool = True,
    ):
        self.format = _format(fmt)
        self.batch, self.kv_heads, self.capacity = int(batch), int(kv_heads), int(capacity)
        self.device = torch.device(device)
        _kvcc.check_device(str(self.device))
        policy = self.format.policy()
        self._policy = (
            policy["sinks"] if sinks is None else int(sinks),
            policy["window"] if window is None else int(window),
            policy["exact"] if exact is None else str(exact),
            self.format.tier_index(tier),
        )
        self._executor = executor
        self._seed = seed
        self._q_heads = q_heads
        self.check_finite = check_finite
        self._native = None
        if tables is not None:
            self._open(tables)
        # The lengths of every sequence, as the torch ops see the cache's state.
        self.state = torch.zeros(self.batch, dtype=torch.int64)
        self.handle = _NEXT_HANDLE[0]
        _NEXT_HANDLE[0] += 1
        _LIVE[self.handle] = self

    @property
    def on_cuda(self) -> bool:
        return self.device.type == "cuda"

    def _check_device(self, t: torch.Tensor, what: str) -> torch.Tensor:
        check_tensor(t, what)
        if not _same_device(t.device, self.device):
            raise KvccError(f"tensor `{what}` is on {t.device} but the cache is on {self.device}")
        return t

    def _host(self, t: torch.Tensor, what: str):
        """`t` as the CPU cache takes it: a contiguous f32 numpy view."""
        return host_f32(self._check_device(t, what), what)

    def _stream(self) -> int:
        return torch.cuda.current_stream(self.device).cuda_stream

    def _capturing(self) -> bool:
        return torch.cuda.is_current_stream_capturing()

    def _rows(self, pairs, k, v):
        """Device K/V of `pairs` as the native call takes them: two contiguous
        tensors of one dtype, `[sequence][kv_head][token][head_dim]`, and the
        tokens per sequence."""
        for kk, vv in pairs:
            self._check_device(kk, "keys")
            self._check_device(vv, "values")
        if isinstance(k, torch.Tensor):
            keys, values = k.contiguous(), v.contiguous()
        else:
            keys = torch.cat([kk.reshape(-1) for kk, _ in pairs]) if pairs else k
            values = torch.cat([vv.reshape(-1) for _, vv in pairs]) if pairs else v
        if keys.dtype != values.dtype:
            keys, values = keys.float(), values.float()
        if self._capturing():
            raise KvccError(
                "an append cannot be captured in a CUDA graph (it is planned on the host): "
                "append outside the graph and replay the captured attend"
            )
        if self.check_finite:
            exact = self.policy["exact"]
            for what, pieces in (("keys", [kk for kk, _ in pairs]), ("values", [vv for _, vv in pairs])):
                for piece in pieces:
                    check_finite(piece, what, exact)
        return keys, values, [kk.shape[1] for kk, _ in pairs]

    def _open(self, tables: Tables) -> None:
        self._native = _kvcc.Live(
            self.format._native,
            tables,
            self.kv_heads,
            self.capacity,
            self._policy,
            str(self.device),
            self._executor,
            self.batch,
            self._q_heads,
        )

    @property
    def tables_trained(self) -> bool:
        return self._native is not None

    @property
    def policy(self) -> dict:
        sinks, window, exact, tier = self._native.policy if self._native else self._policy
        return {"sinks": sinks, "window": window, "exact": exact, "tier": tier}

    def lengths(self) -> list:
        return self._native.lengths() if self._native else []

    @property
    def generation(self) -> int:
        """Bumped whenever a page is allocated, compressed or released (CUDA
        caches; always 0 on the CPU). A captured CUDA graph does not depend
        on it: see `attend`."""
        return self._native.generation if self._native else 0

    def _sync_state(self) -> None:
        lengths = self.lengths()
        self.state.zero_()
        if lengths:
            self.state[: len(lengths)] = torch.tensor(lengths[: self.batch], dtype=torch.int64)

    def prefill(self, k, v, q=None) -> list:
        """Adds sequences: `[batch, kv_heads, tokens, head_dim]` keys and values,
        or lists of `[kv_heads, tokens_i, head_dim]` (prompts of their own
        lengths). Returns their sequence indices. A `[cache.budget]` weighs
        the compressed states by the attention of `q`, the queries of the
        prompts' last tokens: `[batch, q_heads, rows, head_dim]` or a list of
        `[q_heads, rows_i, head_dim]`, scaled for a plain `1/sqrt(head_dim)`."""
        pairs = _sequences(k, v, self.kv_heads, self.format.head_dim)
        if q is not None and self.on_cuda:
            raise KvccError("prompt queries weigh a [cache.budget], which runs on the CPU only")
        have = len(self.lengths())
        if have + len(pairs) > self.batch:
            raise KvccError(
                f"{len(pairs)} new sequences do not fit a cache of batch {self.batch} "
                f"holding {have}"
            )
        if self.on_cuda:
            rows = self._rows(pairs, k, v)
        else:
            arrays = [(self._host(kk, "keys"), self._host(vv, "values")) for kk, vv in pairs]
        if self._native is None:
            keys = torch.cat([kk for kk, _ in pairs], dim=1)
            values = torch.cat([vv for _, vv in pairs], dim=1)
            if keys.shape[1] == 0:
                raise KvccError("no prompt token to train the tables on")
            self._open(self.format.train(keys, values, self._seed))
        if self.on_cuda:
            keys, values, tokens = rows
            indices = self._native.prefill_device(
                keys.data_ptr(), values.data_ptr(), keys.numel(), str(keys.dtype), tokens,
                self._stream(),
            )
        else:
            queries = None
            if q is not None:
                rows = list(q) if isinstance(q, (list, tuple)) else list(q.unbind(0))
                if len(rows) != len(pairs):
                    raise KvccError(f"queries for {len(rows)} sequences, keys for {len(pairs)}")
                queries = []
                for qq in rows:
                    check_shape(qq, "queries", ["q_heads", "rows", ("head_dim", self.format.head_dim)])
                    queries.append((self._host(qq, "queries"), qq.shape[0]))
            indices = self._native.prefill(arrays, queries)
        self._sync_state()
        return indices

    def append(self, k, v, sequences: Optional[Sequence[int]] = None) -> None:
        """Adds tokens: `[n, kv_heads, tokens, head_dim]` keys and values for
        `sequences` (default: every sequence, in order)."""
        if self._native is None:
            raise KvccError("append before prefill: the cache holds no sequence")
        pairs = _sequences(k, v, self.kv_heads, self.format.head_dim)
        if sequences is None:
            sequences = range(len(self.lengths()))
        sequences = list(sequences)
        if len(sequences) != len(pairs):
            raise KvccError(
                f"keys and values for {len(pairs)} sequences given for {len(sequences)} sequences"
            )
        if self.on_cuda:
            keys, values, tokens = self._rows(pairs, k, v)
            self._native.append_device(
                [int(s) for s in sequences], tokens, keys.data_ptr(), values.data_ptr(),
                keys.numel(), str(keys.dtype), self._stream(),
            )
        else:
            batch = [
                (int(s), self._host(kk, "keys"), self._host(vv, "values"))
                for s, (kk, vv) in zip(sequences, pairs)
            ]
            self._native.append(batch)
        self._sync_state()

    def attend(self, q: torch.Tensor):
        """One decode step over every sequence: queries `[batch, q_heads,
        head_dim]` (or `[batch, q_heads, 1, head_dim]`). Returns `(out, lse)`:
        the outputs in the queries' shape and dtype, and each row's
        log-sum-exp of its scaled logits, `[batch, q_heads]` float32.

        On CUDA the step neither allocates native memory nor waits, so it can
        be captured with `torch.cuda.graph` (after one eager call for these
        query heads). A captured step stays valid while later appends fill
        and compress pages; it covers the sequences the cache held when it was
        captured, so re-capture after `prefill` or `release`."""
        if self._native is None:
            raise KvccError("attend before prefill: the cache holds no sequence")
        q3 = _queries(q, self.format.head_dim)
        batch, q_heads, d = q3.shape
        if self.on_cuda:
            return self._attend_cuda(q, q3)
        out, lse = self._native.attend(self._host(q3, "queries"), q_heads)
        out = torch.from_numpy(out).view(batch, q_heads, d).to(q.dtype)
        return out.view(q.shape), torch.from_numpy(lse).view(batch, q_heads)

    def observe(self, q: torch.Tensor) -> None:
        """Records a decode step's queries `[batch, q_heads, head_dim]` (as
        `attend` takes them) as the most recent a `[cache.budget]` weighs the
        next compressed states by; without a budget it only checks them."""
        if self._native is None:
            raise KvccError("observe before prefill: the cache holds no sequence")
        q3 = _queries(q, self.format.head_dim)
        self._native.observe(self._host(q3, "queries"), q3.shape[1])

    def _attend_cuda(self, q, q3):
        self._check_device(q3, "queries")
        batch, q_heads, d = q3.shape
        sequences = len(self._native.lengths())
        if batch != sequences:
            raise KvccError(
                f"queries hold {q3.numel()} values; expected sequences {sequences} x "
                f"query heads {q_heads} x head_dim {d}"
            )
        if self.check_finite and not self._capturing():
            check_finite(q3, "query")
        q32 = q3.to(torch.float32).contiguous()
        out = torch.empty(batch, q_heads, d, dtype=torch.float32, device=q3.device)
        lse = torch.empty(batch, q_heads, dtype=torch.float32, device=q3.device)
        self._native.attend_device(
            q32.data_ptr(), q_heads, out.data_ptr(), lse.data_ptr(), self._stream()
        )
        return out.to(q.dtype).view(q.shape), lse

    def release(self, sequence: int) -> None:
        """Drops a sequence and frees its pages; later sequences move down."""
        if self.on_cuda:
            self._native.release(int(sequence), self._stream())
        else:
            self._native.release(int(sequence))
        self._sync_state()

    def set_tier(self, tier) -> None:
        """The tier pages compressed from now on go to (index or name)."""
        self._native.set_tier(self.format.tier_index(tier))

    def __repr__(self):
        return (
            f"LiveCache(format={self.format.name!r}, batch={self.batch}, kv_heads={self.kv_heads}, "
            f"capacity={self.capacity}, device={str(self.device)!r}, policy={self.policy})"
        )


def live_cache(handle: int) -> LiveCache:
    cache = _LIVE.get(handle)
    if cache is None:
        raise KvccError(f"no live cache with handle {handle}")
    return cache


class Pages:
    """A paged cache whose every token is compressed into one tier, partial
    last pages included (no exact rows): what a one-shot fidelity measurement
    attends through."""

    def __init__(self, fmt, tables: Tables, tier=None, executor: str = "jit"):
        self.format = _format(fmt)
        self._native = _kvcc.Pages(
            self.format._native, tables, self.format.tier_index(tier), executor
        )
        self.kv_heads = tables.kv_heads

    def add(self, k: torch.Tensor, v: torch.Tensor) -> int:
        """Adds one sequence (`[kv_heads, tokens, head_dim]`); returns its index."""
        ((kk, vv),) = _sequences([k], [v], self.kv_heads, self.format.head_dim)
        return self._native.append(host_f32(kk, "keys"), host_f32(vv, "values"))

    @property
    def page_bytes(self) -> int:
        return self._native.page_bytes

    def attend(self, q: torch.Tensor):
        """Queries `[sequences, q_heads, head_dim]` over every sequence's
        tokens; returns `(out, lse)` like `LiveCache.attend`."""
        q3 = _queries(q, self.format.head_dim)
        batch, q_heads, d = q3.shape
        out, lse = self._native.attend(host_f32(q3, "queries"), q_heads)
        out = torch.from_numpy(out).view(batch, q_heads, d).to(q.dtype)
        return out.view(q.shape), torch.from_numpy(lse).view(batch, q_heads)
