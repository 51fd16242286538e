"""Collectives that fail with the rank that stopped answering, instead of a transport error.

When a rank dies (killed, out of memory, an exception of its own) or gets stuck, every other
rank's next collective with it fails: at once with a transport error when its connections close
(gloo), or after the process group's timeout (init_process_group(timeout=...); the NCCL watchdog
on GPUs). The transport's message names an address, not a rank. `guarded` turns that failure
into a CollectiveError naming the rank(s) that did not answer: each survivor reports itself in
the rendezvous store, waits a few seconds for the others, and names the ranks that never came.

Every collective the library adds runs inside `guarded`, on the default group or on groups made
with `default_timeout()` (the sequence-parallel groups), so it is bounded by the timeout given to
init_process_group (`tiledmlp train --ddp-timeout`), not by torch's 30-minute default for new
groups.

Invariant: a collective run inside `guarded` either completes or raises a CollectiveError that
names the collective and the missing ranks (or, when the store is unreachable too, says so); it
never waits longer than the process group's timeout plus the grace period.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["CollectiveError", "default_timeout", "guarded", "missing_ranks"]

#: seconds a survivor waits for the other ranks to report themselves after a failure
GRACE_S = 5.0
_failures = 0  # per process: the survivors of one failure share its number


class CollectiveError(RuntimeError):
    """A collective failed because another rank stopped answering.

    Attributes:
        missing: the global ranks that did not report themselves (None: not known).
    """

    def __init__(self, message: str, missing: list[int] | None) -> None:
        super().__init__(message)
        self.missing = missing


def _is_transport_failure(e: BaseException) -> bool:
    dist_error = getattr(dist, "DistError", None)
    if dist_error is not None and isinstance(e, dist_error):
        return True
    text = str(e)
    return any(
        marker in text
        for marker in ("gloo", "Connection reset", "Connection closed", "Timed out", "NCCL")
    )


def _default_store() -> Any:
    """The default process group's rendezvous store, or None where it cannot be reached
    (a private accessor of torch.distributed: looked up here only, tested)."""
    getter = getattr(dist.distributed_c10d, "_get_default_store", None)
    if getter is None:
        return None
    try:
        return getter()
    except (RuntimeError, ValueError):
        return None


def default_timeout() -> timedelta | None:
    """The default process group's timeout (what init_process_group was given), or None where
    it cannot be read (a private attribute of torch.distributed: looked up here only, tested).
    Groups made with new_group get torch's 30-minute default instead unless given this."""
    try:
        device = "cuda" if dist.get_backend() == "nccl" else "cpu"
        backend = dist.group.WORLD._get_backend(torch.device(device))  # type: ignore[union-attr]
        timeout = backend.options._timeout
    except (AttributeError, RuntimeError, ValueError):
        return None
    return timeout if isinstance(timeout, timedelta) else None


def missing_ranks(group: Any = None, grace_s: float = GRACE_S) -> list[int] | None:
    """After a failed collective: the global ranks of `group` that do not report themselves in
    the rendezvous store within `grace_s` seconds, or None when the store is unreachable."""
    global _failures
    _failures += 1
    ranks = dist.get_process_group_ranks(group) if group is not None else None
    if ranks is None:
        ranks = list(range(dist.get_world_size()))
    me = dist.get_rank()
    store = _default_store()
    if store is None:
        return None

    def key(rank: int) -> str:
        return f"tiledmlp/alive/{_failures}/{rank}"

    try:
        store.set(key(me), "1")
        waiting = {r for r in ranks if r != me}
        deadline = time.monotonic() + grace_s
        while waiting and time.monotonic() < deadline:
            waiting = {r for r in waiting if not store.check([key(r)])}
            if waiting:
                time.sleep(0.05)
    except (RuntimeError, ValueError):
        return None
    return sorted(waiting)


@contextlib.contextmanager
def guarded(what: str, group: Any = None) -> Iterator[None]:
    """Runs the collective(s) in the block; a transport failure or timeout becomes a
    CollectiveError naming the ranks that stopped answering.

    Args:
        what: the collective, for the message (e.g. "the per-step token agreement").
        group: its process group (None: the default group).
    """
    try:
        yield
    except RuntimeError as e:
        if (
            isinstance(e, CollectiveError)
            or not _is_transport_failure(e)
            or not (dist.is_available() and dist.is_initialized())
        ):
            raise
        missing = missing_ranks(group)
        me = dist.get_rank()
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if missing:
            names = ", ".join(str(r) for r in missing)
            who = (
                f"rank {names} stopped answering"
                if len(missing) == 1
                else f"ranks {names} stopped answering"
            )
        elif missing is None:
            who = (
                "another rank stopped answering, and the rendezvous store is unreachable too "
                "(its host, rank 0 when not launched by torchrun, may be the one that stopped)"
            )
        else:
            who = "every rank reported itself afterwards (a transient transport failure?)"
        message = (
            f"tiledmlp: {what} failed on rank {me}: {who} (it exited, was killed or is stuck: "
            f"its own output says why); this rank stops too instead of waiting. Transport: "
            f"{first[:300]}"
        )
        raise CollectiveError(message, missing) from e
