"""Tensor-level peak memory of a step, measured the same way for every variant.

CPU: torch.profiler's memory events (profile_memory): every allocation and free of the CPU
allocator in the order they happened; the peak is the largest rise of their running sum over
the step plus the bytes that were alive before it (the figure the profiler's memory timeline
gives, summed over its categories, without building the timeline). It counts every tensor the
step creates, including modules called once per tile, and is exactly repeatable. Accelerators (CUDA, NPU): torch.accelerator's
max_memory_allocated after a reset. Process level (CPU, Linux): the high-water mark of the
process's resident memory (VmHWM), reset through /proc/self/clear_refs before the step.

Invariant: `alive_before` is the caller's count of what exists before the step starts (weights,
inputs, upstream gradient); the result is absolute bytes at the peak.
"""

from __future__ import annotations

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

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    return _largest_rise(prof) + alive_before


def _largest_rise(prof: torch.profiler.profile) -> int:
    """The largest rise of the CPU's allocated bytes over a profiled step: the running sum of
    its memory events (an allocation's bytes, a free's negative bytes) in time order, its
    highest point above its lowest."""
    assert prof.profiler is not None and prof.profiler.kineto_results is not None  # it ran
    cpu = torch.autograd.DeviceType.CPU
    events = [
        (e.start_ns(), e.nbytes())  # type: ignore[attr-defined]  # in torch, not its stubs
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]" and e.device_type() == cpu
    ]
    events.sort(key=lambda e: e[0])  # by time; events at one time keep the profiler's order
    level = lowest = highest = 0
    for _, nbytes in events:
        level += nbytes
        lowest = min(lowest, level)
        highest = max(highest, level)
    return highest - lowest
