"""Independent planner jobs (one stack's estimate and search each) in forked processes.

The stacks of one plan share nothing but the config: each is its own simulations. With several
CPUs they run in child processes forked from this one (on Linux, where fork is available: the
imports and the config come along, nothing is imported again), at most one per CPU; the results
come back in the jobs' order.

Invariant: the answer is that of running the jobs one after another in this process; an exception
raised by a job is raised here (the jobs not yet started are cancelled).
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from typing import Any, TypeVar

import torch

__all__ = ["available_cpus", "default_processes", "run_jobs"]

T = TypeVar("T")


def available_cpus() -> int:
    """The CPUs this process may run on (its affinity where the OS tells it)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def default_processes(jobs: int) -> int:
    """How many processes `jobs` independent jobs run in: one per available CPU, at most one
    per job; 1 where fork is unavailable or a GPU is visible (the planner reads a CUDA device's
    properties, and a child forked after its parent touched CUDA cannot use it;
    `torch.cuda.device_count` asks NVML where it can, which leaves CUDA untouched)."""
    if "fork" not in multiprocessing.get_all_start_methods() or torch.cuda.device_count() > 0:
        return 1
    return max(1, min(jobs, available_cpus()))


def run_jobs(fn: Callable[..., T], jobs: Sequence[tuple[Any, ...]], processes: int = 1) -> list[T]:
    """[fn(*args) for args in jobs], in `processes` forked processes when more than one.

    The jobs are started last first: a later stack adds features to the earlier ones and
    usually takes longer, so starting it first keeps the processes busy until the end.
    `fn`, its arguments and its results cross the process boundary pickled.

    Raises:
        Whatever a job raised (the first in the jobs' order).
    """
    workers = min(processes, len(jobs))
    if workers <= 1:
        return [fn(*args) for args in jobs]
    pool = ProcessPoolExecutor(
        max_workers=workers, mp_context=multiprocessing.get_context("fork"), initializer=_child
    )
    try:
        futures: dict[int, Future[T]] = {}
        for i in reversed(range(len(jobs))):
            futures[i] = pool.submit(fn, *jobs[i])
        return [futures[i].result() for i in range(len(jobs))]
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _child() -> None:
    # one process per CPU: a child's own operations stay on one thread
    torch.set_num_threads(1)
