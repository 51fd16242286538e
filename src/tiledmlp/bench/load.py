"""How busy the machine was while a benchmark ran: the 1-minute load average before and after,
against the number of CPUs, in one line that says when other work shared the cores.

Invariant: the line states what was measured (the load averages, the CPUs, the threads the
benchmark ran) and calls the machine busy only from those numbers: other work of at least half
the CPUs before the run, or after it once the benchmark's own threads are taken off.
"""

from __future__ import annotations

import os

__all__ = ["BUSY_SHARE", "busy", "load_line", "machine_load"]

#: other work of at least this share of the CPUs makes the machine busy
BUSY_SHARE = 0.5


def machine_load() -> float | None:
    """The 1-minute load average (processes running or waiting to run), or None where the
    system has none."""
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):  # no getloadavg (Windows)
        return None


def busy(before: float | None, after: float | None, cpus: int, threads: int) -> bool:
    """Whether other work used at least BUSY_SHARE of the `cpus`: the load before the run, or
    the load after it less the run's own `threads` (at most one per CPU)."""
    others = [
        load
        for load in (before, None if after is None else after - min(threads, cpus))
        if load is not None
    ]
    return any(load >= BUSY_SHARE * cpus for load in others)


def load_line(before: float | None, after: float | None, cpus: int, threads: int) -> str:
    """'load: 0.31 before, 2.05 after (1-minute average) on 2 CPUs, 2 threads measured', and,
    on a busy machine, what that does to the figures."""
    if before is None and after is None:
        return f"load: not measured (no load average on this system), {cpus} CPUs"
    shown = ", ".join(
        f"{value:.2f} {when}" for value, when in ((before, "before"), (after, "after"))
        if value is not None
    )  # fmt: skip
    line = f"load: {shown} (1-minute average) on {cpus} CPUs, {threads} threads measured"
    if busy(before, after, cpus, threads):
        line += (
            "; busy: other work shared the cores, so the times are longer and their ratios "
            "noisier than on an idle machine (rerun when it is idle to quote them)"
        )
    return line
