"""Returning to the driver what patch_model's probes left in the CUDA caching allocator.

The probes run each feature's modules on random stand-ins of their weights and on sample inputs
(ops/tiling/probe.py), on the model's device. Their tensors are freed when the probes end, but
the caching allocator keeps the segments it took for them, cut into blocks of the probes' sizes,
and the first training step draws from that fragmented pool. On an H100 (Llama-3-8B shape, 4
layers, the tiled loss, 131,072 tokens, without expandable segments) the step then reserved
1,340 MiB more than it does from the model's own segments: the caching allocator's trace of
that step, replayed with and without the probes' segments (benchmarks/results/gpu/
2026-11-26T0933-h100/trace/; plan/sim/caching_allocator.py reproduces the card's 36,024 MiB from
it). Where the probes made a device's reservation grow, that device's unused cached segments
are released once they are done (`torch.cuda.empty_cache`), so training starts from the
model's segments: the state the planner plans from.

Invariant: nothing allocated is freed (only segments no tensor uses go back), and a device whose
reservation the probes did not grow is left as it was.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Protocol

import torch
from torch import nn

__all__ = ["CudaCache", "DeviceCache", "probes_released"]


class DeviceCache(Protocol):
    """A device allocator's cache: how much it holds, and a way to give back what is unused."""

    def reserved(self, device: torch.device) -> int: ...

    def release(self, device: torch.device) -> None: ...


class CudaCache:
    """PyTorch's CUDA caching allocator."""

    def reserved(self, device: torch.device) -> int:
        return int(torch.cuda.memory_reserved(device))

    def release(self, device: torch.device) -> None:
        with torch.cuda.device(device):
            torch.cuda.empty_cache()


@contextlib.contextmanager
def probes_released(
    model: nn.Module, cache: DeviceCache | None = None, device_type: str = "cuda"
) -> Iterator[set[torch.device]]:
    """Within the block the probes run; afterwards every device of `device_type` holding
    `model`'s parameters or buffers whose reservation grew has its unused cached segments
    released (`cache`: that device type's allocator; None: CUDA's). Yields the set the released
    devices are added to."""
    tensors = (*model.parameters(), *model.buffers())
    devices = {t.device for t in tensors if t.device.type == device_type}
    released: set[torch.device] = set()
    if not devices:
        yield released
        return
    cache = CudaCache() if cache is None else cache
    before = {d: cache.reserved(d) for d in devices}
    try:
        yield released
    finally:
        for d in sorted(devices, key=str):
            if cache.reserved(d) > before[d]:
                cache.release(d)
                released.add(d)
