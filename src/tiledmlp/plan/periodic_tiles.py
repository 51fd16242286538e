"""Tile loops cut short on fake tensors: a loop's repeated tiles run once each.

Every tiled op (the MLPs, the loss, the norms, the decoder layers' blocks) walks its tiles
with `TilePlan.bounds()`; tiles of one size run the same code on the same shapes, so on fake
tensors (values are meaningless) they create and free the same storages in the same order
once the loop's first tiles (which allocate accumulators and output buffers, or keep the
first tile's output) are past. While `PeriodicTiles` is active, `bounds()` yields the tiles
one by one and watches each tile's window of the tracker's events (phase_tracker.py): from the
start of the tile's loop body to the next. As soon as two consecutive tiles of one size are
alike (the same allocations and phases, the same releases relative to the tile's first new
storage and of the same bytes, the same live bytes at their start, each tile leaving the live
bytes it found, and no segment closed), it skips to the last tile of that size. A skipped tile
would start from the state the two alike tiles started from and run the same code on the same
shapes: it would repeat their window exactly, so the step's peak, the moment it is first
reached, what is alive then and its categories are those of the whole loop. (The product's
loops branch on the tile's index only for the first tile.)

The allocation trace itself is shorter: the caching allocator's replay (caching_allocator.py)
needs every tile's events, so a step whose allocator reserve counts is never cut.

Invariant: outside the context `TilePlan.bounds` is the product's own; inside, a tile is
skipped only after two tiles of its size were seen alike.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from tiledmlp.ops.tiling.tiles import TilePlan
from tiledmlp.plan.caching_allocator import FREE
from tiledmlp.plan.phase_tracker import PhaseTracker

__all__ = ["PeriodicTiles", "cut_peak_bytes"]


class PeriodicTiles:
    """While active, tile loops skip the tiles that repeat (module docstring); `cut` says
    whether any tile was skipped."""

    def __init__(self, tracker: PhaseTracker) -> None:
        self.tracker = tracker
        self.cut = False
        self._original: Any = None

    def __enter__(self) -> PeriodicTiles:
        self._original = TilePlan.bounds
        periodic = self

        def bounds(plan: TilePlan) -> Iterator[tuple[int, int]]:
            return periodic._bounds(plan)

        # on the class: the plans are made inside the product's ops, per call; restored on exit
        TilePlan.bounds = bounds  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        TilePlan.bounds = self._original  # type: ignore[method-assign]

    def _bounds(self, plan: TilePlan) -> Iterator[tuple[int, int]]:
        sizes = plan.sizes
        offsets = [0]
        for s in sizes:
            offsets.append(offsets[-1] + s)
        last = list(range(len(sizes)))  # last[i]: the last tile of i's run of equal sizes
        for i in range(len(sizes) - 2, -1, -1):
            if sizes[i] == sizes[i + 1]:
                last[i] = last[i + 1]
        before: tuple[Any, ...] | None = None  # the previous tile's window, in this run
        i = 0
        while i < len(sizes):
            t = self.tracker
            begin = (len(t.trace), t.live, len(t.segments), len(t.phase_of))
            yield offsets[i], offsets[i + 1]
            window = self._window(begin)
            if window is not None and window == before and i + 1 < last[i]:
                self.cut = True  # tiles i + 1 .. last[i] - 1 would repeat tiles i - 1 and i
                i, before = last[i], None
                continue
            before = window if i + 1 < len(sizes) and sizes[i + 1] == sizes[i] else None
            i += 1

    def _window(self, begin: tuple[int, int, int, int]) -> tuple[Any, ...] | None:
        """The tile's events since `begin`, comparable between tiles: (bytes, phase) per new
        storage, (FREE, serial relative to the tile's first new storage, bytes) per release,
        with the live bytes at its start; None for a tile that is not a period (it changed the
        live bytes, closed a segment, or saw no event)."""
        t = self.tracker
        trace_at, live, segments, first = begin
        if t.live != live or len(t.segments) != segments or len(t.trace) == trace_at:
            return None
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
