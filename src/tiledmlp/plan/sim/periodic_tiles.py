"""Tile loops cut short on fake tensors: a loop's repeated tiles run once each.

Every tiled op walks its tiles with `TilePlan.bounds()`, and tiles of one size run the same code
on the same shapes once the loop's first tile is past (ops/tiling/tiles.py, Note [The tile-loop
contract]); so on fake tensors they create and free the same storages in the same order. While
`PeriodicTiles` is active, `bounds()` walks the tiles through it (`walking_tiles`): it yields them
one by one, watches each tile's window of the tracker's events (phase_tracker.py), and as soon
as a tile is steady skips the rest of the tiles of its size: a skipped tile would repeat the
steady tile's window exactly, so the step's peak, the moment it is first reached, what is alive
then and its categories are those of the whole loop. When a tile is steady, and how
`whole_trace` and `replayed_reserve` rebuild the whole loops' trace for the caching allocator's
replay: docs/how-it-works/planner.md, "Tile loops cut short".

Invariant: outside the context `TilePlan.bounds` walks every tile; inside, a tile is skipped
only after a steady tile of its size, and `whole_trace` is the trace the loops would have
recorded run whole. A loop inside another's tile runs whole.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import groupby, repeat
from operator import add
from typing import Any

import torch

from tiledmlp.ops.tiling.tiles import TilePlan, walking_tiles
from tiledmlp.plan.sim.caching_allocator import FREE, HOLD, CachingAllocator
from tiledmlp.plan.sim.phase_tracker import PhaseTracker

__all__ = ["PeriodicTiles", "Repeat", "cut_peak_bytes", "replayed_reserve", "whole_trace"]


@dataclass(frozen=True)
class Repeat:
    """A tile window the cut trace holds once and the whole loop `times` more times.

    Attributes:
        begin: the window's first event in the tracker's trace.
        end: the event after its last.
        first: the serial of its first new storage.
        new: how many storages it creates (serials first .. first + new - 1).
        times: the tiles skipped after it.
    """

    begin: int
    end: int
    first: int
    new: int
    times: int


class PeriodicTiles:
    """While active, tile loops skip the tiles that repeat (module docstring); `cut` says
    whether any tile was skipped."""

    def __init__(self, tracker: PhaseTracker) -> None:
        self.tracker = tracker
        self.cut = False
        self.repeats: list[Repeat] = []
        self._open = 0  # loops running now (a loop inside another's tile is not cut)
        # the plans are made inside the product's ops, per call: their bounds() read this walk
        # from the context (ops/tiling/tiles.py, Note [The tile-loop contract])
        self._walking = walking_tiles(self._bounds)

    def __enter__(self) -> PeriodicTiles:
        self._walking.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._walking.__exit__(*exc)

    def _bounds(self, plan: TilePlan) -> Iterator[tuple[int, int]]:
        sizes = plan.sizes
        # the runs of equal sizes (split_even makes two), each (its first tile, its last, the
        # offset of its first); a tile's offset and its run's last tile read from its run
        runs: list[tuple[int, int, int]] = []
        start = offset = 0
        for size, run in groupby(sizes):
            n = len(list(run))
            runs.append((start, start + n - 1, offset))
            start, offset = start + n, offset + n * size
        r = 0  # the run of tile i
        before: tuple[Any, ...] | None = None  # the previous tile's window, in this run
        firsts: list[int] = []  # each tile's first new storage (serial)
        news: list[int] = []  # how many storages each tile created
        inner = self._open > 0
        self._open += 1
        try:
            i = 0
            while i < len(sizes):
                while runs[r][1] < i:
                    r += 1
                first_of_run, last_of_run, at = runs[r]
                lo = at + (i - first_of_run) * sizes[i]
                t = self.tracker
                begin = (len(t.trace), t.live, len(t.segments), len(t.phase_of))
                yield lo, lo + sizes[i]
                window = None if inner else self._window(begin)
                new = len(t.phase_of) - begin[3]
                firsts.append(begin[3])
                news.append(new)
                if (
                    window is not None
                    and i < last_of_run
                    and (window == before or self._steady(i, sizes, firsts, news, begin[0]))
                ):
                    # tiles i + 1 .. last_of_run would repeat tile i
                    self.repeats.append(
                        Repeat(begin[0], len(t.trace), begin[3], new, last_of_run - i)
                    )
                    self.cut = True
                    i, before = last_of_run + 1, None
                    firsts.extend([-1] * (i - len(firsts)))  # skipped: no storages of theirs
                    news.extend([0] * (i - len(news)))
                    continue
                before = window if i + 1 < len(sizes) and sizes[i + 1] == sizes[i] else None
                i += 1
        finally:
            self._open -= 1

    def _steady(
        self, i: int, sizes: tuple[int, ...], firsts: list[int], news: list[int], trace_at: int
    ) -> bool:
        """Whether tile i (its window valid) is one every later tile of its size repeats: it is
        not the loop's first tile, and it released only storages of the tiles just before it,
        each of its size, not the loop's first tile, and created as many storages as it did (so
        the same code on the same shapes releases, in each later tile, the same storages of the
        tiles before it, of the same bytes: the product's loops branch on the tile's index only
        for the first tile)."""
        if i < 1:  # the loop's first tile may do what no other does
            return False
        first = firsts[i]
        for serial, nbytes in self.tracker.trace[trace_at:]:
            if nbytes != FREE or serial >= first:
                continue
            d = -((serial - first) // news[i])  # tiles back (a valid window created some)
            j = i - d
            if (
                d < 1
                or j < 1
                or any(
                    sizes[k] != sizes[i]
                    or news[k] != news[i]
                    or firsts[k] != first - (i - k) * news[i]
                    for k in range(j, i)
                )
            ):
                return False
        return True

    def _window(self, begin: tuple[int, int, int, int]) -> tuple[Any, ...] | None:
        """The tile's events since `begin`, comparable between tiles: (bytes, phase) per new
        storage, (FREE, serial relative to the tile's first new storage, bytes) per release,
        with the live bytes at its start; None for a tile that is not a period (it changed the
        live bytes, closed a segment, created no storage, or held a block for another stream)."""
        t = self.tracker
        trace_at, live, segments, first = begin
        if t.live != live or len(t.segments) != segments or len(t.phase_of) == first:
            return None
        if any(nbytes == HOLD for _, nbytes in t.trace[trace_at:]):
            return None  # a block held for another stream: not repeated
        events = tuple(
            (FREE, serial - first, t.bytes_of[serial])
            if nbytes == FREE
            else (nbytes, t.phase_of[serial])
            for serial, nbytes in t.trace[trace_at:]
        )
        return live, events


def cut_peak_bytes(step: Callable[[], object], alive: list[torch.Tensor]) -> int:
    """fake_memory.fake_peak_bytes with the tile loops cut (run it under FakeTensorMode
    yourself): the same peak. Every tensor of `alive` is counted, on any device."""
    seen: dict[int, int] = {}
    for t in alive:
        seen[int(t.untyped_storage()._cdata)] = t.untyped_storage().nbytes()
    tracker = PhaseTracker(alive)
    with tracker, PeriodicTiles(tracker):
        step()
    return sum(seen.values()) + tracker.peak


def whole_trace(trace: list[tuple[int, int]], repeats: list[Repeat]) -> Iterator[tuple[int, int]]:
    """The trace of the step with its loops run whole, from the cut `trace` and its `repeats`
    (module docstring): (key, bytes) and (key, FREE) events; a skipped tile's new storages get
    keys from 2**40 on (serials and the caller's keys for tensors before the step stay below)."""
    events: list[tuple[int, int]] = []
    _rebuild(trace, repeats, events.extend, None)
    return iter(events)


def replayed_reserve(
    before: list[int],
    trace: list[tuple[int, int]],
    repeats: list[Repeat],
    *,
    expandable: bool,
    holds: bool = True,
) -> int:
    """caching_allocator.reserve_beyond_peak(before, whole_trace(trace, repeats), ...), with
    whole cycles of the allocator's states skipped: once a copy leaves the free blocks, the
    reserve, the live bytes and the blocks of the loop's storages (by their place in the
    pattern) as an earlier copy did, the copies between them repeat (the allocator is
    deterministic), so the copies left run less whole multiples of that period. `holds`: as in
    reserve_beyond_peak."""
    alloc = CachingAllocator(expandable, holds)
    for i, nbytes in enumerate(before):
        alloc.malloc(-1 - i, nbytes)
    _rebuild(trace, repeats, alloc.run, alloc)
    return alloc.reserved - alloc.peak


def _rebuild(
    trace: list[tuple[int, int]],
    repeats: list[Repeat],
    emit: Callable[[Iterable[tuple[int, int]]], None],
    alloc: CachingAllocator | None,
) -> None:
    """Emits the whole trace (whole_trace), a stretch of events at a time; with `alloc` (which
    the emitted events drive), leaves out whole cycles of the allocator's states
    (replayed_reserve)."""
    alias: dict[int, int] = {}  # a recorded serial -> its key in the whole trace
    fresh = [1 << 40]  # the next skipped tile's first key
    pos = 0
    for rep in repeats:
        emit(_renamed(trace[pos : rep.end], alias))
        window = trace[rep.begin : rep.end]
        released = {(r % rep.new, -(r // rep.new)) for r in (
            s - rep.first for s, b in window if b == FREE)}  # fmt: skip
        back = max((e for _, e in released), default=0)
        tiles = _Tiles(rep, alias)
        copies = _copies(window, tiles, back, emit, alloc, fresh)
        # a storage of the tile d before the repeated one that the pattern releases e > d
        # tiles on is, after the loop, that of the last copy's tile d before it (all read
        # before any is renamed: with fewer copies than e, that tile is a recorded one)
        alias.update({
            rep.first - d * rep.new + offset: tiles.key(copies - d, offset)
            for offset, e in released for d in range(e)
        })  # fmt: skip
        pos = rep.end
    emit(_renamed(trace[pos:], alias))


def _copies(
    window: list[tuple[int, int]],
    tiles: _Tiles,
    back: int,
    emit: Callable[[Iterable[tuple[int, int]]], None],
    alloc: CachingAllocator | None,
    fresh: list[int],
) -> int:
    """Emits the skipped tiles' copies of `window`, a copy's events at a time; with `alloc`,
    fewer once the allocator's states cycle (_rebuild). Returns how many copies ran."""
    rep = tiles.rep
    # per event: (True, nbytes, 0) for a new storage, (False, tiles back, offset) for a release
    pattern = [
        (False, *divmod(s - rep.first, rep.new)) if b == FREE else (True, b, 0) for s, b in window
    ]
    made = sum(new for new, _, _ in pattern)  # storages each copy creates
    offsets = _offsets(pattern, made) if made == rep.new else None  # Note [Keys of a copy]
    nbytes = [b for _, b in window]
    places, no_hold = _Places(pattern, tiles, back), HOLD not in nbytes
    copies = rep.times  # how many copies run (fewer once the allocator's states cycle)
    seen = {} if alloc is None else {alloc.state(*places.keys(0, None)): 0}
    key, keys = tiles.key, tiles.copies
    c = 0
    while c < copies:
        c += 1
        first = fresh[0]
        fresh[0] += made
        keys.append(range(first, first + made))
        events: Iterable[tuple[int, int]]
        if offsets is not None and c > back:
            events = zip(map(add, offsets, repeat(first)), nbytes)
        else:
            j = iter(keys[c])  # the copy's new storages, in order
            events = [
                (next(j), a) if new else (keys[c + a][b] if c + a > 0 else key(c + a, b), FREE)
                for new, a, b in pattern
            ]
        emit(events)
        if alloc is not None and copies == rep.times:
            known = offsets is not None and c > back and no_hold
            state = alloc.state(*places.keys(c, first if known else None))
            if state in seen:  # the states cycle: whole cycles change nothing
                period = c - seen[state]
                copies -= (copies - c) // period * period
            seen[state] = c
    return copies


# Note [Keys of a copy]
# Copy c's new storages take consecutive keys from its first, F(c), and copy c + 1's follow:
# F(c + 1) = F(c) + made. With one new storage per serial of the pattern (made == new: the
# tracker gives each storage a serial, in order), the storage of offset b of the tile a <= 0
# tiles from copy c is, when that tile is a copy, F(c + a) + b = F(c) + made * a + b, and
# copy c's j-th new storage is F(c) + j: once every tile the pattern releases from is a copy
# (c > back), each event's key is F(c) plus the same offset in every copy. Earlier copies
# release recorded storages too, named through `_Tiles.key`.


def _offsets(pattern: list[tuple[bool, int, int]], made: int) -> list[int]:
    """Each event's key less its copy's first key (Note [Keys of a copy])."""
    offsets, j = [], 0
    for new, a, b in pattern:
        offsets.append(j if new else made * a + b)
        j += new
    return offsets


# Note [Released places]
# Past the first copies (c > back), with one key per storage of the pattern (Note [Keys of a
# copy]) and no hold in it, every tile from copy c - back to c is a copy, and the storage at
# place (d, o) has key F(c - d) + o, which nothing but the pattern names: it releases that
# storage in copy c - d + e (e its release distance), so at copy c's end it is freed exactly
# where e <= d, and the state reads (-2, -1) there without looking (CachingAllocator.state).
# Earlier copies name recorded storages, whose releases the record made: there every place is
# looked up. Both read the places in the same order, so their states compare as if each place
# were looked up.


class _Places:
    """The places (d tiles back, offset) of the loop's storages that a state names: first
    those alive at a later copy's end, then those the pattern has released by then."""

    def __init__(self, pattern: list[tuple[bool, int, int]], tiles: _Tiles, back: int) -> None:
        new = tiles.rep.new
        distance: dict[int, int] = {}  # offset -> the tiles on its storage is released
        for is_new, a, b in pattern:
            if not is_new:
                distance[b] = min(-a, distance.get(b, -a))
        every = [(d, o) for d in range(back + 1) for o in range(new)]
        alive = [(d, o) for d, o in every if distance.get(o, back + 1) > d]
        self.places = alive + [(d, o) for d, o in every if distance.get(o, back + 1) <= d]
        self.freed = len(self.places) - len(alive)
        self.offsets = [o - d * new for d, o in alive]  # keys less the copy's first
        self.tiles, self.back = tiles, back

    def keys(self, copy: int, first: int | None) -> tuple[Iterable[int], int]:
        """The keys to look up at `copy`'s end and the places known freed after them: with
        `first` (the copy's first key), those of Note [Released places]; else every place's."""
        if first is not None:
            return map(add, self.offsets, repeat(first)), self.freed
        tiles = [self.tiles.keys(copy - d) for d in range(self.back + 1)]
        return [tiles[d][o] for d, o in self.places], 0


class _Tiles:
    """The keys of one repeat's tiles in the whole trace: the skipped tiles' own (`copies`,
    from 1), the recorded ones' (0: the repeated tile, negative: the tiles before it)."""

    def __init__(self, rep: Repeat, alias: dict[int, int]) -> None:
        self.rep = rep
        self.alias = alias
        self.copies: list[Sequence[int]] = [[]]  # copies[c]: the c-th skipped tile's keys

    def key(self, tile: int, offset: int) -> int:
        if tile > 0:
            return self.copies[tile][offset]
        serial = self.rep.first + tile * self.rep.new + offset
        return self.alias.get(serial, serial)

    def keys(self, tile: int) -> Sequence[int]:
        """The tile's keys by offset: the pattern's `new` storages."""
        if tile > 0:
            keys = self.copies[tile]  # each copy creates the pattern's storages, in order
            return keys if len(keys) == self.rep.new else [keys[o] for o in range(self.rep.new)]
        first = self.rep.first + tile * self.rep.new
        alias = self.alias
        return [alias.get(s, s) for s in range(first, first + self.rep.new)]


def _renamed(events: list[tuple[int, int]], alias: dict[int, int]) -> Iterable[tuple[int, int]]:
    if not alias or not events:
        return events
    serials, nbytes = zip(*events)
    return zip(map(alias.get, serials, serials), nbytes)
