"""Checks and conversions of torch tensors at the boundary to the native module.

Every tensor the package accepts goes through `host_f32` (CPU) or, once the
CUDA live cache is wired in, the device path: one place decides dtype and
device errors.
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
