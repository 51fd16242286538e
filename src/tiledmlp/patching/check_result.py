"""The verdict of a tiling check: each parameter's gradient error against the allowance its
dtype gives, the loss's, and the one-screen text and JSON record of them.

The rule (flash-attention's, docs/guides/check.md): a reference step runs in a wider dtype
(float64 by default); the tiled step's error against it must be at most FACTOR times the untiled
step's error in the same dtype, plus a floor of FLOOR_ULPS units of the dtype's rounding at the
gradient's scale (a gradient the untiled step happens to compute exactly still gets the
rounding that a different summation order costs). Where no reference can run (a model whose
kernels refuse float64, asked to check float32), the tiled step is compared with the untiled one
directly, within NO_REFERENCE_ULPS units of rounding at the gradient's scale.

Invariant: a check passes exactly when every parameter's and the loss's error is within its
allowance and every parameter with a gradient in one step has one in the other.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

__all__ = [
    "FACTOR",
    "FLOOR_ULPS",
    "NO_REFERENCE_ULPS",
    "CheckResult",
    "Compared",
    "StepCost",
    "compare",
]

#: the tiled step's error may be this many times the untiled step's (flash-attention's rule)
FACTOR = 2.0
#: ... plus this many units of rounding (the dtype's eps) at the reference's scale
FLOOR_ULPS = 4.0
#: without a reference: the tiled step may differ from the untiled one by this many units
NO_REFERENCE_ULPS = 64.0


@dataclass(frozen=True)
class Compared:
    """One parameter's (or the loss's) gradient in the tiled step against the reference.

    Attributes:
        name: the parameter's qualified name ("loss" for the loss).
        max_abs: max |tiled - reference|.
        rel: max_abs / max |reference| (0 where the reference is all zeros).
        untiled_max_abs: max |untiled - reference| (the dtype's own error).
        allowed: FACTOR x untiled_max_abs + FLOOR_ULPS x eps x max |reference| (without a
            reference: NO_REFERENCE_ULPS x eps x max |untiled|).
        missing: why the comparison could not be made (a gradient in one step only), or None.
    """

    name: str
    max_abs: float
    rel: float
    untiled_max_abs: float
    allowed: float
    missing: str | None = None

    @property
    def ok(self) -> bool:
        return self.missing is None and self.max_abs <= self.allowed

    @property
    def ratio(self) -> float:
        """max_abs / allowed: above 1 fails (inf for a missing gradient)."""
        if self.missing is not None:
            return math.inf
        return (
            self.max_abs / self.allowed
            if self.allowed > 0
            else (0.0 if not self.max_abs else math.inf)
        )


def compare(
    name: str, tiled: torch.Tensor | None, untiled: torch.Tensor | None,
    reference: torch.Tensor | None, dtype: torch.dtype,
) -> Compared:  # fmt: skip
    """`tiled` against `reference` (None: `untiled` is the reference), in float64.

    Args:
        name: what is compared.
        tiled, untiled, reference: the same tensor from the three steps (None: no gradient).
        dtype: the dtype the steps ran in (its eps sets the floor).
    """
    ref = untiled if reference is None else reference
    have = {"tiled": tiled is not None, "untiled": untiled is not None}
    if have["tiled"] != have["untiled"] or (ref is None) != (untiled is None):
        missing = (
            "no gradient in the tiled step"
            if not have["tiled"]
            else "a gradient only in the tiled step"
        )
        return Compared(name, math.inf, math.inf, 0.0, 0.0, missing)
    if tiled is None or untiled is None or ref is None:
        return Compared(name, 0.0, 0.0, 0.0, 0.0)
    if tiled.shape != ref.shape:
        return Compared(
            name, math.inf, math.inf, 0.0, 0.0, f"shape {tuple(tiled.shape)} != {tuple(ref.shape)}"
        )
    r = ref.detach().double()
    err = (tiled.detach().double() - r).abs().max().item() if r.numel() else 0.0
    base = (untiled.detach().double() - r).abs().max().item() if r.numel() else 0.0
    scale = r.abs().max().item() if r.numel() else 0.0
    ulps = FLOOR_ULPS if reference is not None else NO_REFERENCE_ULPS
    allowed = FACTOR * base + ulps * torch.finfo(dtype).eps * scale
    return Compared(name, err, err / scale if scale > 0 else 0.0, base, allowed)


@dataclass(frozen=True)
class StepCost:
    """What one step (every micro-batch's forward and backward) cost.

    Attributes:
        seconds: its wall-clock time.
        peak_mib: its peak memory above what was held before it (CUDA: max_memory_allocated;
            CPU: the process's high-water mark, VmHWM); None where it cannot be read.
        peak_kind: what peak_mib measures.
    """

    seconds: float
    peak_mib: float | None
    peak_kind: str


@dataclass(frozen=True)
class CheckResult:
    """The verdict of tiledmlp.check: the patched step against the unpatched one.

    Attributes:
        passed: every parameter and the loss within its allowance (module docstring).
        report: the patch report's text (which modules were tiled, and how).
        tiles: tiled module -> tiles its last call ran.
        untiled_calls: tiled modules whose last call ran a single tile (their tiling was not
            exercised: raise the sequence length or the tile count).
        loss: the loss's comparison (untiled, tiled and reference values in `losses`).
        losses: {"untiled": ..., "tiled": ..., "reference": ...} (reference None when none ran).
        params: every parameter's comparison, worst first (by max_abs / allowed).
        failed: the names of the parameters (and "loss") out of their allowance.
        dtype, reference_dtype: the steps' dtype, the reference's (None: the untiled step).
        micro_batches: micro-batches per step (gradient accumulation).
        tokens: tokens per micro-batch on this process.
        engine: what ran the steps ("single", "ddp", "fsdp2").
        world_size: processes.
        untiled_cost, tiled_cost: each step's time and memory.
        notes: what the reader should know about how it ran (the default length, tile counts
            chosen for the check).
    """

    passed: bool
    report: str
    tiles: dict[str, int]
    untiled_calls: list[str]
    loss: Compared
    losses: dict[str, float | None]
    params: list[Compared]
    failed: list[str]
    dtype: str
    reference_dtype: str | None
    micro_batches: int
    tokens: int
    engine: str
    world_size: int
    untiled_cost: StepCost
    tiled_cost: StepCost
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready record (infinities as None)."""
        out = asdict(self)
        out["params"] = [_finite(asdict(c)) for c in self.params]
        out["loss"] = _finite(asdict(self.loss))
        return out

    def text(self, worst: int = 5) -> str:
        """The one-screen verdict."""
        verdict = "PASS" if self.passed else "FAIL"
        lines = [
            f"tiledmlp check: {verdict}  ({self.engine}, {self.world_size} process"
            f"{'es' if self.world_size != 1 else ''}, {self.dtype}, {self.micro_batches} "
            f"micro-batches of {self.tokens} tokens, reference "
            f"{self.reference_dtype or 'the untiled step'})",
            *self.notes,
            self.report,
        ]
        if self.tiles:
            counts = sorted(set(self.tiles.values()))
            span = str(counts[0]) if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"
            lines.append(f"tiles per call: {span}")
        if self.untiled_calls:
            lines.append(
                f"not exercised (1 tile): {', '.join(self.untiled_calls)}; raise --seq-len or "
                "--num-tiles"
            )
        ref = self.losses.get("reference")
        lines.append(
            f"loss: untiled {self.losses['untiled']:.6g}, tiled {self.losses['tiled']:.6g}"
            + (f", reference {ref:.6g}" if ref is not None else "")
            + f"; |tiled - ref| {self.loss.max_abs:.3g} (allowed {self.loss.allowed:.3g})"
        )
        bad = [c for c in self.params if not c.ok]
        shown = (bad or self.params)[: max(worst, len(bad[:20]))]
        lines.append(
            f"gradients: {len(self.params) - len(bad)}/{len(self.params)} parameters within "
            f"tolerance ({'failing' if bad else 'closest to their limit'}):"
        )
        for c in shown:
            if c.missing is not None:
                lines.append(f"  FAIL {c.name}: {c.missing}")
                continue
            lines.append(
                f"  {'ok  ' if c.ok else 'FAIL'} {c.name}: max abs {c.max_abs:.3g} (rel "
                f"{c.rel:.3g}), allowed {c.allowed:.3g} (untiled {c.untiled_max_abs:.3g})"
            )
        if len(bad) > len(shown):
            lines.append(f"  ... and {len(bad) - len(shown)} more failing")
        lines.append(f"untiled step: {_cost(self.untiled_cost)}")
        lines.append(f"tiled step:   {_cost(self.tiled_cost)}")
        if not self.passed:
            lines.append(
                f"FAIL: {', '.join(self.failed[:8])}{' ...' if len(self.failed) > 8 else ''}"
            )
        return "\n".join(lines)


def _cost(cost: StepCost) -> str:
    peak = "n/a" if cost.peak_mib is None else f"{cost.peak_mib:,.1f} MiB"
    return f"{cost.seconds:.2f} s, peak {peak} ({cost.peak_kind})"


def _finite(d: dict[str, Any]) -> dict[str, Any]:
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in d.items()}
