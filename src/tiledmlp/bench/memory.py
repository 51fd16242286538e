"""Tensor-level peak memory of a step, measured the same way for every variant.

CPU: the torch.profiler memory timeline (profile_memory + record_shapes + with_stack, exported as
JSON): the peak is the largest rise of the summed categories over the step plus the bytes that
were alive before it. It counts every tensor the step creates, including modules called once
per tile, and is exactly repeatable. Accelerators (CUDA, NPU): torch.accelerator's
max_memory_allocated after a reset. Process level (CPU, Linux): the high-water mark of the
process's resident memory (VmHWM), reset through /proc/self/clear_refs before the step.

Invariant: `alive_before` is the caller's count of what exists before the step starts (weights,
inputs, upstream gradient); the result is absolute bytes at the peak.
"""

from __future__ import annotations

import json
import os
import tempfile
import warnings
from collections.abc import Callable

import torch

from tiledmlp.process_memory import proc_status_bytes, process_peak_bytes

__all__ = ["peak_bytes", "proc_status_bytes", "process_peak_bytes", "tensor_bytes"]


def tensor_bytes(*tensors: torch.Tensor) -> int:
    """Bytes held by the given tensors (each storage counted once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def peak_bytes(step: Callable[[], object], alive_before: int, device: torch.device) -> int:
    """Peak bytes alive while `step` runs (what it creates and keeps included).

    Args:
        step: the work to measure; whatever it returns is dropped after measuring.
        alive_before: bytes alive before the step that it may use (weights, inputs).
        device: where the step runs.
    """
    if device.type != "cpu":
        acc = torch.accelerator
        acc.synchronize(device)
        acc.reset_peak_memory_stats(device)
        base = acc.memory_allocated(device)
        step()
        acc.synchronize(device)
        return acc.max_memory_allocated(device) - base + alive_before
    from torch.profiler import ProfilerActivity, profile

    with profile(
        activities=[ProfilerActivity.CPU],
        profile_memory=True,
        record_shapes=True,
        with_stack=True,
    ) as prof:
        step()
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the timeline exporter announces its deprecation
            prof.export_memory_timeline(path, device="cpu")
        with open(path) as f:
            _times, sizes = json.load(f)
    finally:
        os.unlink(path)
    totals = [sum(row) for row in sizes]
    if not totals:
        return alive_before
    return max(totals) - min(totals) + alive_before
