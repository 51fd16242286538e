"""The optimizer step's part of a deeper step's record (deeper.py), written from the recorded one.

A foreach optimizer (torch.optim.AdamW(foreach=True)) makes its temporaries as lists: one
storage per trainable parameter, of that parameter's bytes, in the parameters' order, released
together later. A step with more middle decoder layers has more parameters, in the same order
with the copied layer's repeated after it; its lists are the recorded ones with those entries
repeated, created and released at the same places. Anything else the step creates (a scalar)
does not depend on the layers and is kept as it is. Where the record does not show this (a
request that is no list and occurs as often as there are layers, a list released in no order,
a block held for another stream, a phase change inside), the part is refused (None)
(docs/how-it-works/planner.md, "One more layer").

Invariant: where it answers, the part is the one the step of L + more layers records (as
tests/plan/test_deeper.py checks against simulating it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tiledmlp.plan.sim.caching_allocator import FREE, HOLD
from tiledmlp.plan.sim.step_record import StepRecord

__all__ = ["OptimizerPart", "deeper_optimizer"]


@dataclass
class OptimizerPart:
    """The deeper step's optimizer part: its events, the bytes of each fresh serial (in the
    order given, from `fresh` on) and the deeper step's parameters."""

    trace: list[tuple[int, int]]
    new_bytes: list[int]
    params: list[tuple[int, int | None]]


def deeper_optimizer(
    r: StepRecord,
    begin: int,
    copied: int,
    more: int,
    renamed: Callable[[int], int | None],
    fresh: int,
) -> OptimizerPart | None:
    """The optimizer part of the step with `more` copies of layer `copied` (deeper.py), from
    the recorded events `begin` on; `renamed` names a storage created before the part in the
    deeper step (None: none), `fresh` is the first serial free for the copies' requests."""
    sizes = [b for b, _ in r.params]
    block = [i for i, (_, layer) in enumerate(r.params) if layer == copied]
    if not block or block != list(range(block[0], block[-1] + 1)):
        return None
    events = r.trace[begin:]
    if any(b == HOLD for _, b in events) or any(begin < i for i, _ in r.flushes):
        return None
    if any(rep.end > begin for rep in r.repeats):
        return None
    lists = _lists(events, sizes)
    position = {s: (k, p) for k, serials in enumerate(lists) for p, s in enumerate(serials)}
    loose = sum(1 for s, b in events if b != FREE and s not in position)
    if loose >= len(r.forward_starts):  # as many as the layers: not the layers' own
        return None
    order = _release_orders(events, lists, position)
    if order is None:
        return None
    copies: dict[tuple[int, int, int], int] = {}  # (list, copy, position) -> serial
    new_bytes: list[int] = []
    out: list[tuple[int, int]] = []
    for s, b in events:
        if b != FREE:
            out.append((s, b))
            if position.get(s, (None, -1))[1] == block[-1]:  # the copies follow the block
                k = position[s][0]
                for c in range(more):
                    for q in block:
                        copies[k, c, q] = fresh + len(new_bytes)
                        new_bytes.append(sizes[q])
                        out.append((copies[k, c, q], sizes[q]))
            continue
        if s not in position:
            t = renamed(s)
            if t is None:
                return None
            out.append((t, FREE))
            continue
        k, p = position[s]
        if p != block[-1]:
            out.append((s, FREE))
        elif order[k] > 0:  # ascending: the copies after the block
            out.append((s, FREE))
            out += [(copies[k, c, q], FREE) for c in range(more) for q in block]
        else:  # descending: the copies (the last one first) before the block
            out += [(copies[k, c, q], FREE) for c in reversed(range(more)) for q in reversed(block)]
            out.append((s, FREE))
    params = [*r.params[: block[-1] + 1]]
    params += [(b, copied + c + 1) for c in range(more) for b, _ in (r.params[q] for q in block)]
    params += [(b, None if i is None else i + more if i > copied else i)
               for b, i in r.params[block[-1] + 1 :]]  # fmt: skip
    return OptimizerPart(out, new_bytes, params)


def _lists(events: list[tuple[int, int]], sizes: list[int]) -> list[list[int]]:
    """The serials of each per-parameter list among the part's creations: a run of consecutive
    creations whose bytes are the parameters' in order (`sizes`, not empty)."""
    found: list[list[int]] = []
    i = 0
    while i < len(events):
        run = events[i : i + len(sizes)]
        if len(run) == len(sizes) and all(
            b not in (FREE, HOLD) and b == n for (_, b), n in zip(run, sizes)
        ):
            found.append([s for s, _ in run])
            i += len(sizes)
        else:
            i += 1
    return found


def _release_orders(
    events: list[tuple[int, int]], lists: list[list[int]], position: dict[int, tuple[int, int]]
) -> list[int] | None:
    """Per list: +1 where its storages are released in the parameters' order, -1 in the
    reverse order, 0 where none is released in the part; None where some are and some are not,
    or in another order."""
    released: list[list[int]] = [[] for _ in lists]
    for s, b in events:
        if b == FREE and s in position:
            k, p = position[s]
            released[k].append(p)
    order = []
    for k, ps in enumerate(released):
        n = len(lists[k])
        if not ps:
            order.append(0)
        elif ps == list(range(n)):
            order.append(1)
        elif ps == list(reversed(range(n))):
            order.append(-1)
        else:
            return None
    return order
