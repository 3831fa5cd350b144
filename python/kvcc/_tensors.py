"""Checks and conversions of torch tensors at the boundary to the native module.

Every tensor the package accepts goes through `check_tensor`, then `host_f32`
(CPU) or the device path of `core.LiveCache`, whose NaN and range checks are
`check_finite`: the CPU runtime's messages, computed with torch on the device.
"""

from __future__ import annotations

import numpy as np
import torch

from ._kvcc import KvccError

SUPPORTED = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def check_tensor(t, what: str) -> torch.Tensor:
    """A float tensor of a supported dtype, or TypeError with the CLI's message."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"tensor `{what}` must be a torch.Tensor, not {type(t).__name__}")
    if t.dtype not in SUPPORTED:
        raise TypeError(
            f"tensor `{what}` has unsupported dtype {dtype_name(t.dtype).upper()} "
            f"(supported: {', '.join(SUPPORTED.values())})"
        )
    return t


def host_f32(t: torch.Tensor, what: str) -> np.ndarray:
    """The tensor as a C-contiguous float32 numpy array: shared memory when it
    already is one on the CPU, otherwise one converted copy."""
    check_tensor(t, what)
    if t.device.type != "cpu":
        raise NotImplementedError(
            f"tensor `{what}` is on {t.device}; this call takes CPU tensors"
        )
    return t.detach().to(torch.float32).contiguous().numpy()


def check_shape(t: torch.Tensor, what: str, expected: list) -> None:
    """`expected` lists each dimension as an int (that size), a name (any size)
    or a `(name, size)` pair; a mismatch raises KvccError naming both."""
    dims = list(t.shape)
    ok = len(dims) == len(expected) and all(
        isinstance(e, str) or (e[1] if isinstance(e, tuple) else e) == d
        for d, e in zip(dims, expected)
    )
    if not ok:
        names = ", ".join(
            e if isinstance(e, str) else (f"{e[0]} {e[1]}" if isinstance(e, tuple) else str(e))
            for e in expected
        )
        raise KvccError(f"{what} have shape {dims}, which is not [{names}]")


def _rust_float(value: float) -> str:
    """A float32 as Rust's `Display` writes it (the runtime's messages)."""
    if np.isnan(value):
        return "NaN"
    if np.isinf(value):
        return "inf" if value > 0 else "-inf"
    return np.format_float_positional(np.float32(value), trim="-")


EXACT = {"f16": torch.float16, "bf16": torch.bfloat16}


def check_finite(t: torch.Tensor, what: str, exact: str = None) -> None:
    """Raises the CPU runtime's error for a non-finite element of `t`
    (`[kv_heads, tokens, head_dim]` keys or values, `[batch, q_heads,
    head_dim]` queries when `what` is "query"), or for a K/V value that the
    `exact` row dtype cannot represent. Waits for the device."""
    bad = ~torch.isfinite(t)
    if bool(bad.any()):
        at = [int(i) for i in bad.nonzero()[0]]
        value = _rust_float(float(t[tuple(at)]))
        if what == "query":
            sequence, head, channel = at
            raise KvccError(
                f"query contains a non-finite value at sequence {sequence}, head {head}, "
                f"channel {channel}"
            )
        kv_head, token, channel = at[-3:]
        raise KvccError(
            f"{what} is not finite ({value}) at kv_head {kv_head}, token {token}, channel {channel}"
        )
    if exact is not None:
        rounded = t.to(torch.float32).to(EXACT[exact])
        bad = ~torch.isfinite(rounded)
        if bool(bad.any()):
            at = tuple(int(i) for i in bad.nonzero()[0])
            value = _rust_float(float(t[at]))
            raise KvccError(f"{what} hold {value}, which {exact} exact rows cannot represent")
