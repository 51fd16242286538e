"""Running a module's own (untiled) computation from inside the tiled op.

The tiled op calls the module's untiled forward for the structure probe, for each tile of the
generic path, and for short sequences under "auto". When the module's forward has itself been
replaced by one that calls tiled_mlp (model patching), those calls must not tile again.

Invariant: while an UntiledCall runs, tiled_mlp on the same module (in this thread) runs the
module's untiled forward instead of tiling; nothing else is affected.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

__all__ = ["UntiledCall", "running_untiled"]

_state = threading.local()


def _active() -> set[int]:
    active = getattr(_state, "modules", None)
    if active is None:
        active = set()
        _state.modules = active
    return active


def running_untiled(mlp: nn.Module) -> bool:
    """True while an UntiledCall of `mlp` is running in this thread."""
    return id(mlp) in _active()


@contextlib.contextmanager
def _guard(mlp: nn.Module) -> Iterator[None]:
    active = _active()
    if id(mlp) in active:
        yield
        return
    active.add(id(mlp))
    try:
        yield
    finally:
        active.discard(id(mlp))


# Note [UntiledCall under torch.compile]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A graph torch.compile traces takes tiled_mlp's traced path (ops/mlp/traced.py), which never
# reads running_untiled: the guard would guard nothing there, and its set, mutated inside a
# per-tile checkpoint, is a side effect dynamo refuses inside the checkpoint (a graph break per
# tile). Traced calls run the forward without it.


class UntiledCall:
    """Calls `forward` (default: the module itself) as the module's untiled computation.

    Args:
        mlp: the module.
        forward: its untiled forward, e.g. the original forward of a patched module; None to
            call the module (with its hooks).
    """

    def __init__(self, mlp: nn.Module, forward: Callable[..., Any] | None = None) -> None:
        self.mlp = mlp
        self.forward = forward if forward is not None else mlp

    def __call__(self, *args: torch.Tensor) -> Any:
        if torch.compiler.is_compiling():
            # See Note [UntiledCall under torch.compile]
            return self.forward(*args)
        with _guard(self.mlp):
            return self.forward(*args)

    def with_params(self, params: dict[str, torch.Tensor], *args: torch.Tensor) -> Any:
        """Runs the module with `params` in place of its own (functional_call semantics)."""
        with _guard(self.mlp):
            return torch.func.functional_call(self.mlp, params, args, strict=False)
