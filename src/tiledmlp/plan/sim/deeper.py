"""The record of a step with one more decoder layer, built from a simulated step's record.

A model's middle decoder layers are alike: each runs the same code on the same shapes, so in a
simulated step the forward of layer L-2 creates and releases the same storages, in the same
order, as that of layer L-3, and so do their backwards. One more middle layer would do it once
more. `deeper` builds that step's record from the record of L layers (StepRecord,
step_record.py) without running it: the forward and the backward of layer L-2 appear twice, the
copy's storages under new serials, and every release names the storage that plays the same part
in the deeper step: a storage of the layer d places before or after the releasing one (counted
from its window's start in the forward, from its end in the backward, where each layer's work
ends with the gradient of its input) is the one of the layer d places from it in the deeper
step. The held blocks released at each phase change are those of the deeper step.

It refuses (None) wherever the record does not show this: fewer than four layers, the two
middle layers' windows unlike (their events, with each release named relative to the layer
doing it), a release outside the layers of a storage of the copied layer, a tile window or a
phase change inside a layer's window across its bounds, a release that would name no storage,
or an optimizer step on the device (its foreach operations request memory for every layer's
parameters at once).

Invariant: where it answers, the record is the one the step of L + 1 layers records (as
tests/plan/test_deeper.py checks stack by stack against simulating it).
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


def deeper(r: StepRecord, more: int = 1) -> StepRecord | None:
    """The record of the step with `more` more middle decoder layers (module docstring), or
    None where this record does not show it."""
    layers = len(r.forward_starts)
    if layers < 4 or len(r.backward_ends) != layers or more < 1:
        return None
    # an optimizer's step touches every layer's parameters in each of its (foreach) operations:
    # its requests are not the layers' own, and the deeper step's are not these
    if any(r.phase_of[s] == "optimizer" for s, b in r.trace if b not in (FREE, HOLD)):
        return None
    wins = _windows(r)
    if wins is None:
        return None
    win = {(w.kind, w.layer): w for w in wins}
    owner: dict[int, _Window] = {}
    for w in wins:
        for s in range(w.first, w.stop):
            owner[s] = w
    copied = layers - 2  # the middle layer repeated; layer copied - 1 is like it
    inside = [(w.begin, w.end) for w in wins]
    for index, _count in r.flushes:
        if any(b < index < e for b, e in inside):
            return None
    for rep in r.repeats:
        if not any(b <= rep.begin and rep.end <= e for b, e in inside) and any(
            b < rep.end and rep.begin < e for b, e in inside
        ):
            return None

    def relative(w: _Window, serial: int) -> tuple[Any, ...]:
        o = owner.get(serial)
        if o is None:
            return ("abs", serial)
        return (o.kind, o.layer - w.layer, o.offset(serial))

    def signature(w: _Window) -> tuple[Any, ...]:
        events = tuple(
            (b, relative(w, s))
            if b in (FREE, HOLD)
            else (b, r.phase_of[s], s in r.buffers, s in r.grads, s in r.checkpoint_inputs)
            for s, b in r.trace[w.begin : w.end]
        )
        reps = tuple(
            (rep.begin - w.begin, rep.end - w.begin, rep.first - w.first, rep.new, rep.times)
            for rep in r.repeats
            if w.begin <= rep.begin and rep.end <= w.end
        )
        return events, reps

    for kind in ("F", "B"):
        if signature(win[kind, copied]) != signature(win[kind, copied - 1]):
            return None
    # the deeper step's layers: J -> the recorded layer whose windows it repeats; its layers
    # copied + 1 .. copied + more are the copies
    total = layers + more
    source = [min(j, copied) if j <= copied + more else j - more for j in range(total)]
    fresh = len(r.phase_of)  # the copies' serials follow the recorded ones
    copy_first: dict[tuple[Kind, int], int] = {}
    phase_of, bytes_of = list(r.phase_of), list(r.bytes_of)
    for c in range(copied + 1, copied + more + 1):
        for kind in ("F", "B"):
            w = win[kind, copied]
            copy_first[kind, c] = fresh
            phase_of += r.phase_of[w.first : w.stop]
            bytes_of += r.bytes_of[w.first : w.stop]
            fresh += w.stop - w.first

    made: dict[tuple[Kind, int], _Window] = {}  # new_window's answers (asked once per event)

    def new_window(kind: Kind, layer: int) -> _Window:
        if (kind, layer) not in made:
            w = win[kind, source[layer]]
            if (kind, layer) not in copy_first:
                made[kind, layer] = dataclasses.replace(w, layer=layer)
            else:
                first = copy_first[kind, layer]
                made[kind, layer] = dataclasses.replace(
                    w, layer=layer, first=first, stop=first + w.stop - w.first
                )
        return made[kind, layer]

    def renamed(serial: int, layer: int | None) -> int | None:
        """The deeper step's serial for a recorded one named in new layer `layer`'s window
        (None: outside the layers)."""
        o = owner.get(serial)
        if o is None:
            return serial
        if layer is None:  # outside the layers: the same layer, unless it is the copied one
            if o.layer == copied:
                return None
            target = o.layer if o.layer < copied else o.layer + more
        else:
            target = layer + o.layer - source[layer]
        if not 0 <= target < total:
            return None
        return new_window(o.kind, target).at(o.offset(serial))

    trace: list[tuple[int, int]] = []
    repeats: list[Repeat] = []
    held: list[int] = []
    flushes: list[tuple[int, int]] = []
    flush_at = dict(r.flushes)
    copies: dict[int, list[int]] = {}  # recorded serial of the copied layer -> its copies

    def flush(index: int) -> int:
        """The deeper step's held blocks released at the phase change recorded at `index`;
        the recorded releases' count (skipped)."""
        flushes.append((len(trace), len(held)))
        trace.extend((s, FREE) for s in held)
        held.clear()
        return flush_at[index]

    def emit(begin: int, end: int, layer: int | None) -> bool:
        """The recorded events [begin, end) as new layer `layer`'s (None: outside the layers),
        with the tile windows among them."""
        shift = layer is not None and copied < layer <= copied + more  # a copy: new serials
        placed: dict[int, int] = {}  # recorded index -> index in the deeper trace
        i = begin
        while i < end:
            if i in flush_at and layer is None and i not in placed:
                placed[i] = len(trace)
                skip = flush(i)
                if skip:
                    i += skip
                    continue
            placed[i] = len(trace)
            s, b = r.trace[i]
            if b in (FREE, HOLD):
                t = renamed(s, layer)
                if t is None:
                    return False
                if b == HOLD:
                    held.append(t)
            else:
                t = s
                if shift:
                    assert layer is not None
                    t = s - owner[s].first + new_window(owner[s].kind, layer).first
                    copies.setdefault(s, []).append(t)
            trace.append((t, b))
            i += 1
        if layer is None and end in flush_at and end not in placed:
            placed[end] = len(trace)
            flush(end)  # a phase change at the part's end (none of its releases recorded)
        for rep in r.repeats:
            if begin <= rep.begin and rep.end <= end:
                first = copies[rep.first][-1] if shift else rep.first
                repeats.append(
                    dataclasses.replace(
                        rep, begin=placed[rep.begin], end=placed[rep.end - 1] + 1, first=first
                    )
                )
        return True

    forward_starts: list[int] = []
    backward_ends: list[int] = [0] * total
    ok = emit(0, win["F", 0].begin, None)
    for j in range(total):
        forward_starts.append(len(trace))
        ok = ok and emit(win["F", source[j]].begin, win["F", source[j]].end, j)
    forward_end = len(trace)
    ok = ok and emit(r.forward_end, r.backward_start, None)
    backward_start = len(trace)
    for j in reversed(range(total)):
        ok = ok and emit(win["B", source[j]].begin, win["B", source[j]].end, j)
        backward_ends[j] = len(trace)
    ok = ok and emit(win["B", 0].end, len(r.trace), None)
    if not ok:
        return None
    # the segments close as in the deeper step (fake_step.py): at the gradients of the inputs
    # of its layers L-2 and 2, and at the end
    marks = sorted([backward_ends[total - 2], backward_ends[2], len(trace)])
    repeats.sort(key=lambda rep: rep.begin)

    def with_copies(serials: set[Any]) -> set[Any]:
        return serials | {t for s in serials if s in copies for t in copies[s]}

    return StepRecord(
        trace=trace,
        phase_of=phase_of,
        bytes_of=bytes_of,
        buffers=with_copies(r.buffers),
        marks=marks,
        flushes=flushes,
        repeats=repeats,
        grads=with_copies(r.grads),
        checkpoint_inputs=with_copies(r.checkpoint_inputs),
        forward_starts=forward_starts,
        forward_end=forward_end,
        backward_start=backward_start,
        backward_ends=backward_ends,
    )
