"""FLOP counting for benchmarks: FlopCounterMode's own formulas, without its module tracking.

torch.utils.flop_counter.FlopCounterMode also tracks modules with autograd hooks, which crash
inside implementations that chunk a requires-grad input under no_grad (DeepSpeed's TiledMLP among
them). This counter applies the same registered formulas (flop_counter.flop_registry) to every
dispatched op and tracks nothing else, so every variant is counted the same way. tests/ops/mlp/test_flops.py
checks that it agrees with FlopCounterMode wherever the latter runs.

Invariant: counts are deterministic functions of the ops and shapes executed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

__all__ = ["OpFlopCounter", "count_flops"]


class OpFlopCounter(TorchDispatchMode):
    """Sums FLOPs of every dispatched op that FlopCounterMode has a formula for."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = flop_registry.get(func.overloadpacket)
        if formula is not None:
            # the out_dtype overloads (mm.dtype, addmm.dtype...) take the dtype positionally,
            # where the formulas expect only tensors: a FLOP count does not depend on it
            shaped = tuple(a for a in args if not isinstance(a, torch.dtype))
            self.total += int(formula(*shaped, **kwargs, out_val=out))
        return out


def count_flops(step: Callable[[], object]) -> int:
    """FLOPs of everything `step` runs (forward and backward included if it runs both)."""
    with OpFlopCounter() as counter:
        step()
    return counter.total
