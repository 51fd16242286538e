"""The result of a GEMM written into a given `out=` tensor, known without dispatching it.

The tile engines accumulate products into buffers they own (`torch.mm(a, b, out=...)`,
`torch.addmm(acc, a, b, out=acc)`, with a float32 `out_dtype` on a GPU). On fake tensors such a
call creates no storage: its result is the `out` tensor. FakeTensorMode does not cache calls
whose arguments alias their output, so each one runs its meta kernel, about ten times a cached
call's cost; the trackers (fake_memory.py) take the result from here instead, where the operands
are what the kernel accepts as they are: 2-D matrices whose inner sizes agree, an `out` of the
product's shape and of the dtype the kernel writes (the inputs', or `out_dtype`), an added
`self` of the product's shape and of `out`'s dtype. Anything else is dispatched (a resize, a
broadcast, an error).

Invariant: `written_out` returns a tensor only where the op would return that same tensor and
allocate nothing.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["written_out"]

_aten = torch.ops.aten
# op -> (index of the first matrix in the positional arguments, whether it adds `self`)
_GEMMS: dict[Any, tuple[int, bool]] = {_aten.mm.out: (0, False), _aten.addmm.out: (1, True)}
for _name, _first, _adds in (("mm", 0, False), ("addmm", 1, True)):
    if "dtype_out" in getattr(_aten, _name).overloads():  # the float32-output overloads
        _GEMMS[getattr(_aten, _name).dtype_out] = (_first, _adds)


def written_out(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor | None:
    """`out` when `func(*args, **kwargs)` is a GEMM that would write into it as it is (module
    docstring); None when the op must be dispatched."""
    spec = _GEMMS.get(func)
    if spec is None:
        return None
    first, adds = spec
    out = kwargs.get("out")
    if not isinstance(out, torch.Tensor) or len(args) < first + 2:
        return None
    a, b = args[first], args[first + 1]
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return None
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0] or a.dtype != b.dtype:
        return None
    shape = (a.shape[0], b.shape[1])
    if tuple(out.shape) != shape or out.device != a.device or b.device != a.device:
        return None
    dtype = kwargs.get("out_dtype", args[first + 2] if len(args) > first + 2 else None)
    if not isinstance(dtype, torch.dtype):
        dtype = a.dtype
    if out.dtype != dtype:
        return None
    if adds:
        c = args[0]
        if not isinstance(c, torch.Tensor) or tuple(c.shape) != shape or c.dtype != dtype:
            return None
        if c.device != a.device:
            return None
    return out
