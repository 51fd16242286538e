"""Host memory for activation offloading: what a step pins, and what the machine has.

Activation offloading moves the checkpointed layers' inputs off the device, so long sequences
run into the host's limit instead: every checkpointed layer but the last keeps its input,
(tokens x hidden) elements of the layer's dtype, in pinned host memory until its recompute.
Before the first offloaded step (and whenever the shape grows) that amount is compared with the
memory this process may still take: the machine's MemAvailable, or less when a cgroup (a
container, a job scheduler) limits the process, divided among the processes of the machine
(each rank offloads its own layers). A step that cannot fit stops with the figures and the fix
instead of being killed by the operating system part-way.

Invariant: `offload_bytes` is exactly what the offloader moves to the host in one step (tested
against its counters); the check never raises when the figures cannot be read.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["HostMemoryError", "available_host_bytes", "check_host_memory", "offload_bytes"]

GiB = 2**30


class HostMemoryError(ValueError):
    """The host memory an offloaded step needs is not there."""


def offload_bytes(checkpointed_layers: int, tokens: int, hidden: int, element_size: int) -> int:
    """Host bytes one step pins: the inputs of every checkpointed layer but the last (whose
    recompute comes first, so its input stays on the device)."""
    return max(0, checkpointed_layers - 1) * tokens * hidden * element_size


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _meminfo(field: str) -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            name, _, value = line.partition(":")
            if name == field:
                return int(value.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _cgroup_room() -> tuple[int, int] | None:
    """(limit, in use) of this process's memory cgroup (v2, else v1), or None without a
    limit."""
    v2 = Path("/sys/fs/cgroup")
    limit, used = _read_int(v2 / "memory.max"), _read_int(v2 / "memory.current")
    if limit is None:
        v1 = v2 / "memory"
        limit, used = (
            _read_int(v1 / "memory.limit_in_bytes"),
            _read_int(v1 / "memory.usage_in_bytes"),
        )
        if limit is not None and limit >= 2**60:  # v1's "no limit"
            limit = None
    if limit is None or used is None:
        return None
    return limit, used


def available_host_bytes() -> tuple[int | None, str]:
    """(bytes this process may still take, how that was found), or (None, why not) where the
    figures cannot be read (not Linux)."""
    free = _meminfo("MemAvailable")
    room = _cgroup_room()
    parts = []
    candidates = []
    if free is not None:
        candidates.append(free)
        parts.append(f"MemAvailable {free / GiB:.1f} GiB")
    if room is not None:
        limit, used = room
        candidates.append(max(0, limit - used))
        parts.append(f"cgroup limit {limit / GiB:.1f} GiB with {used / GiB:.1f} GiB in use")
    if not candidates:
        return None, "host memory figures not readable here"
    return min(candidates), ", ".join(parts)


def check_host_memory(
    need: int,
    what: str,
    processes: int | None = None,
    available: tuple[int | None, str] | None = None,
) -> None:
    """Raises HostMemoryError when `need` bytes of host memory will not fit this process's
    share of what is available.

    Args:
        need: bytes the step will pin.
        what: what needs them, for the message.
        processes: processes sharing the machine (default: LOCAL_WORLD_SIZE, else 1).
        available: (bytes, description), default available_host_bytes().
    """
    if processes is None:
        processes = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
    have, source = available if available is not None else available_host_bytes()
    if have is None or need <= 0:
        return
    share = have // processes
    if need <= share:
        return
    among = f", shared by {processes} processes on this machine ({share / GiB:.1f} GiB each)"
    raise HostMemoryError(
        f"activation offloading: {what} needs {need / GiB:.1f} GiB of pinned host memory per "
        f"step, but {have / GiB:.1f} GiB is available ({source})"
        + (among if processes > 1 else "")
        + "; shorten the sequence or the batch, split the sequence over more GPUs "
        "(sequence_parallel_size), run fewer processes per machine, or give the job more host "
        "memory"
    )
