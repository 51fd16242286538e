"""The device type a planned step runs on, where its tensors are fake CPU tensors.

The planner simulates a GPU's step on fake tensors that live on the CPU (plan/fake_step.py).
Decisions that depend on the device type ("auto" tiles, whether a GEMM can accumulate in
float32) read the assumed type inside `assume_device` instead of the tensors' own.

Invariant: outside `assume_device` nothing is assumed; blocks nest, the innermost wins.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

__all__ = ["assume_device", "assumed_type"]

_ASSUMED: list[str] = []  # device types set by assume_device, innermost last


@contextlib.contextmanager
def assume_device(device_type: str) -> Iterator[None]:
    """Within the block, device-dependent choices resolve as on `device_type` whatever device
    the tensors are on (the planner estimates a GPU's step on fake CPU tensors)."""
    _ASSUMED.append(device_type)
    try:
        yield
    finally:
        _ASSUMED.pop()


def assumed_type() -> str | None:
    """The innermost assumed device type, or None outside `assume_device`."""
    return _ASSUMED[-1] if _ASSUMED else None
