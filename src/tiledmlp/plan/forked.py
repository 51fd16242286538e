"""Independent planner jobs (one stack's estimate and search each) in forked processes.

The stacks of one plan share nothing but the config: each is its own simulations. With several
CPUs they run in child processes forked from this one (on Linux, where fork is available: the
imports and the config come along, nothing is imported again), at most one per CPU; the results
come back in the jobs' order.

Inside a job, `beside` runs two independent computations at once where a CPU has gone idle (the
other jobs done: a long stack's search would otherwise run alone): the second in a process forked
from the job's; `speculate` does the same for work that may be needed next (a search's next
length), and skips it where no CPU is idle.

Nothing forks a process whose autograd engine runs device threads (Note [Autograd threads and
fork]): the work then runs one after another here.

Invariant: the answer is that of running the jobs one after another in this process; an exception
raised by a job is raised here (the jobs not yet started are cancelled).
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from multiprocessing.sharedctypes import Synchronized
from typing import Any, TypeVar

import torch

__all__ = [
    "autograd_threads_running",
    "available_cpus",
    "beside",
    "default_processes",
    "run_jobs",
    "speculate",
]

T = TypeVar("T")
U = TypeVar("U")

# in a job's process: how many of run_jobs' processes (and their forks) are computing, and how
# many processes its caller allowed
_busy: Synchronized[int] | None = None
_workers = 1


def available_cpus() -> int:
    """The CPUs this process may run on (its affinity where the OS tells it)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


# Note [Autograd threads and fork]
# At the first backward of a process, torch's autograd engine starts one thread per device of
# every device type but the CPU's (c10's device guards say how many) and from then on refuses
# a backward in a child forked from that process ("Unable to handle autograd's threading in
# combination with fork-based multiprocessing"). A CUDA build of torch on a machine without a
# GPU reports devices once a FakeTensorMode has been entered (the mode stands a fake CUDA
# guard in, to trace CUDA code), so the planner's own first fake backward starts them; the
# +cpu build never does; on macOS, MPS does. Whether a GPU is visible says nothing of it: the
# engine's threads do, by their names.


def autograd_threads_running() -> bool:
    """Whether torch's autograd engine runs device threads in this process (Note [Autograd
    threads and fork]): a thread named pt_autograd_<device>, as the engine names them. Where the
    threads' names cannot be read (no /proc: not Linux), they are taken as running."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return True
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/comm", encoding="utf-8") as comm:
                if comm.read().startswith("pt_autograd_"):
                    return True
        except OSError:  # the thread ended meanwhile
            continue
    return False


def _forks() -> bool:
    """Whether a child forked from this process now can run the planner's steps."""
    return "fork" in multiprocessing.get_all_start_methods() and not autograd_threads_running()


def default_processes(jobs: int) -> int:
    """How many processes `jobs` independent jobs run in: one per available CPU, at most one
    per job; 1 where no child can be forked (_forks) or a GPU is visible (the planner reads a
    CUDA device's properties, and a child forked after its parent touched CUDA cannot use it;
    `torch.cuda.device_count` asks NVML where it can, which leaves CUDA untouched)."""
    if not _forks() or torch.cuda.device_count() > 0:
        return 1
    return max(1, min(jobs, available_cpus()))


def run_jobs(fn: Callable[..., T], jobs: Sequence[tuple[Any, ...]], processes: int = 1) -> list[T]:
    """[fn(*args) for args in jobs], in `processes` forked processes when more than one.

    The jobs are started last first: a later stack adds features to the earlier ones and
    usually takes longer, so starting it first keeps the processes busy until the end.
    `fn`, its arguments and its results cross the process boundary pickled. Where no child can
    be forked now (Note [Autograd threads and fork]) they run here, one after another.

    Raises:
        Whatever a job raised (the first in the jobs' order).
    """
    workers = min(processes, len(jobs))
    if workers <= 1 or not _forks():
        return [fn(*args) for args in jobs]
    context = multiprocessing.get_context("fork")
    busy = context.Value("i", 0)
    pool = ProcessPoolExecutor(
        max_workers=workers, mp_context=context, initializer=_child, initargs=(busy, workers)
    )
    try:
        futures: dict[int, Future[T]] = {}
        for i in reversed(range(len(jobs))):
            futures[i] = pool.submit(_counted, fn, *jobs[i])
        return [futures[i].result() for i in range(len(jobs))]
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def beside(first: Callable[[], T], second: Callable[[], U]) -> tuple[T, U]:
    """(first(), second()). Inside a job of run_jobs while fewer of its processes compute than it
    was allowed (a CPU idle), `second` runs in a process forked from this one while `first` runs
    here (its result comes back pickled); otherwise one after the other here.

    Raises:
        Whatever `first` or `second` raised (`first`'s when both did).
    """
    if not _take_idle_cpu():
        return first(), second()
    return _forked(first, second)


def speculate(first: Callable[[], T], second: Callable[[], U]) -> tuple[T, U | None]:
    """(first(), second()) where a CPU is idle (as `beside`: `second` in a forked process),
    else (first(), None) without running `second`: for work that only may be needed next."""
    if not _take_idle_cpu():
        return first(), None
    return _forked(first, second)


def _take_idle_cpu() -> bool:
    """Whether a CPU is idle inside a job of run_jobs; if so it is counted as computing (the
    caller's fork releases it in _forked); never where a child cannot be forked now (Note
    [Autograd threads and fork])."""
    busy = _busy
    if busy is None or autograd_threads_running():
        return False
    with busy.get_lock():
        idle = busy.value < _workers
        if idle:
            busy.value += 1
    return idle


def _forked(first: Callable[[], T], second: Callable[[], U]) -> tuple[T, U]:
    """(first(), second()), `second` in a process forked from this one on the CPU
    _take_idle_cpu took."""
    busy = _busy
    assert busy is not None  # _take_idle_cpu took a CPU
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the forked process: `second`, its result or its error down the pipe
        try:
            os.close(read)
            try:
                payload = pickle.dumps((True, second()))
            except BaseException as e:  # handed to the caller, raised there
                try:
                    payload = pickle.dumps((False, e))
                except Exception:  # an error that does not pickle: its type and message
                    payload = pickle.dumps((False, RuntimeError(f"{type(e).__name__}: {e}")))
            with os.fdopen(write, "wb") as out:
                out.write(payload)
        finally:
            os._exit(0)  # never back into the job's code
    os.close(write)
    try:
        a = first()
    finally:
        with os.fdopen(read, "rb") as pipe:
            data = pipe.read()
        os.waitpid(pid, 0)
        with busy.get_lock():
            busy.value -= 1
    if not data:
        raise RuntimeError("tiledmlp plan: a forked estimate ended without a result")
    ok, b = pickle.loads(data)
    if not ok:
        raise b
    return a, b


def _counted(fn: Callable[..., T], *args: Any) -> T:
    """fn(*args), counted as computing (beside)."""
    assert _busy is not None  # set by _child in every process of the pool
    with _busy.get_lock():
        _busy.value += 1
    try:
        return fn(*args)
    finally:
        with _busy.get_lock():
            _busy.value -= 1


def _child(busy: Synchronized[int], workers: int) -> None:
    global _busy, _workers
    _busy, _workers = busy, workers
    # one process per CPU: a child's own operations stay on one thread
    torch.set_num_threads(1)
