"""What tiled_cross_entropy scores, checked once, and the scalar loss as the custom operator
tiledmlp::lm_head_loss runs it (ops/library.py): the "mean" denominators of the whole input and
the gradients formed for an upstream gradient of 1.

Invariant: the same math objects and the same tile loop as the eager tiled_cross_entropy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tiledmlp.ops.loss.inputs import HeadInput, targets_of
from tiledmlp.ops.loss.tile_loop import HeadRun, run_scalar_parts
from tiledmlp.ops.loss.tile_math import CrossEntropyMath
from tiledmlp.ops.tiling.probe import absent
from tiledmlp.ops.tiling.state import AutocastState
from tiledmlp.ops.tiling.tiles import TilePlan

__all__ = ["Scoring", "cross_entropy_math", "scalar_loss_parts"]

_REDUCTIONS = ("mean", "sum", "none")


@dataclass(frozen=True)
class Scoring:
    """tiled_cross_entropy's options about the loss itself, checked once."""

    reduction: str
    label_smoothing: float
    z_loss: float
    return_aux: bool

    def __post_init__(self) -> None:
        if self.reduction not in _REDUCTIONS:
            raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {self.reduction!r}")
        if not 0.0 <= self.label_smoothing <= 1.0:
            raise ValueError(f"label_smoothing must be in [0, 1], got {self.label_smoothing!r}")
        z = self.z_loss
        if not (isinstance(z, int | float) and math.isfinite(z) and z >= 0):
            raise ValueError(f"z_loss must be a coefficient >= 0, got {z!r}")


def cross_entropy_math(
    scoring: Scoring,
    head: HeadInput,
    targets: torch.Tensor,
    counted: torch.Tensor,
    weight: torch.Tensor | None,
    vocab: int,
) -> CrossEntropyMath:
    """The per-tile math, with the "mean" denominators of the whole input."""
    class_weight = None if weight is None else weight.detach().to(head.wide)
    # Planning on fake tensors has no values: every token counts (the scale changes no memory).
    # Only "mean" and the accuracy read the counts: other reductions skip their device sync.
    if absent(counted) or (scoring.reduction != "mean" and not scoring.return_aux):
        count, weight_total = counted.numel(), float(counted.numel())
    else:
        count = int(counted.sum().item())
        weight_total = (
            float(count)
            if class_weight is None
            else float(class_weight[torch.where(counted, targets, 0)][counted].sum())
        )
    return CrossEntropyMath(
        reduction=scoring.reduction,
        label_smoothing=float(scoring.label_smoothing),
        class_weight=class_weight,
        z_loss=float(scoring.z_loss),
        weight_total=weight_total,
        count=count,
        vocab=vocab,
        num_tokens=head.hidden.shape[0],
        device=head.hidden.device,
        dtype=head.wide,
        want_argmax=scoring.return_aux,
    )


def scalar_loss_parts(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    mask: torch.Tensor | None,
    class_weight: torch.Tensor | None,
    plan: TilePlan,
    ignore_index: int,
    reduction: str,
    shift: int,
    softcap: float,
    logit_scale: float,
    label_smoothing: float,
    z_loss: float,
    autocast_dtype: torch.dtype | None,
    needs: list[bool],
) -> list[torch.Tensor]:
    """The body of tiledmlp::lm_head_loss (ops/library.py): the scalar head's forward, its
    gradients formed for an upstream gradient of 1, on real values.

    Args:
        hidden: (tokens, hidden); labels, mask: (tokens,); shift: 0, or the sequence length
            by which the flat labels are shifted per sequence.
    """
    scoring = Scoring(reduction, label_smoothing, z_loss, False)
    vocab = weight.shape[0]
    if shift:
        labels = labels.view(-1, shift)
        mask = None if mask is None else mask.view(-1, shift)
    targets, counted = targets_of(
        labels, mask, bool(shift), ignore_index, vocab, "tiled_cross_entropy"
    )
    autocast = AutocastState(
        device_type=hidden.device.type,
        enabled=autocast_dtype is not None,
        dtype=autocast_dtype if autocast_dtype is not None else torch.float32,
        cache_enabled=False,
    )
    cd = autocast.compute_dtype(hidden.dtype, weight.dtype) or hidden.dtype
    head = HeadInput(hidden, autocast, torch.promote_types(cd, torch.float32), plan)
    math_ = cross_entropy_math(scoring, head, targets, counted, class_weight, vocab)
    run = HeadRun(plan, targets, counted, softcap or None, 1.0, autocast, math_, logit_scale)
    run_scalar_parts(hidden, run, weight, bias, (needs[0], needs[1], needs[2]))
    empty = hidden.new_empty(0)
    alpha = torch.tensor(run.alpha, dtype=torch.float32, device=hidden.device)
    grads = [empty if g is None else g for g in (run.dh, run.dw, run.db)]
    return [math_.total().clone(), alpha, *grads]
