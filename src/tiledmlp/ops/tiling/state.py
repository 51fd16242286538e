"""Execution state carried from the forward into each tile's recompute.

Invariant: a tile recomputed in the backward sees the same autocast settings and the same random
number generator state as it saw in the forward, so dropout masks and mixed-precision casts are
identical; the caller's global RNG stream is left exactly as it was.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

__all__ = ["AutocastState", "RNGState"]


@dataclass(frozen=True)
class AutocastState:
    """Autocast settings of one device type, as seen when the forward ran."""

    device_type: str
    enabled: bool
    dtype: torch.dtype
    cache_enabled: bool

    @classmethod
    def capture(cls, device_type: str) -> AutocastState:
        return cls(
            device_type=device_type,
            enabled=torch.is_autocast_enabled(device_type),
            dtype=torch.get_autocast_dtype(device_type),
            cache_enabled=torch.is_autocast_cache_enabled(),
        )

    def restore(self) -> contextlib.AbstractContextManager[object]:
        """Context manager that re-enters these settings."""
        return torch.autocast(
            self.device_type,
            dtype=self.dtype,
            enabled=self.enabled,
            cache_enabled=self.cache_enabled,
        )

    def compute_dtype(self, *dtypes: torch.dtype) -> torch.dtype | None:
        """The dtype autocast would run a matmul in for inputs of `dtypes`, or None if it would
        not cast (autocast off, or an input autocast leaves alone such as float64)."""
        castable = {torch.float32, torch.float16, torch.bfloat16}
        if self.enabled and all(d in castable for d in dtypes):
            return self.dtype
        return None


@dataclass(frozen=True)
class RNGState:
    """CPU generator state plus the generator state of one accelerator device, if any."""

    cpu: torch.Tensor
    device: torch.device | None
    device_state: torch.Tensor | None

    @classmethod
    def capture(cls, device: torch.device) -> RNGState:
        module = _device_module(device)
        if module is None:
            return cls(torch.get_rng_state(), None, None)
        index = device.index if device.index is not None else module.current_device()
        return cls(torch.get_rng_state(), device, module.get_rng_state(index))

    @contextlib.contextmanager
    def replay(self) -> Iterator[None]:
        """Runs the body from this state, then puts the caller's generators back as they were."""
        module = _device_module(self.device) if self.device is not None else None
        devices: list[int] = []
        if module is not None and self.device is not None:
            devices = [
                self.device.index if self.device.index is not None else module.current_device()
            ]
        device_type = self.device.type if self.device is not None else "cuda"
        with torch.random.fork_rng(devices=devices, device_type=device_type):
            torch.set_rng_state(self.cpu)
            if module is not None and self.device_state is not None:
                module.set_rng_state(self.device_state, devices[0])
            yield


def _device_module(device: torch.device | None):
    if device is None or device.type in ("cpu", "meta"):
        return None
    module = getattr(torch, device.type, None)
    if module is None or not hasattr(module, "get_rng_state") or not module.is_available():
        return None
    return module
