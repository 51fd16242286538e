"""The measured mode of the planner: a real step of the model cut to a few layers, at a few
short lengths, beside the simulation of the same cut model; the difference carried to the whole
model and to its longest sequence.

What a simulation cannot see (kernel workspaces, the allocator's reserve, a mechanism not yet
modelled) shows as the difference between the measured and the simulated peak of the same cut
model at the same lengths. Fitted as a line in the sequence length (least squares through the
2-3 points: every per-step term the planner knows is affine in the tokens for a fixed tile
size), it is added to the whole model's simulated peak: the measured estimate. Its
`max_seq_len` and the simulation's are both reported, and the lower stands, named.

Invariant: the fit uses the measured points only; nothing is assumed about the card beyond them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tiledmlp.config.patch import PatchConfig
from tiledmlp.config.plan import StepSpec
from tiledmlp.plan.device_overhead import DeviceOverhead
from tiledmlp.plan.search import max_seq_len

__all__ = ["Correction", "MeasuredPoint", "fit_correction", "measured_max_seq_len"]

MiB = 2**20


@dataclass(frozen=True)
class MeasuredPoint:
    """One length of the cut model: its measured peak and the simulation's, in bytes."""

    seq_len: int
    measured: int
    simulated: int


@dataclass(frozen=True)
class Correction:
    """measured - simulated ~= constant + per_token x seq_len (bytes), fitted on `points`."""

    constant: float
    per_token: float
    points: tuple[MeasuredPoint, ...]

    def at(self, seq_len: int) -> int:
        return int(self.constant + self.per_token * seq_len)

    def as_json(self) -> dict[str, Any]:
        return {
            "lengths": [p.seq_len for p in self.points],
            "measured_mib": [round(p.measured / MiB, 1) for p in self.points],
            "simulated_mib": [round(p.simulated / MiB, 1) for p in self.points],
            "difference_mib": round(self.constant / MiB, 1),
            "difference_bytes_per_token": round(self.per_token, 1),
        }


def fit_correction(points: list[MeasuredPoint]) -> Correction:
    """The least-squares line of (measured - simulated) against the sequence length.

    Raises:
        ValueError: fewer than two distinct lengths.
    """
    lengths = {p.seq_len for p in points}
    if len(lengths) < 2:
        raise ValueError(
            f"the measured mode needs at least two distinct lengths, got {sorted(lengths)}"
        )
    n = len(points)
    xs = [float(p.seq_len) for p in points]
    ys = [float(p.measured - p.simulated) for p in points]
    mx, my = sum(xs) / n, sum(ys) / n
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum(
        (x - mx) ** 2 for x in xs
    )
    return Correction(my - slope * mx, slope, tuple(points))


def measured_max_seq_len(
    config: Any,
    budget_bytes: int,
    correction: Correction,
    *,
    step: StepSpec,
    patch: PatchConfig | None,
    overhead: DeviceOverhead | None,
    simulated: int,
    known_peaks: dict[int, int] | None = None,
    **options: Any,
) -> dict[str, Any]:
    """The longest sequence by the measured estimate beside the simulation's (`simulated`,
    already searched, its estimates in `known_peaks`: reused, not simulated again); the lower
    stands.

    Returns:
        {"max_seq_len_simulated", "max_seq_len_measured", "max_seq_len", "standing":
        "simulated" | "measured"}.
    """
    measured = max_seq_len(
        config,
        budget_bytes,
        step=step,
        patch=patch,
        hint=simulated or None,
        extra_bytes_per_token=correction.per_token,
        extra_bytes=int(correction.constant),
        overhead=overhead,
        known_peaks=known_peaks,
        **options,
    )
    standing = "measured" if measured < simulated else "simulated"
    return {
        "max_seq_len_simulated": simulated,
        "max_seq_len_measured": measured,
        "max_seq_len": min(measured, simulated),
        "standing": standing,
    }
