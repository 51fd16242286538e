"""The tiled LM-head loss reduced by "mean" or "sum" as the custom operator
tiledmlp::lm_head_loss, for torch.compile (listed in ops/library.py; tiled_cross_entropy calls it
while compiling).

The operator returns the loss and the gradients formed in the forward for an upstream gradient of
1 (as the eager scalar head does); its autograd formula scales them. The labels' checks and the
"mean" count read values, which only the operator's body sees.

Invariant: the same tile loop, math and results as the eager tiled_cross_entropy.
"""

from __future__ import annotations

from typing import Any

import torch

from tiledmlp.ops.loss.scoring import scalar_loss_parts
from tiledmlp.ops.tiling.operators import autograd_inside, operator_compute_dtype
from tiledmlp.ops.tiling.tiles import TilePlan

__all__ = ["lm_head_loss"]


@torch.library.custom_op("tiledmlp::lm_head_loss", mutates_args=())
def lm_head_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    mask: torch.Tensor | None,
    class_weight: torch.Tensor | None,
    splits: list[int],
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
    """tiled_cross_entropy reduced by "mean" or "sum" on hidden (tokens, hidden) and labels
    (tokens,) (mask: (tokens,) or None): [loss (float32 scalar), alpha (float32 scalar: the
    constant the formed gradients leave out), d(hidden), d(weight), d(bias)] for an upstream
    gradient of 1, an empty tensor for each gradient `needs` (hidden, weight, bias) leaves out.
    shift: 0, or the sequence length by which the flat labels are shifted per sequence. The
    labels are checked here, where their values exist."""
    with autograd_inside():
        return scalar_loss_parts(
            hidden, weight, bias, labels, mask, class_weight, TilePlan(tuple(splits)),
            ignore_index, reduction, shift, softcap, logit_scale, label_smoothing, z_loss,
            autocast_dtype, needs,
        )  # fmt: skip


@lm_head_loss.register_fake
def _lm_head_loss_fake(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    mask: torch.Tensor | None,
    class_weight: torch.Tensor | None,
    splits: list[int],
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
    cd = operator_compute_dtype(hidden, weight, autocast_dtype)
    wide = torch.promote_types(cd, torch.float32)
    scalar = hidden.new_empty((), dtype=wide)
    grads = [
        hidden.new_empty(0) if t is None or not need else torch.empty_like(t)
        for t, need in zip((hidden, weight, bias), needs)
    ]
    return [scalar, hidden.new_empty((), dtype=torch.float32), *grads]


def _loss_setup(ctx: Any, inputs: tuple[Any, ...], output: list[torch.Tensor]) -> None:
    _, alpha, dh, dw, db = output
    ctx.present = tuple(inputs[-1])
    ctx.save_for_backward(alpha, dh, dw, db)


def _loss_grad(ctx: Any, grads: list[torch.Tensor | None]) -> tuple[torch.Tensor | None, ...]:
    grad = grads[0]
    alpha, dh, dw, db = ctx.saved_tensors
    if grad is None:
        return (None,) * 16
    # the loss is linear in the upstream gradient: scaling the formed gradients is exact, in the
    # order the eager head multiplies (upstream x alpha, then the formed gradient by it)
    factor = grad * alpha
    formed = [g * factor if need else None for g, need in zip((dh, dw, db), ctx.present)]
    return (formed[0], formed[1], formed[2], *([None] * 13))


lm_head_loss.register_autograd(_loss_grad, setup_context=_loss_setup)
