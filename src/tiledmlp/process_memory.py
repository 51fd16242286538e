"""Process-level memory of this process on Linux: /proc/self/status fields and the high-water
mark of one step (VmHWM, reset through /proc/self/clear_refs).

Invariant: every reading is in bytes, or None where /proc is not available (never a guess).
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["proc_status_bytes", "process_peak_bytes"]


def proc_status_bytes(field: str) -> int | None:
    """A memory field of /proc/self/status ("VmRSS", "VmHWM", ...) in bytes; None off Linux."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def process_peak_bytes(step: Callable[[], object], alive_before: int) -> int | None:
    """(VmHWM during `step` - RSS before it) + `alive_before`: the process-level peak, comparable
    with tensor-level figures; None where /proc is not available."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
    except OSError:
        return None
    before = proc_status_bytes("VmRSS")
    step()
    hwm = proc_status_bytes("VmHWM")
    if before is None or hwm is None:
        return None
    return hwm - before + alive_before
