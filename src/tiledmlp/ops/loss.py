"""Tiled fused LM-head + cross-entropy: a long sequence's logits never exist at once.

For hidden states h (N tokens x hidden), LM-head weight W (V x hidden) and labels, the loss is
computed tile by tile: per tile the logits (n x V) are formed, soft-capped if asked, upcast to
float32, reduced to the tile's loss sum, and — when gradients are needed — turned at once into
the gradient with respect to the logits (softmax minus one-hot, scaled by the reduction), which
gives the tile's d(hidden) and its contribution to d(W). The backward only scales those by the
upstream gradient: no logits are recomputed.

Cost, with L = 2 * N * hidden * V: 3L FLOPs per training step (one GEMM for the logits, two for
the gradients), the same as the untiled computation; the alternative (recompute the logits in the
backward) costs 4L. Memory: a few (n x V) float32 tensors for one tile, plus d(hidden) (N x hidden)
and one float32 accumulator for d(W), instead of several (N x V) tensors.

Invariants: d(W) (and d(bias)) is summed over tiles in one float32 buffer and returned once; the
mean is over the non-ignored tokens of the whole input (a tile with no valid token contributes
exactly zero); the numerics follow the untiled path: logits in the compute dtype, soft-capping in
the compute dtype, cross-entropy in float32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from tiledmlp.ops.grads import GradSlot, Scratch
from tiledmlp.ops.guards import refuse_double_backward
from tiledmlp.ops.policy import validate_policy
from tiledmlp.ops.probe import absent
from tiledmlp.ops.state import AutocastState
from tiledmlp.ops.tiles import TilePlan, split_by_tile_tokens, split_even

__all__ = ["shift_labels", "tiled_cross_entropy"]

_REDUCTIONS = ("mean", "sum")


def shift_labels(labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Causal-LM targets: position t predicts labels[..., t + 1]; the last position is ignored.

    Args:
        labels: (batch, seq) or (seq,) integer labels.
    """
    pad = torch.full(
        (*labels.shape[:-1], 1), ignore_index, dtype=labels.dtype, device=labels.device
    )
    return torch.cat([labels[..., 1:], pad], dim=-1)


@dataclass
class _LossRun:
    plan: TilePlan
    ignore_index: int
    reduction: str
    softcap: float | None
    autocast: AutocastState
    dh: torch.Tensor | None = None
    dw: torch.Tensor | None = None
    db: torch.Tensor | None = None


def _softcap(z: torch.Tensor, cap: float) -> torch.Tensor:
    # The same three ops, in the same dtype, as Gemma 2's final-logit soft-capping.
    return torch.tanh(z / cap) * cap


class TiledCrossEntropyFunction(torch.autograd.Function):
    """Inputs: hidden (tokens, hidden), targets (tokens,), a _LossRun, weight, bias or None.
    Output: the reduced loss (float32 scalar)."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        targets: torch.Tensor,
        run: _LossRun,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
    ) -> torch.Tensor:
        want_grad = any(ctx.needs_input_grad[i] for i in (0, 3, 4))
        loss = _loss_and_grads(hidden, targets, run, weight, bias, want_grad, ctx.needs_input_grad)
        ctx.run = run
        return loss

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        refuse_double_backward("tiled_cross_entropy")
        run: _LossRun = ctx.run
        # The gradients were formed in the forward for an upstream gradient of 1; the loss is
        # linear in it, so scaling is exact. Out of place, so a retained graph can be
        # differentiated again.
        dh, dw, db = (None if g is None else g * grad.to(g.dtype) for g in (run.dh, run.dw, run.db))
        return dh, None, None, dw, db


def _loss_and_grads(
    hidden: torch.Tensor,
    targets: torch.Tensor,
    run: _LossRun,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    want_grad: bool,
    needs: tuple[bool, ...] = (True, False, False, True, True),
) -> torch.Tensor:
    cd = run.autocast.compute_dtype(hidden.dtype, weight.dtype) or hidden.dtype
    if (
        run.autocast.compute_dtype(hidden.dtype, weight.dtype) is None
        and weight.dtype != hidden.dtype
    ):
        raise TypeError(
            f"tiled_cross_entropy: hidden_states have dtype {hidden.dtype} but the LM-head weight "
            f"has {weight.dtype}; expected them to match. Cast one, or run under torch.autocast."
        )
    w = weight.to(cd)
    b = None if bias is None else bias.to(cd)
    valid = targets != run.ignore_index
    # Planning on fake tensors has no values: every token counts (the scale changes no memory).
    count = valid.numel() if absent(valid) else int(valid.sum().item())
    # mean over the valid tokens of the whole input; with none valid, torch's mean is 0/0 = nan
    scale = 1.0 / count if run.reduction == "mean" and count else 1.0
    total = torch.zeros((), dtype=torch.promote_types(cd, torch.float32), device=hidden.device)
    scratch = Scratch()
    need_h, need_w, need_b = want_grad and needs[0], want_grad and needs[3], want_grad and needs[4]
    slot_w = GradSlot(weight, cd, scratch) if need_w else None
    slot_b = GradSlot(bias, cd, scratch) if need_b and bias is not None else None
    dh = torch.empty_like(hidden) if need_h else None
    with torch.no_grad(), torch.autocast(hidden.device.type, enabled=False):
        for start, stop in run.plan.bounds():
            total += _tile(
                hidden[start:stop].to(cd),
                targets[start:stop],
                valid[start:stop],
                w,
                b,
                run,
                scale,
                want_grad,
                slot_w,
                slot_b,
                None if dh is None else dh[start:stop],
            )
    run.dh = dh
    run.dw = None if slot_w is None else _result(slot_w, weight)
    run.db = None if slot_b is None else _result(slot_b, bias)  # type: ignore[arg-type]
    if run.reduction == "mean":
        return total / count if count else total / 0.0
    return total


def _result(slot: GradSlot, like: torch.Tensor) -> torch.Tensor:
    res = slot.result()
    return torch.zeros_like(like) if res is None else res


def _tile(
    ht: torch.Tensor,
    tt: torch.Tensor,
    vt: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor | None,
    run: _LossRun,
    scale: float,
    want_grad: bool,
    slot_w: GradSlot | None,
    slot_b: GradSlot | None,
    dht: torch.Tensor | None,
) -> torch.Tensor:
    """One tile: returns its float32 loss sum; accumulates its gradients when asked."""
    z = torch.nn.functional.linear(ht, w, b)  # (n, V) in the compute dtype
    zc = z if run.softcap is None else _softcap(z, run.softcap)
    # float32 at least (float64 stays float64); zc itself when no cast is needed: it is not
    # needed again
    zf = zc.to(torch.promote_types(zc.dtype, torch.float32))
    safe = torch.where(vt, tt, torch.zeros_like(tt))
    lse = torch.logsumexp(zf, dim=-1)
    picked = zf.gather(1, safe.unsqueeze(1)).squeeze(1)
    loss_sum = torch.where(vt, lse - picked, torch.zeros_like(lse)).sum()
    if not want_grad:
        return loss_sum
    # d(loss)/d(logits) = (softmax - one_hot) * scale on valid rows, 0 on ignored rows
    p = zf.sub_(lse.unsqueeze(1)).exp_()
    p.scatter_add_(1, safe.unsqueeze(1), -torch.ones_like(lse).unsqueeze(1))
    p.mul_((vt.to(p.dtype) * scale).unsqueeze(1))
    dz = p.to(z.dtype)
    del p, zf
    if run.softcap is not None:
        z_leaf = z.detach().requires_grad_()
        with torch.enable_grad():
            capped = _softcap(z_leaf, run.softcap)
        (dz,) = torch.autograd.grad(capped, z_leaf, dz)
    if slot_w is not None:
        slot_w.add_mm(dz.t(), ht)
    if slot_b is not None:
        slot_b.add_rows(dz)
    if dht is not None:
        if dht.dtype == dz.dtype:
            torch.mm(dz, w, out=dht)
        else:
            dht.copy_(torch.mm(dz, w))
    return loss_sum


def _plan(num_tokens: int, hidden: int, elem: int, num_tiles: Any, tile_tokens: Any) -> TilePlan:
    validate_policy(num_tiles, tile_tokens)
    if num_tiles == "arctic":
        raise ValueError("num_tiles='arctic' is the MLP's rule; give the loss an int or 'auto'")
    if tile_tokens is not None:
        return split_by_tile_tokens(num_tokens, tile_tokens)
    if num_tiles == "auto":
        # a tile's float32 logits (n x V x 4 bytes) about the size of the LM-head weight
        per_tile = max(1, hidden * elem // 4)
        return split_even(num_tokens, max(1, math.ceil(num_tokens / per_tile)))
    return split_even(num_tokens, int(num_tiles))


def tiled_cross_entropy(
    hidden_states: torch.Tensor,
    lm_head_weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    num_tiles: int | str = "auto",
    tile_tokens: int | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    shift: bool = False,
    softcap: float | None = None,
) -> torch.Tensor:
    """Cross-entropy of the LM head's logits without materialising more than one tile of them.

    Equals F.cross_entropy((hidden_states @ lm_head_weight.T + bias).float(), labels) (with the
    optional soft-capping applied to the logits first), with exact gradients for hidden_states,
    lm_head_weight and bias. Cost: the untiled computation's 3L FLOPs (L = 2 * tokens * hidden *
    vocab); memory: one tile of logits at a time.

    Args:
        hidden_states: (batch, seq, hidden) or (tokens, hidden), floating point.
        lm_head_weight: (vocab, hidden).
        labels: (batch, seq) or (tokens,) class indices of any integer dtype; ignore_index
            marks tokens without a target.
        bias: (vocab,) or None.
        num_tiles: a positive int, or "auto" (tiles of hidden * elem / 4 tokens: their float32
            logits are about the size of the LM-head weight).
        tile_tokens: tokens per tile, instead of num_tiles.
        ignore_index: label value that contributes nothing.
        reduction: "mean" over the non-ignored tokens of the whole input (nan when there are
            none, as in torch), or "sum".
        shift: causal-LM shifting: position t is scored against labels[..., t + 1] and the last
            position of each sequence is ignored (what Hugging Face causal LMs do).
        softcap: final-logit soft-capping, logits = tanh(logits / softcap) * softcap (Gemma 2);
            None or 0 for none.

    Returns:
        The loss, a float32 scalar.

    Raises:
        TypeError / ValueError: wrong dtypes, shapes, reduction or tile policy.
    """
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    if not isinstance(hidden_states, torch.Tensor) or not hidden_states.is_floating_point():
        raise TypeError("tiled_cross_entropy: hidden_states must be a floating-point tensor")
    if hidden_states.dim() not in (2, 3):
        raise ValueError(
            f"tiled_cross_entropy: hidden_states must be (batch, seq, hidden) or (tokens, hidden), "
            f"got {tuple(hidden_states.shape)}"
        )
    if lm_head_weight.dim() != 2 or lm_head_weight.shape[1] != hidden_states.shape[-1]:
        raise ValueError(
            f"tiled_cross_entropy: lm_head_weight must be (vocab, {hidden_states.shape[-1]}), got "
            f"{tuple(lm_head_weight.shape)}"
        )
    if labels.dtype.is_floating_point or labels.dtype.is_complex or labels.dtype == torch.bool:
        raise TypeError(
            f"tiled_cross_entropy: labels must be integer class indices, got {labels.dtype}"
        )
    if tuple(labels.shape) != tuple(hidden_states.shape[:-1]):
        raise ValueError(
            f"tiled_cross_entropy: labels must have shape {tuple(hidden_states.shape[:-1])} (one per "
            f"token), got {tuple(labels.shape)}"
        )
    if bias is not None and tuple(bias.shape) != (lm_head_weight.shape[0],):
        raise ValueError(
            f"tiled_cross_entropy: bias must be ({lm_head_weight.shape[0]},), got {tuple(bias.shape)}"
        )
    if softcap is not None and not softcap >= 0:
        raise ValueError(
            f"tiled_cross_entropy: softcap must be positive, or None / 0 for no capping, got "
            f"{softcap!r}"
        )
    if not softcap:
        softcap = None  # 0 means off, as in Hugging Face configs and other fused losses
    # Class indices of any integer dtype (F.cross_entropy takes int64 and uint8): compared and
    # gathered as int64, so ignore_index=-100 never wraps around in a narrow dtype.
    labels = labels.long()
    targets = shift_labels(labels, ignore_index) if shift else labels
    hidden = hidden_states.reshape(-1, hidden_states.shape[-1])
    targets = targets.reshape(-1)
    vocab = lm_head_weight.shape[0]
    out_of_range = (targets != ignore_index) & ((targets < 0) | (targets >= vocab))
    if not absent(targets) and bool(out_of_range.any()):  # fake tensors (planning): no values
        raise ValueError(
            f"tiled_cross_entropy: labels must be in [0, {vocab}) or equal ignore_index={ignore_index}"
        )
    autocast = AutocastState.capture(hidden.device.type)
    cd = autocast.compute_dtype(hidden.dtype, lm_head_weight.dtype) or hidden.dtype
    elem = torch.empty((), dtype=cd).element_size()
    plan = _plan(hidden.shape[0], hidden.shape[1], elem, num_tiles, tile_tokens)
    run = _LossRun(plan, ignore_index, reduction, softcap, autocast)
    needs_grad = torch.is_grad_enabled() and (
        hidden.requires_grad
        or lm_head_weight.requires_grad
        or (bias is not None and bias.requires_grad)
    )
    if not needs_grad:
        return _loss_and_grads(hidden.detach(), targets, run, lm_head_weight, bias, want_grad=False)
    return TiledCrossEntropyFunction.apply(hidden, targets, run, lm_head_weight, bias)  # type: ignore[no-any-return]
