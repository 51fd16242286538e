"""What the tiled ops' custom operators (ops/library.py) share: autograd inside an operator's
body, and the compute dtype an operator's fake implementation gives its outputs.

Invariant: autograd is switched back on only for the body's own local derivatives, and off again
when the body returns.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["autograd_inside", "operator_compute_dtype"]


@contextlib.contextmanager
def autograd_inside() -> Iterator[None]:
    """Autograd back on inside an operator's body, which the dispatcher runs below autograd.

    The tile loops differentiate a few elementwise functions locally (an activation's or a
    soft-cap's derivative, torch.autograd.grad on one tile); the tensors involved are the
    body's own, never the caller's. Private dispatcher API: tests/ops/test_library.py fails
    loudly if it moves.
    """
    keys = (torch._C.DispatchKey.AutogradFunctionality, torch._C.DispatchKey.ADInplaceOrView)
    before = [torch._C._dispatch_tls_is_dispatch_key_excluded(k) for k in keys]
    for k in keys:
        torch._C._dispatch_tls_set_dispatch_key_excluded(k, False)
    try:
        with torch.enable_grad():
            yield
    finally:
        for k, was in zip(keys, before):
            torch._C._dispatch_tls_set_dispatch_key_excluded(k, was)


def operator_compute_dtype(
    x: torch.Tensor, weight: torch.Tensor, autocast: torch.dtype | None
) -> torch.dtype:
    """The dtype the GEMMs of x and weight run in under an autocast dtype (None: autocast off)."""
    castable = {torch.float32, torch.float16, torch.bfloat16}
    if autocast is not None and x.dtype in castable and weight.dtype in castable:
        return autocast
    return x.dtype
