"""What a simulated step recorded (StepRecord) and the segments' peaks it implies.

A PhaseTracker (phase_tracker.py) sees a step's storages come and go; its record is the
allocation trace, each storage's phase and bytes, where the segments were closed and where the
decoder layers' forward and backward began and ended. `segment_peaks` reads each segment's peak
and what was alive at it from the trace alone, as the tracker counted them while the step ran,
so that a record built without running a step (deeper.py) gives its figures the same way.

Invariant: on a tracker's own record, segment_peaks gives the tracker's segments and peaks with
the kernels' buffers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tiledmlp.plan.sim.caching_allocator import FREE, HOLD
from tiledmlp.plan.sim.periodic_tiles import Repeat

__all__ = ["StepRecord", "optimizer_split", "segment_peaks"]


@dataclass
class StepRecord:
    """One simulated step's record.

    Attributes:
        trace: (serial, bytes) on creation, (serial, FREE) on release, (serial, HOLD) where a
            block stays held for another stream (phase_tracker.py), in order.
        phase_of: each serial's phase.
        bytes_of: each serial's bytes.
        buffers: the serials that are kernels' own buffers, not tensors.
        marks: where each segment was closed (an index into `trace`).
        flushes: (index, count): at each phase change, the held blocks released there.
        repeats: the tile windows the trace holds once (periodic_tiles.py).
        grads: the serials of parameter gradients.
        checkpoint_inputs: the serials of the decoder layers' inputs.
        forward_starts: where each decoder layer's forward began.
        forward_end: where the decoder's forward ended (the loss began).
        backward_start: where the backward began, after its phase change.
        backward_ends: where the gradient of each decoder layer's input formed.
        optimizer_start: where the optimizer's step began (its phase change), or None.
        params: the trainable parameters in the optimizer's order: (bytes, the decoder layer
            holding it or None), what an optimizer step's per-parameter requests follow.
    """

    trace: list[tuple[int, int]]
    phase_of: list[str]
    bytes_of: list[int]
    buffers: set[int]
    marks: list[int]
    flushes: list[tuple[int, int]]
    repeats: list[Repeat]
    grads: set[int | None]
    checkpoint_inputs: set[int | None]
    forward_starts: list[int]
    forward_end: int
    backward_start: int
    backward_ends: list[int]
    optimizer_start: int | None = None
    params: list[tuple[int, int | None]] = field(default_factory=list)


def optimizer_split(record: StepRecord) -> int | None:
    """Where the optimizer's step begins a segment of its own (segment_peaks' last), or None
    where the step has no optimizer step inside its last segment."""
    start, marks = record.optimizer_start, record.marks
    if start is None or not marks or start >= max(marks) or start in marks:
        return None
    return start


def segment_peaks(record: StepRecord) -> tuple[list[tuple[int, dict[int, int]]], list[int]]:
    """Per segment: (peak of the step's own storages, {serial: bytes} alive when it was first
    reached), and the peak with the kernels' buffers; as PhaseTracker counts them. The
    optimizer's step, where it has one (optimizer_split), is a segment of its own, the last."""
    live = peak = buffer_peak = 0
    alive: dict[int, int] = {}
    at_peak: dict[int, int] = {}
    segments: list[tuple[int, dict[int, int]]] = []
    buffer_peaks: list[int] = []
    split = optimizer_split(record)
    marks = sorted(record.marks if split is None else [*record.marks, split])
    m = 0
    buffers = record.buffers
    for i, (serial, nbytes) in enumerate(record.trace):
        while m < len(marks) and marks[m] == i:
            segments.append((peak, at_peak))
            buffer_peaks.append(max(peak, buffer_peak))
            peak, at_peak, buffer_peak = live, dict(alive), live
            m += 1
        if nbytes in (FREE, HOLD):
            live -= alive.pop(serial, 0)
        elif serial in buffers:
            buffer_peak = max(buffer_peak, live + nbytes)
        else:
            live += nbytes
            if nbytes:
                alive[serial] = nbytes
            if live > peak:
                peak, at_peak = live, dict(alive)
    for _ in marks[m:]:
        segments.append((peak, at_peak))
        buffer_peaks.append(max(peak, buffer_peak))
        peak, at_peak, buffer_peak = live, dict(alive), live
    return segments, buffer_peaks
