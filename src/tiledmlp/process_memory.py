"""Process-level memory of this process on Linux: /proc/self/status fields, the high-water
mark of one step (VmHWM, reset through /proc/self/clear_refs), and the memory the machine can
still give it (/proc/meminfo's MemAvailable within the cgroup's limit).

Invariant: every reading is in bytes, or None where /proc is not available (never a guess).
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["available_ram_bytes", "proc_status_bytes", "process_peak_bytes"]


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


# the cgroup's limit and usage: v2 (unified), then v1
_CGROUP_FILES = (
    ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
    ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
)


def available_ram_bytes() -> int | None:
    """The RAM this process can still take: MemAvailable of /proc/meminfo, or less where a
    cgroup limits the memory (its limit less its usage); None off Linux."""
    available = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
    except OSError:
        return None
    for limit_file, usage_file in _CGROUP_FILES:
        try:
            with open(limit_file) as f:
                limit_text = f.read().strip()
            with open(usage_file) as f:
                usage = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if limit_text.isdigit() and int(limit_text) < 1 << 60:  # "max" or v1's huge: none
            left = max(0, int(limit_text) - usage)
            available = left if available is None else min(available, left)
        break
    return available
