"""One simulated step's peaks by segment and their extrapolation to a model's depth.

A StepEstimate is a peak with what was alive at it by category (CATEGORIES). A simulated step
of L layers is cut in three segments (Segments); the peaks of the head and tail segments grow
affinely with the number of layers, so two short steps (SHORT and SHORT + 1 layers: the first
simulated, the second built from its record where it shows it, plan/sim/deeper.py) give any
depth's (extrapolate).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

__all__ = ["CATEGORIES", "GROWING", "SHORT", "Segments", "StepEstimate", "extrapolate", "larger"]

MiB = 2**20
SHORT = 5  # the extrapolation's shorter step: 5 layers (6 built from it, or simulated)
CATEGORIES = ("weights", "grads", "optimizer", "checkpoints", "activations", "loss", "recompute")
# the categories whose bytes grow with the sequence (the others are the parameters' and the
# engines' buffers: plan/engines.py; "all_to_all": plan/model.py)
GROWING = ("checkpoints", "activations", "loss", "recompute", "all_to_all")


@dataclass(frozen=True)
class StepEstimate:
    """One stack's peak device bytes (tensors) and what was alive at the peak, by category;
    `reserve`: what PyTorch's CUDA caching allocator holds beyond the step's allocated peak
    (tensors and kernel buffers) over the whole step (plan/sim/caching_allocator.py);
    `attention`: what the attention backward's own buffers add to the tensors' peak at their
    moment (plan/device_overhead.py, Note [Attention backward buffers]); `reclaimable`: the part
    of `reserve` that blocks other streams still use hold on a card with room, which the
    allocator takes back (synchronizing) before an allocation that does not fit fails
    (caching_allocator.py: HOLD): a card fits the step when its figure less this does; all 0 on
    the CPU."""

    peak: int
    breakdown: dict[str, int]
    checkpointing: bool
    reserve: int = 0
    attention: int = 0
    reclaimable: int = 0

    @property
    def full_card_reserve(self) -> int:
        """The reserve on a card with no room left: the held blocks taken back."""
        return self.reserve - self.reclaimable

    def as_json(self) -> dict[str, Any]:
        return {
            "peak_mib": round(self.peak / MiB, 1),
            "breakdown_mib": {k: round(v / MiB, 1) for k, v in self.breakdown.items()},
            "gradient_checkpointing": self.checkpointing,
        }


@dataclass(frozen=True)
class Segments:
    """Peaks of one simulated step of L layers: up to the end of layer L-2's backward ("head"),
    from there to the end of layer 2's backward ("middle"), and the rest ("tail"). The head
    and the tail each hold the end layers (which differ: the last layer's input stays on the
    device, the first layer's backward prefetches nothing) and one layer like the middle ones."""

    head: StepEstimate
    middle: StepEstimate
    tail: StepEstimate
    # the optimizer's step, apart from the tail's backward (None: no optimizer step): the two
    # grow by different amounts per layer, so each follows its own line in the depth
    optimizer: StepEstimate | None = None


def larger(s: Segments) -> StepEstimate:
    """The segment with the largest tensor peak, its `attention` raised to what the buffers
    add to it at the segments' largest peak with them."""
    parts = (s.head, s.middle, s.tail) + (() if s.optimizer is None else (s.optimizer,))
    top = max(parts, key=lambda e: e.peak)
    with_buffers = max(e.peak + e.attention for e in parts)
    return dataclasses.replace(top, attention=with_buffers - top.peak)


def extrapolate(
    short: StepEstimate, longer: StepEstimate, depth: int, *, short_layers: int = SHORT,
    period: int = 1,
) -> StepEstimate:  # fmt: skip
    """From `short_layers` and `short_layers` + `period` layers (SHORT and SHORT + 1 unless
    given; `depth` - `short_layers` a multiple of `period`) to `depth`, along the line through
    the two (the peak with the attention buffers too: both moments hold one more layer's (or
    period's) state per layer (period))."""

    def line(a: int, b: int) -> int:
        return a + (depth - short_layers) // period * (b - a)

    breakdown = {k: line(short.breakdown[k], longer.breakdown[k]) for k in CATEGORIES}
    # no reserve: the allocator's does not follow a line in the depth (which blocks a later
    # request finds free depends on every size before it); plan_model simulates every layer
    # where it counts the reserve
    peak = line(short.peak, longer.peak)
    with_buffers = line(short.peak + short.attention, longer.peak + longer.attention)
    return StepEstimate(peak, breakdown, short.checkpointing, 0, max(0, with_buffers - peak))
