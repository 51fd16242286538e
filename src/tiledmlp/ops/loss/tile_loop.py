"""The LM-head tile loop: logits one tile at a time, per-tile math plugged in (ops/loss/tile_math.py),
and the two ways its gradient reaches hidden states, weight and bias.

Invariant: memory beyond inputs and outputs is one tile of logits (at most two float32 (n x V)
tensors at once, or one with the compute-dtype gradient), d(hidden) and one float32 accumulator
per parameter, whatever the number of tokens.

Note: how it works, its costs, Note [one float32 tensor per tile] and Note [the factored
gradient] are in docs/how-it-works/module-notes.md#ops-loss-tile-loop.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tiledmlp.ops.loss.tile_math import TileLogits, TileMath
from tiledmlp.ops.tiling.grads import GradSlot, Scratch
from tiledmlp.ops.tiling.guards import refuse_double_backward
from tiledmlp.ops.tiling.state import AutocastState
from tiledmlp.ops.tiling.tiles import TilePlan

__all__ = ["HeadRun", "run_head", "run_scalar_parts"]


@dataclass
class HeadRun:
    """One call: the tile plan, targets, which rows count, how logits are formed, the math."""

    plan: TilePlan
    targets: torch.Tensor  # (tokens,) int64; any value on rows that do not count
    counted: torch.Tensor  # (tokens,) bool
    softcap: float | None
    temperature: float
    autocast: AutocastState
    math: TileMath
    scale: float = 1.0  # logit scale, applied before soft-capping (Cohere, Granite)
    # a factored gradient's constant, which the loop's d(hidden), d(W) leave out (the scalar
    # head's backward multiplies it in with the upstream gradient); 1 otherwise
    alpha: float = 1.0
    dh: torch.Tensor | None = None
    dw: torch.Tensor | None = None
    db: torch.Tensor | None = None


def _softcap(z: torch.Tensor, cap: float) -> torch.Tensor:
    # The same three ops, in the same dtype, as Gemma 2's final-logit soft-capping.
    return torch.tanh(z / cap) * cap


def _compute_dtype(run: HeadRun, hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    cd = run.autocast.compute_dtype(hidden.dtype, weight.dtype)
    if cd is None and weight.dtype != hidden.dtype:
        raise TypeError(
            f"tiled LM head: hidden_states have dtype {hidden.dtype} but the LM-head weight has "
            f"{weight.dtype}; expected them to match. Cast one, or run under torch.autocast."
        )
    return cd or hidden.dtype


def _tiles(
    hidden: torch.Tensor,
    run: HeadRun,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    need: tuple[bool, bool, bool],
    upstream: list[torch.Tensor | None] | None,
    record: bool,
) -> None:
    """The loop. need = (d hidden, d weight, d bias) wanted; upstream: per-token gradients (the
    recomputing backward), None otherwise; record: let the math record its values."""
    cd = _compute_dtype(run, hidden, weight)
    w = weight.to(cd)
    b = None if bias is None else bias.to(cd)
    scratch = Scratch()
    # one tile: its product is the gradient, rounded once as untiled (no float32 buffer)
    single = run.plan.num_tiles == 1
    slot_w = GradSlot(weight, cd, scratch, single) if need[1] else None
    slot_b = GradSlot(bias, cd, scratch, single) if need[2] and bias is not None else None
    dh = torch.empty_like(hidden) if need[0] else None
    grads = any(need)
    with torch.no_grad(), torch.autocast(hidden.device.type, enabled=False):
        for start, stop in run.plan.bounds():
            # one function call per tile: its (n x V) temporaries are freed before the next
            _tile(hidden, run, w, b, slice(start, stop), cd, upstream, record, grads,
                  slot_w, slot_b, dh)  # fmt: skip
    run.dh = dh
    run.dw = None if slot_w is None else _result(slot_w, weight)
    run.db = None if slot_b is None or bias is None else _result(slot_b, bias)


def _tile(
    hidden: torch.Tensor,
    run: HeadRun,
    w: torch.Tensor,
    b: torch.Tensor | None,
    rows: slice,
    cd: torch.dtype,
    upstream: list[torch.Tensor | None] | None,
    record: bool,
    grads: bool,
    slot_w: GradSlot | None,
    slot_b: GradSlot | None,
    dh: torch.Tensor | None,
) -> None:
    ht = hidden[rows].to(cd)
    y, v = run.targets[rows], run.counted[rows]
    y = torch.where(v, y, 0)
    z = torch.nn.functional.linear(ht, w, b)  # (n, V), compute dtype
    if run.scale != 1.0:
        z = z.mul_(run.scale)  # in place: the unscaled product is not needed again
    zc = z if run.softcap is None else _softcap(z, run.softcap)
    z_dtype = z.dtype
    if run.softcap is None or not grads:
        del z  # read again only by the soft-cap's backward
    # See Note [one float32 tensor per tile]: float32 at least (zc itself when it is), the
    # compute-dtype logits let go before the log-softmax allocates its output
    zf = zc.to(torch.promote_types(cd, torch.float32))
    del zc
    if run.temperature != 1.0:
        zf.div_(run.temperature)  # in place, also when zf is z: z is then not read again
    lp = torch.log_softmax(zf, dim=-1)
    tile = TileLogits(lp, zf if run.math.reads_logits else None, y, v)
    del zf, lp
    if record:
        run.math.values(tile, rows)
    if not grads:
        return
    tile.drop_logits(keep_lse=run.math.needs_lse)
    # See Note [the factored gradient]
    if upstream is None and run.softcap is None and slot_b is None:
        factored = run.math.factored(tile, 1.0 / run.temperature, z_dtype)
        if factored is not None:
            del tile
            run.alpha = factored.alpha * run.scale  # the same for every tile
            _add_factored(factored.p, ht, v, w, rows, slot_w, dh)
            return
    up = None if upstream is None else [u if u is None else u[rows] for u in upstream]
    # d(logits) in z's dtype, each entry rounded once; the temperature's 1/T folded in
    dz = run.math.grad(tile, up, 1.0 / run.temperature, z_dtype)
    del tile
    if run.softcap is not None:
        z_leaf = z.detach().requires_grad_()
        with torch.enable_grad():
            capped = _softcap(z_leaf, run.softcap)
        (dz,) = torch.autograd.grad(capped, z_leaf, dz)
        del z
    if run.scale != 1.0:
        dz = dz.mul_(run.scale)
    if slot_w is not None:
        slot_w.add_mm(dz.t(), ht)
    if slot_b is not None:
        slot_b.add_rows(dz)
    if dh is not None:
        if dh.dtype == dz.dtype:
            torch.mm(dz, w, out=dh[rows])
        else:
            dh[rows].copy_(torch.mm(dz, w))


def _add_factored(
    p: torch.Tensor,
    ht: torch.Tensor,
    v: torch.Tensor,
    w: torch.Tensor,
    rows: slice,
    slot_w: GradSlot | None,
    dh: torch.Tensor | None,
) -> None:
    """A tile's gradients from d(logits) = alpha * diag(v) @ p, alpha left for the backward:
    d(W) += p.T @ (v * hidden_tile), d(hidden_tile) = v * (p @ W); multiplying by v (0 or 1)
    is exact."""
    keep = v.to(ht.dtype).unsqueeze(1)
    if slot_w is not None:
        slot_w.add_mm(p.t(), ht * keep)
    if dh is not None:
        part = dh[rows]
        if part.dtype == p.dtype:
            torch.mm(p, w, out=part)
            part.mul_(keep)
        else:
            part.copy_(torch.mm(p, w).mul_(keep))


def _result(slot: GradSlot, like: torch.Tensor) -> torch.Tensor:
    res = slot.result()
    return torch.zeros_like(like) if res is None else res


class _ScalarHead(torch.autograd.Function):
    """Scalar outputs: gradients formed in the forward (upstream 1), scaled in the backward.
    Inputs: hidden (tokens, hidden), the run, weight, bias or None. Output: the math's scalar
    (math.total())."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        run: HeadRun,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
    ) -> torch.Tensor:
        needs = ctx.needs_input_grad
        _tiles(hidden, run, weight, bias, (needs[0], needs[2], needs[3]), None, record=True)
        # The gradients are saved tensors, not attributes of the run: autograd frees saved
        # tensors once this backward has run (unless the graph is retained), so the hidden
        # states' gradient (tokens x hidden) is gone before the decoder layers' backward.
        grads = (run.dh, run.dw, run.db)
        ctx.alpha = run.alpha
        ctx.present = tuple(g is not None for g in grads)
        ctx.save_for_backward(*(g for g in grads if g is not None))
        run.dh = run.dw = run.db = None
        return run.math.total().clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        refuse_double_backward("tiled LM-head loss")
        saved = iter(ctx.saved_tensors)
        formed = [next(saved) if present else None for present in ctx.present]
        # The loss is linear in the upstream gradient, so scaling is exact; out of place, so a
        # retained graph can be differentiated again. The factor stays a scalar of the loss's
        # dtype (float32 at least): the product is formed in it and rounded once.
        factor = grad * ctx.alpha if ctx.alpha != 1.0 else grad
        dh, dw, db = (None if g is None else g * factor for g in formed)
        return dh, None, dw, db


class _TokenHead(torch.autograd.Function):
    """Per-token outputs: values in the forward, the tiles recomputed in the backward with each
    token's upstream gradient. Inputs: hidden, the run, weight, bias or None. Outputs: the math's
    per-token tensors (math.outputs())."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        run: HeadRun,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
    ) -> Any:
        _tiles(hidden, run, weight, bias, (False, False, False), None, record=True)
        ctx.run = run
        # an output nobody differentiates (an entropy only logged) gets None, not zeros: the
        # math then skips its term
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(hidden, weight, bias)
        return _outputs(run, clone=True)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> Any:
        refuse_double_backward("tiled LM-head log-probabilities")
        run: HeadRun = ctx.run
        hidden, weight, bias = ctx.saved_tensors
        needs = ctx.needs_input_grad
        _tiles(hidden, run, weight, bias, (needs[0], needs[2], needs[3]), list(grads), False)
        return run.dh, None, run.dw, run.db


def _outputs(run: HeadRun, clone: bool) -> Any:
    """The math's per-token output, or the tuple of them when there are several."""
    outs = tuple(o.clone() if clone else o for o in run.math.outputs())
    return outs if len(outs) > 1 else outs[0]


def run_head(
    hidden: torch.Tensor, run: HeadRun, weight: torch.Tensor, bias: torch.Tensor | None
) -> Any:
    """Runs the tile loop for `run.math`: through autograd when a gradient is wanted (the math
    decides scalar or per-token), in one plain pass otherwise. Returns the math's output(s)."""
    wants = torch.is_grad_enabled() and (
        hidden.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    )
    if not wants:
        _tiles(hidden.detach(), run, weight, bias, (False, False, False), None, record=True)
        return _outputs(run, clone=False) if run.math.per_token else run.math.total()
    if run.math.per_token:
        return _TokenHead.apply(hidden, run, weight, bias)
    return _ScalarHead.apply(hidden, run, weight, bias)


def run_scalar_parts(
    hidden: torch.Tensor,
    run: HeadRun,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    need: tuple[bool, bool, bool],
) -> None:
    """The scalar head's forward without autograd: the math's values, and in run.dh, run.dw,
    run.db the gradients `need` asks for, formed for an upstream gradient of 1 (run.alpha left
    out, as _ScalarHead keeps it): what tiledmlp::lm_head_loss returns."""
    _tiles(hidden.detach(), run, weight, bias, need, None, record=True)
