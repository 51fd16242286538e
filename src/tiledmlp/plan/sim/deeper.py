"""The record of a step with one more decoder layer, built from a simulated step's record.

A model's middle decoder layers are alike: each runs the same code on the same shapes, so in a
simulated step the forward of layer L-2 creates and releases the same storages, in the same
order, as that of layer L-3, and so do their backwards. One more middle layer would do it once
more. `deeper` builds that step's record from the record of L layers (StepRecord,
step_record.py) without running it: the forward and the backward of layer L-2 appear twice, the
copy's storages under new serials, every release naming the storage that plays the same part in
the deeper step. It refuses (None) wherever the record does not show this (the cases:
docs/how-it-works/planner.md, "One more layer").

The work, in named steps: `_layout` finds the layers' windows and checks that the record shows
the deeper step (Note [Alike windows]); `_Layout` maps the deeper step's layers to the recorded
ones and names each recorded storage in the deeper step (Note [Renaming]); `_Writer` writes the
deeper step's trace part by part (Note [Held blocks at phase changes]).

Invariant: where it answers, the record is the one the step of L + 1 layers records (as
tests/plan/sim/test_deeper.py checks stack by stack against simulating it).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tiledmlp.plan.sim.caching_allocator import FREE, HOLD
from tiledmlp.plan.sim.periodic_tiles import Repeat
from tiledmlp.plan.sim.step_record import StepRecord

__all__ = ["deeper"]

Kind = str  # "F" (a layer's forward) or "B" (its backward)


@dataclasses.dataclass(frozen=True)
class _Window:
    """A layer's forward or backward in the trace: events [begin, end), serials [first, stop)."""

    kind: Kind
    layer: int
    begin: int
    end: int
    first: int
    stop: int

    def offset(self, serial: int) -> int:
        """A serial's place: from the start in a forward, from the end in a backward."""
        return serial - self.first if self.kind == "F" else self.stop - serial

    def at(self, offset: int) -> int | None:
        serial = self.first + offset if self.kind == "F" else self.stop - offset
        return serial if self.first <= serial < self.stop else None


def _windows(r: StepRecord) -> list[_Window] | None:
    """The layers' windows in trace order; None where their serials are not contiguous."""
    layers = len(r.forward_starts)
    spans = [("F", i, r.forward_starts[i], r.forward_starts[i + 1] if i + 1 < layers
              else r.forward_end) for i in range(layers)]  # fmt: skip
    ends = r.backward_ends
    spans += [("B", i, ends[i + 1] if i + 1 < layers else r.backward_start, ends[i])
              for i in reversed(range(layers))]  # fmt: skip
    out = []
    for kind, layer, begin, end in spans:
        if not 0 <= begin <= end <= len(r.trace):
            return None
        created = [s for s, b in r.trace[begin:end] if b != FREE and b != HOLD]
        first = created[0] if created else _first_serial_from(r, begin)
        if created != list(range(first, first + len(created))):
            return None
        out.append(_Window(kind, layer, begin, end, first, first + len(created)))
    return out


def _first_serial_from(r: StepRecord, index: int) -> int:
    """The serial the next storage created at or after trace `index` gets."""
    for s, b in r.trace[index:]:
        if b != FREE and b != HOLD:
            return s
    return len(r.phase_of)


# Note [Alike windows]
# The deeper step repeats layer L-2's forward and backward. That is its step only where layer
# L-2 does what layer L-3 does: the same events in the same order, each creation of the same
# kind (phase, bytes, a buffer, a gradient, a layer input) and each release naming the storage
# that plays the same part (_Place: relative to the releasing layer; _Outside: a storage of no
# layer, by serial), with the same tile windows at the same places. Layer L-2 may release a
# storage of a layer as far back as layer L-3's place has none (an offloader that sends each
# layer's saved input to the host once the next layer saves its own releases, in layer i's
# forward, a storage made by layer i-2; layer 1's counterpart is the embeddings' output, no
# layer's): layer L-3 is alike where it does all the rest (_as_seen_from). A phase change or a tile
# window that crosses a window's bounds, or an optimizer step on the device, breaks the layers'
# likeness: refused.


@dataclasses.dataclass(frozen=True)
class _Place:
    """A storage of a layer, named from the layer of the window that releases it: the kind of
    window it was created in, how many layers away, and its offset there (_Window.offset)."""

    kind: Kind
    layers_away: int
    offset: int


@dataclasses.dataclass(frozen=True)
class _Outside:
    """A storage created outside the layers, by its serial."""

    serial: int


@dataclasses.dataclass(frozen=True)
class _Release:
    """A release event (FREE, or HOLD for another stream) of the storage `names`."""

    marker: int
    names: _Place | _Outside


@dataclasses.dataclass(frozen=True)
class _Creation:
    """A creation event: its bytes and what the storage is."""

    nbytes: int
    phase: str
    buffer: bool
    grad: bool
    checkpoint_input: bool


@dataclasses.dataclass(frozen=True)
class _TileWindow:
    """A tile window (periodic_tiles.py's Repeat) placed relative to its layer's window."""

    begin: int
    end: int
    first: int
    new: Any
    times: Any


# a window's events and tile windows, named relative to it (_signature)
_Signature = tuple[tuple[_Release | _Creation, ...], tuple[_TileWindow, ...]]


def _owners(wins: list[_Window]) -> dict[int, _Window]:
    """Each serial created in a layer's window -> that window."""
    return {s: w for w in wins for s in range(w.first, w.stop)}


def _signature(r: StepRecord, w: _Window, owner: dict[int, _Window]) -> _Signature:
    """The events and tile windows of window `w`, each named relative to it (Note [Alike
    windows]): what must match between two alike layers."""

    def named(serial: int) -> _Place | _Outside:
        o = owner.get(serial)
        if o is None:
            return _Outside(serial)
        return _Place(o.kind, o.layer - w.layer, o.offset(serial))

    events = tuple(
        _Release(b, named(s))
        if b in (FREE, HOLD)
        else _Creation(b, r.phase_of[s], s in r.buffers, s in r.grads, s in r.checkpoint_inputs)
        for s, b in r.trace[w.begin : w.end]
    )
    tiles = tuple(
        _TileWindow(rep.begin - w.begin, rep.end - w.begin, rep.first - w.first, rep.new,
                    rep.times)
        for rep in r.repeats
        if w.begin <= rep.begin and rep.end <= w.end
    )  # fmt: skip
    return events, tiles


def _as_seen_from(sig: _Signature, layer: int) -> _Signature | None:
    """A window's signature (_signature) as layer `layer`'s place would show it: without the
    releases of storages of layers before the first (Note [Alike windows]), the tile windows
    moved back over them; None where one falls inside a tile window."""
    events, tiles = sig
    unseen = [
        i
        for i, e in enumerate(events)
        if isinstance(e, _Release)
        and isinstance(e.names, _Place)
        and layer + e.names.layers_away < 0
    ]
    if not unseen:
        return sig
    if any(t.begin <= i < t.end for i in unseen for t in tiles):
        return None

    def moved(index: int) -> int:
        return index - sum(i < index for i in unseen)

    kept = tuple(e for i, e in enumerate(events) if i not in set(unseen))
    return kept, tuple(
        dataclasses.replace(t, begin=moved(t.begin), end=moved(t.end)) for t in tiles
    )


def _crosses(r: StepRecord, wins: list[_Window]) -> bool:
    """Whether a phase change falls inside a layer's window, or a tile window crosses one's
    bounds (Note [Alike windows])."""
    inside = [(w.begin, w.end) for w in wins]
    if any(b < index < e for index, _count in r.flushes for b, e in inside):
        return True
    return any(
        not any(b <= rep.begin and rep.end <= e for b, e in inside)
        and any(b < rep.end and rep.begin < e for b, e in inside)
        for rep in r.repeats
    )


def _steps_on_device(r: StepRecord) -> bool:
    """Whether an optimizer step created storages on the device: its (foreach) operations
    touch every layer's parameters at once, so its requests are not the layers' own and the
    deeper step's are not these."""
    return any(r.phase_of[s] == "optimizer" for s, b in r.trace if b not in (FREE, HOLD))


# Note [Renaming]
# The deeper step has `total` = L + more layers: its layers up to L-2 are the recorded ones,
# L-1 .. L-2+more copies of layer L-2 (their storages under fresh serials, after the recorded
# ones), and the last more-shifted ones the recorded L-1 (`source` maps each to the recorded
# layer it repeats). A release in new layer J's window names the storage d layers from J
# where the record names the one d layers from source[J], at the same offset in the window of
# the same kind; a release outside the layers names the same layer's storage, shifted past the
# copies (a storage of the copied layer released outside the layers names no one: refused).


@dataclasses.dataclass
class _Layout:
    """The deeper step's layers over the record's (Note [Renaming])."""

    record: StepRecord
    win: dict[tuple[Kind, int], _Window]
    owner: dict[int, _Window]
    copied: int
    more: int
    total: int
    source: list[int]
    copy_first: dict[tuple[Kind, int], int]  # a copy's window -> its first fresh serial
    made: dict[tuple[Kind, int], _Window] = dataclasses.field(default_factory=dict)

    def new_window(self, kind: Kind, layer: int) -> _Window:
        """The deeper step's window of `kind` for its `layer` (made once, asked per event)."""
        if (kind, layer) not in self.made:
            w = self.win[kind, self.source[layer]]
            if (kind, layer) not in self.copy_first:
                self.made[kind, layer] = dataclasses.replace(w, layer=layer)
            else:
                first = self.copy_first[kind, layer]
                self.made[kind, layer] = dataclasses.replace(
                    w, layer=layer, first=first, stop=first + w.stop - w.first
                )
        return self.made[kind, layer]

    def renamed(self, serial: int, layer: int | None) -> int | None:
        """The deeper step's serial for a recorded one named in new layer `layer`'s window
        (None: outside the layers); None where it names no storage."""
        o = self.owner.get(serial)
        if o is None:
            return serial
        if layer is None:  # outside the layers: the same layer, unless it is the copied one
            if o.layer == self.copied:
                return None
            target = o.layer if o.layer < self.copied else o.layer + self.more
        else:
            target = layer + o.layer - self.source[layer]
        if not 0 <= target < self.total:
            return None
        return self.new_window(o.kind, target).at(o.offset(serial))

    def is_copy(self, layer: int | None) -> bool:
        return layer is not None and self.copied < layer <= self.copied + self.more


def _layout(r: StepRecord, more: int) -> _Layout | None:
    """The deeper step's layout, or None where the record does not show it (module
    docstring, Note [Alike windows])."""
    layers = len(r.forward_starts)
    if layers < 4 or len(r.backward_ends) != layers or more < 1 or _steps_on_device(r):
        return None
    wins = _windows(r)
    if wins is None or _crosses(r, wins):
        return None
    win = {(w.kind, w.layer): w for w in wins}
    owner = _owners(wins)
    copied = layers - 2  # the middle layer repeated; layer copied - 1 is like it
    for kind in ("F", "B"):
        seen = _as_seen_from(_signature(r, win[kind, copied], owner), copied - 1)
        if seen != _signature(r, win[kind, copied - 1], owner):
            return None
    total = layers + more
    source = [min(j, copied) if j <= copied + more else j - more for j in range(total)]
    fresh = len(r.phase_of)  # the copies' serials follow the recorded ones
    copy_first: dict[tuple[Kind, int], int] = {}
    for c in range(copied + 1, copied + more + 1):
        for kind in ("F", "B"):
            w = win[kind, copied]
            copy_first[kind, c] = fresh
            fresh += w.stop - w.first
    return _Layout(r, win, owner, copied, more, total, source, copy_first)


# Note [Held blocks at phase changes]
# At each phase change the tracker releases the blocks held for another stream
# (phase_tracker.py); the record notes where and how many (`flushes`). The deeper step holds
# other blocks (those of its own layers), so the writer keeps the blocks it has held since the
# last phase change and releases those instead, skipping the recorded releases.


class _Writer:
    """The deeper step's trace, written part by part from the record (deeper)."""

    def __init__(self, layout: _Layout) -> None:
        self.layout = layout
        self.trace: list[tuple[int, int]] = []
        self.repeats: list[Repeat] = []
        self.held: list[int] = []
        self.flushes: list[tuple[int, int]] = []
        self.flush_at = dict(layout.record.flushes)
        self.copies: dict[int, list[int]] = {}  # recorded serial of the copied layer -> copies

    def flush(self, index: int) -> int:
        """The deeper step's held blocks released at the phase change recorded at `index`
        (Note [Held blocks at phase changes]); the recorded releases' count (skipped)."""
        self.flushes.append((len(self.trace), len(self.held)))
        self.trace.extend((s, FREE) for s in self.held)
        self.held.clear()
        return self.flush_at[index]

    def emit(self, begin: int, end: int, layer: int | None) -> bool:
        """The recorded events [begin, end) as new layer `layer`'s (None: outside the layers),
        with the tile windows among them; False where a release names no storage."""
        placed: dict[int, int] = {}  # recorded index -> index in the deeper trace
        i = begin
        while i < end:
            if i in self.flush_at and layer is None and i not in placed:
                placed[i] = len(self.trace)
                skip = self.flush(i)
                if skip:
                    i += skip
                    continue
            placed[i] = len(self.trace)
            event = self._event(i, layer)
            if event is None:
                return False
            self.trace.append(event)
            i += 1
        if layer is None and end in self.flush_at and end not in placed:
            placed[end] = len(self.trace)
            self.flush(end)  # a phase change at the part's end (none of its releases recorded)
        self._tile_windows(begin, end, placed, self.layout.is_copy(layer))
        return True

    def _event(self, i: int, layer: int | None) -> tuple[int, int] | None:
        """Recorded event `i` in new layer `layer`'s window (None: outside the layers): a
        release renamed (None where it names no storage), a creation under a copy's serial."""
        s, b = self.layout.record.trace[i]
        if b in (FREE, HOLD):
            t = self.layout.renamed(s, layer)
            if t is None:
                return None
            if b == HOLD:
                self.held.append(t)
            return t, b
        if not self.layout.is_copy(layer):
            return s, b
        assert layer is not None  # is_copy
        o = self.layout.owner[s]
        t = s - o.first + self.layout.new_window(o.kind, layer).first
        self.copies.setdefault(s, []).append(t)
        return t, b

    def _tile_windows(self, begin: int, end: int, placed: dict[int, int], copy: bool) -> None:
        """The tile windows recorded within [begin, end), at their places in the deeper trace
        (a copy's under its first storage's fresh serial)."""
        for rep in self.layout.record.repeats:
            if begin <= rep.begin and rep.end <= end:
                first = self.copies[rep.first][-1] if copy else rep.first
                self.repeats.append(
                    dataclasses.replace(
                        rep, begin=placed[rep.begin], end=placed[rep.end - 1] + 1, first=first
                    )
                )

    def with_copies(self, serials: set[Any]) -> set[Any]:
        """`serials` with the copies of those in the copied layer."""
        return serials | {t for s in serials if s in self.copies for t in self.copies[s]}


def deeper(r: StepRecord, more: int = 1) -> StepRecord | None:
    """The record of the step with `more` more middle decoder layers (module docstring), or
    None where this record does not show it."""
    layout = _layout(r, more)
    if layout is None:
        return None
    win, source, total = layout.win, layout.source, layout.total
    out = _Writer(layout)
    # the parts in trace order: before the layers, their forwards, the loss, their backwards
    # (last layer first), after them
    forward_starts: list[int] = []
    backward_ends: list[int] = [0] * total
    ok = out.emit(0, win["F", 0].begin, None)
    for j in range(total):
        forward_starts.append(len(out.trace))
        ok = ok and out.emit(win["F", source[j]].begin, win["F", source[j]].end, j)
    forward_end = len(out.trace)
    ok = ok and out.emit(r.forward_end, r.backward_start, None)
    backward_start = len(out.trace)
    for j in reversed(range(total)):
        ok = ok and out.emit(win["B", source[j]].begin, win["B", source[j]].end, j)
        backward_ends[j] = len(out.trace)
    ok = ok and out.emit(win["B", 0].end, len(r.trace), None)
    if not ok:
        return None
    # the segments close as in the deeper step (fake_step.py): at the gradients of the inputs
    # of its layers L-2 and 2, and at the end
    marks = sorted([backward_ends[total - 2], backward_ends[2], len(out.trace)])
    out.repeats.sort(key=lambda rep: rep.begin)
    return StepRecord(
        trace=out.trace,
        phase_of=_extended(r.phase_of, layout),
        bytes_of=_extended(r.bytes_of, layout),
        buffers=out.with_copies(r.buffers),
        marks=marks,
        flushes=out.flushes,
        repeats=out.repeats,
        grads=out.with_copies(r.grads),
        checkpoint_inputs=out.with_copies(r.checkpoint_inputs),
        forward_starts=forward_starts,
        forward_end=forward_end,
        backward_start=backward_start,
        backward_ends=backward_ends,
    )


def _extended(per_serial: list[Any], layout: _Layout) -> list[Any]:
    """A per-serial list (phase_of, bytes_of) with the copies' fresh serials appended, in the
    order _layout gave them (each copy's forward, then its backward)."""
    out = list(per_serial)
    for _copy in range(layout.more):
        for kind in ("F", "B"):
            w = layout.win[kind, layout.copied]
            out += per_serial[w.first : w.stop]
    return out
