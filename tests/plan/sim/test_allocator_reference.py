"""plan/sim/caching_allocator.py against a straightforward reference of the same rules (one
object per block, free lists of (size, addr) pairs, one method per event), on random traces
with and without expandable segments and held blocks: the same reserved, live and peak bytes,
and the same free blocks, after every event. And plan/sim/periodic_tiles.py's replay with its
cycles of states skipped against the whole trace's replay, on random loops."""

from __future__ import annotations

import bisect
import random
from dataclasses import dataclass

import pytest

from tiledmlp.plan.sim.caching_allocator import (
    FREE,
    HOLD,
    MIN_BLOCK,
    PAGE,
    SMALL_SIZE,
    CachingAllocator,
    reserve_beyond_peak,
    round_size,
    segment_size,
)
from tiledmlp.plan.sim.periodic_tiles import Repeat, replayed_reserve, whole_trace

MiB = 2**20


@dataclass(eq=False)
class _Piece:
    addr: int
    size: int
    small: bool
    free: bool = True
    prev: _Piece | None = None
    next: _Piece | None = None


class _Reference:
    """The module docstring's rules, written plainly."""

    def __init__(self, expandable: bool, holds: bool) -> None:
        self.expandable, self.holds = expandable, holds
        self.reserved = self.live = self.peak = self.top = 0
        self.free_list: dict[bool, list[tuple[int, int]]] = {True: [], False: []}
        self.at: dict[int, _Piece] = {}
        self.held: dict[int, tuple[_Piece, int]] = {}
        self.returned: set[int] = set()
        self.last: dict[bool, _Piece | None] = {True: None, False: None}

    def malloc(self, key: int, nbytes: int) -> None:
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        if nbytes == 0:
            self.held[key] = (_Piece(-1, 0, True, free=False), 0)
            return
        size = round_size(nbytes)
        small = size <= SMALL_SIZE
        pool = self.free_list[small]
        i = bisect.bisect_left(pool, (size, -1))
        last = self.last[small]
        if self.expandable and i + 1 < len(pool) and last is not None and last.free:
            i += pool[i][1] == last.addr  # the free end of the mapped range is kept for last
        if i < len(pool):
            block = self.at.pop(pool.pop(i)[1])
        elif self.expandable:
            grow = last if last is not None and last.free else None
            have = grow.size if grow is not None else 0
            mapped = -(-(size - have) // PAGE[small]) * PAGE[small]
            self.reserved += mapped
            if grow is not None:
                self._take(grow)
                grow.size += mapped
                block = grow
            else:
                addr = last.addr + last.size if last is not None else (0 if small else 1 << 60)
                block = _Piece(addr, mapped, small, prev=last)
                if last is not None:
                    last.next = block
                self.last[small] = block
        else:
            block = _Piece(self.top, segment_size(size), small)
            self.top += block.size
            self.reserved += block.size
        rest = block.size - size
        if rest >= MIN_BLOCK if small or self.expandable else rest > SMALL_SIZE:
            tail = _Piece(block.addr + size, rest, small, prev=block, next=block.next)
            if block.next is not None:
                block.next.prev = tail
            elif self.last[small] is block:
                self.last[small] = tail
            block.next, block.size = tail, size
            self._give(tail)
        block.free = False
        self.held[key] = (block, nbytes)

    def hold(self, key: int) -> None:
        if not self.holds:
            self.free(key)
            self.returned.add(key)
            return
        block, nbytes = self.held[key]
        self.live -= nbytes
        self.held[key] = (block, 0)

    def free(self, key: int) -> None:
        if key in self.returned:
            self.returned.discard(key)
            return
        block, nbytes = self.held.pop(key)
        self.live -= nbytes
        if block.size == 0:
            return
        block.free = True
        before, after = block.prev, block.next
        if before is not None and before.free:
            self._take(before)
            before.size += block.size
            before.next = block.next
            if block.next is not None:
                block.next.prev = before
            if self.last[block.small] is block:
                self.last[block.small] = before
            block = before
        if after is not None and after.free:
            self._take(after)
            block.size += after.size
            block.next = after.next
            if after.next is not None:
                after.next.prev = block
            if self.last[block.small] is after:
                self.last[block.small] = block
        self._give(block)

    def _give(self, block: _Piece) -> None:
        bisect.insort(self.free_list[block.small], (block.size, block.addr))
        self.at[block.addr] = block

    def _take(self, block: _Piece) -> None:
        self.free_list[block.small].remove((block.size, block.addr))
        del self.at[block.addr]


def _random_trace(rng: random.Random, events: int) -> list[tuple[int, int]]:
    """Requests of every kind of size (zero, small, large under and over 10 MiB, a few sizes
    repeated), frees and holds of live keys in random order."""
    sizes = [0, 1, 511, 512, 4000, SMALL_SIZE, SMALL_SIZE + 1, 3 * MiB, 9 * MiB, 12 * MiB]
    live: list[int] = []
    holding: list[int] = []
    trace: list[tuple[int, int]] = []
    key = 0
    for _ in range(events):
        roll = rng.random()
        if roll < 0.5 or not live:
            size = rng.choice(sizes) if rng.random() < 0.4 else rng.randint(1, 30 * MiB)
            trace.append((key, size))
            live.append(key)
            key += 1
        elif roll < 0.6:
            k = live.pop(rng.randrange(len(live)))
            trace.append((k, HOLD))
            holding.append(k)
        else:
            pool = holding if holding and rng.random() < 0.3 else live
            trace.append((pool.pop(rng.randrange(len(pool))), FREE))
    return trace


def _free_blocks(ref: _Reference) -> tuple[tuple[int, ...], ...]:
    pools = [ref.free_list[False], ref.free_list[True]]
    return tuple(tuple(entry[i] for entry in pool) for pool in pools for i in (0, 1))


def _event(alloc: CachingAllocator | _Reference, key: int, nbytes: int) -> None:
    if nbytes == FREE:
        alloc.free(key)
    elif nbytes == HOLD:
        alloc.hold(key)
    else:
        alloc.malloc(key, nbytes)


@pytest.mark.parametrize("expandable", [False, True])
@pytest.mark.parametrize("holds", [True, False])
def test_the_allocator_matches_the_reference_event_by_event(expandable: bool, holds: bool) -> None:
    rng = random.Random(f"{expandable}-{holds}")
    for _ in range(4):
        trace = _random_trace(rng, 600)
        alloc, ref = CachingAllocator(expandable, holds), _Reference(expandable, holds)
        for key, nbytes in trace:
            alloc.run([(key, nbytes)])
            _event(ref, key, nbytes)
            seen = (alloc.reserved, alloc.live, alloc.peak, alloc.free_blocks())
            assert seen == (ref.reserved, ref.live, ref.peak, _free_blocks(ref))
        # the same trace in one call, and through the per-event methods
        whole, one = CachingAllocator(expandable, holds), CachingAllocator(expandable, holds)
        whole.run(trace)
        for key, nbytes in trace:
            _event(one, key, nbytes)
        assert whole.reserved - whole.peak == one.reserved - one.peak == ref.reserved - ref.peak


def test_events_that_are_no_trace_events_are_refused() -> None:
    alloc = CachingAllocator()
    with pytest.raises(ValueError, match="nbytes >= 0, FREE or HOLD; got \\(1, -3\\)"):
        alloc.run([(1, -3)])
    with pytest.raises(ValueError, match="at least 0 bytes"):
        alloc.malloc(1, FREE)
    alloc.run([(1, 0)])
    with pytest.raises(ValueError, match="already holds a block"):
        alloc.malloc(1, 0)


def _random_loop(rng: random.Random) -> tuple[list[tuple[int, int]], list[Repeat]]:
    """A cut trace of a few tile loops: each loop's first tile, then one tile a Repeat stands
    for, whose storages the next tiles release one or two tiles on (as the tracker records
    them: serials in order of creation)."""
    trace: list[tuple[int, int]] = []
    repeats: list[Repeat] = []
    serial = 0
    for _ in range(rng.randint(2, 4)):
        new = rng.randint(1, 4)
        sizes = [rng.choice([4000, 2 * MiB, 3 * MiB, 12 * MiB, rng.randint(1, 20 * MiB)])
                 for _ in range(new)]  # fmt: skip
        back = [rng.randint(0, 2) for _ in range(new)]  # each storage freed this many tiles on
        tiles: list[list[int]] = []
        for tile in range(3):
            begin, first = len(trace), serial
            keys = list(range(serial, serial + new))
            serial += new
            tiles.append(keys)
            for o in range(new):
                trace.append((keys[o], sizes[o]))
                for t in range(len(tiles)):  # what the pattern releases in this tile
                    if back[o] == len(tiles) - 1 - t:
                        trace.append((tiles[t][o], FREE))
            if tile == 2:
                repeats.append(Repeat(begin, len(trace), first, new, rng.randint(1, 60)))
        for t in range(len(tiles)):  # the loop's end: what is left
            for o in range(new):
                if back[o] > len(tiles) - 1 - t:
                    trace.append((tiles[t][o], FREE))
    return trace, repeats


def test_skipping_cycles_of_states_changes_no_reserve() -> None:
    rng = random.Random(7)
    for _ in range(40):
        trace, repeats = _random_loop(rng)
        for expandable in (False, True):
            whole = reserve_beyond_peak(
                [3 * MiB], whole_trace(trace, repeats), expandable=expandable
            )
            assert replayed_reserve([3 * MiB], trace, repeats, expandable=expandable) == whole
