"""Running a function in real processes (gloo on CPU; 2 unless told) with a deadline.

The ranks meet through a file store in the run's own temporary directory, not a TCP port: two
test suites on one machine (or anything else listening) can never take each other's rendezvous.
Gloo's own connections use ports the system assigns.

The ranks start from a fork server that imported torch, transformers, DeepSpeed and tiledmlp
once (multiprocessing's "forkserver": a fresh single-threaded process, so every rank is still
a clean process that has run no torch op): a rank costs a fork, not an interpreter's imports.

Invariant: every worker either returns its result (pickled into a file) or the run fails with
the worker's traceback; a run past its deadline is killed and reported as a timeout (a deadlock
never hangs the test suite).
"""

from __future__ import annotations

import os
import pickle
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from conftest import assert_close_rel

WORLD = 2
#: what the fork server imports before it forks the ranks (what every rank imports anyway)
PRELOAD = [
    "torch",
    "torch.distributed",
    "transformers",
    "transformers.models.llama.modeling_llama",
    "deepspeed",
    "tiledmlp",
    "distributed.workers",
]


class DeadlineExceeded(AssertionError):
    """The workers did not finish in time (a deadlock)."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(
    rank: int,
    fn: Callable[..., Any],
    port: int,
    out_dir: str,
    args: tuple,
    world: int = WORLD,
    pg_timeout: float | None = None,
    peers_may_exit: bool = False,
) -> None:
    # MASTER_* for libraries that read them; the rendezvous itself is the file store.
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
    )
    torch.set_num_threads(1)
    result: Any
    try:
        store = dist.FileStore(os.path.join(out_dir, "store"), world)
        timeout = {} if pg_timeout is None else {"timeout": timedelta(seconds=pg_timeout)}
        dist.init_process_group("gloo", rank=rank, world_size=world, store=store, **timeout)
        result = ("ok", fn(rank, *args))
        if not peers_may_exit:  # a closing barrier with a rank that left would fail
            dist.barrier()
    except BaseException:
        result = ("error", traceback.format_exc())
    # The result is on disk before any teardown: gloo's threads can abort the process while the
    # process group or the interpreter shuts down, after the work itself has finished.
    with open(os.path.join(out_dir, f"{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)
    if dist.is_initialized() and not peers_may_exit:
        dist.destroy_process_group()
    os._exit(0)  # skip interpreter teardown (thread destructors), the result is written


def run_distributed(
    fn: Callable[..., Any],
    *args: Any,
    timeout: float = 240.0,
    world: int = WORLD,
    pg_timeout: float | None = None,
    may_exit: frozenset[int] = frozenset(),
) -> list[Any]:
    """Runs fn(rank, *args) on `world` ranks (2 by default); returns the per-rank results.

    Args:
        pg_timeout: the process group's timeout in seconds (torch's default when None).
        may_exit: ranks that may leave without a result (a test of a rank that dies): None
            in their place.

    Raises:
        DeadlineExceeded: not done within `timeout` seconds.
        AssertionError: a worker raised (its traceback is in the message).
    """
    out_dir = tempfile.mkdtemp(prefix="tiledmlp-dist-")
    mp.set_forkserver_preload(PRELOAD)  # read when the server starts: this process's first run
    ctx = mp.start_processes(
        _worker,
        args=(fn, _free_port(), out_dir, args, world, pg_timeout, bool(may_exit)),
        nprocs=world,
        join=False,
        start_method="forkserver",
    )
    deadline = time.monotonic() + timeout
    abnormal: str | None = None
    while True:
        try:
            if ctx.join(timeout=1.0):
                break
        except mp.ProcessExitedException as e:  # judged below by what the workers wrote
            abnormal = str(e)
            for p in ctx.processes:
                p.join(timeout=10)
            break
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            raise DeadlineExceeded(f"distributed run did not finish within {timeout:.0f} s")
    results = []
    for rank in range(world):
        path = os.path.join(out_dir, f"{rank}.pkl")
        if not os.path.exists(path) and rank in may_exit:
            results.append(None)
            continue
        if not os.path.exists(path):
            raise AssertionError(f"rank {rank} wrote no result ({abnormal or 'no error reported'})")
        with open(path, "rb") as f:
            status, value = pickle.load(f)
        if status != "ok":
            raise AssertionError(f"rank {rank} failed:\n{value}")
        results.append(value)
    return results


def assert_matches_reference(results: list, ref: dict) -> None:
    for rank, res in enumerate(results):
        assert res["grads"].keys() == ref["grads"].keys()
        for name, g in ref["grads"].items():
            assert_close_rel(res["grads"][name], g, f"rank {rank} grad {name}")
        for name, p in ref["params"].items():
            assert_close_rel(res["params"][name], p, f"rank {rank} param {name}")
