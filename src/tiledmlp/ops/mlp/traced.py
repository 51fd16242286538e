"""tiled_mlp as torch.compile traces it: one custom operator per recognised MLP, per-tile
checkpoints for every other token-wise module.

- A recognised MLP (gated, fused gated, plain) whose activation the operator computes by name
  (SiLU, GELU-tanh, GELU: ops/mlp/glu/activation.py) is one call of `tiledmlp::mlp`
  (ops/mlp/operator.py), its backward one call of `tiledmlp::mlp_backward`: the eager tile loops,
  minimal recompute and one gradient per weight, opaque to the compiler.
- Any other module (LoRA-wrapped projections, MoE blocks, norms, another activation) cannot be
  an operator: its computation is arbitrary Python that only tracing can see. It is traced as
  one non-reentrant checkpoint per tile, the tiles' outputs concatenated: the compiled backward
  recomputes each tile's forward, and each parameter's gradient is one sum over the tiles in
  the compiled backward graph, reaching AccumulateGrad once.
- A parameter-partitioning engine (ZeRO-3) gathers parameters in Python around the eager
  tile loop: such a call runs eagerly, as one graph break.

Invariant: the same tile plan and the same results (up to the summation order of a generic
module's parameter gradients) as the eager tiled_mlp.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from tiledmlp.ops.mlp import operator
from tiledmlp.ops.mlp.glu.activation import activation_kind
from tiledmlp.ops.mlp.memory_model import MemoryModel
from tiledmlp.ops.mlp.structure import MLPKind, MLPStructure
from tiledmlp.ops.mlp.tile_rules import resolve_tiles
from tiledmlp.ops.tiling.policy import TilePolicy
from tiledmlp.ops.tiling.state import AutocastState
from tiledmlp.ops.tiling.tiles import TilePlan, split_even

__all__ = ["operator_activation", "traced_tiled_mlp"]

_ELEMENT_SIZES = {torch.float32: 4, torch.float16: 2, torch.bfloat16: 2, torch.float64: 8}


def operator_activation(structure: MLPStructure | None) -> str | None:
    """The activation name tiledmlp::mlp takes for `structure`, or None when the module must be
    traced as per-tile checkpoints (no structure, or an activation the operator cannot name)."""
    if structure is None:
        return None
    return activation_kind(structure.act)


def traced_tiled_mlp(
    mlp: nn.Module,
    x: torch.Tensor,
    args: tuple[torch.Tensor, ...],
    policy: TilePolicy,
    call: Callable[..., Any],
    structure: MLPStructure | None,
    plan_tokens: int | None,
    kernels: bool,
) -> Any:
    """tiled_mlp's result under torch.compile (module docstring).

    Args:
        mlp: the module.
        x: (batch, seq, hidden) or (tokens, hidden), checked by the caller.
        args: further per-token inputs, checked by the caller.
        policy: the tile policy.
        call: the module's untiled computation.
        structure: the recognised structure (None: the module is traced tile by tile).
        plan_tokens: the token count the ranks agreed on, as for tiled_mlp.
        kernels: as for tiled_mlp.
    """
    hidden = x.shape[-1]
    num_tokens = x.numel() // hidden if hidden else 0
    act = operator_activation(structure)
    autocast = AutocastState.capture(x.device.type)
    model = None
    if structure is not None and act is not None:
        dtypes = [p.dtype for p in structure.params() if p is not None]
        cd = autocast.compute_dtype(x.dtype, *dtypes) or x.dtype
        model = MemoryModel(structure, cd)
    elem = _ELEMENT_SIZES.get(x.dtype, 4)
    plan = _plan(policy, num_tokens, hidden, model, elem, plan_tokens)
    if plan is None or plan.num_tiles == 0:
        return call(x, *args)
    if structure is not None and act is not None:
        return _operator(x, structure, act, plan, autocast, kernels)
    return _checkpointed_tiles(call, x, args, plan)


def _plan(
    policy: TilePolicy,
    num_tokens: int,
    hidden: int,
    model: MemoryModel | None,
    elem: int,
    plan_tokens: int | None,
) -> TilePlan | None:
    if plan_tokens is None or plan_tokens <= num_tokens:
        return resolve_tiles(policy, num_tokens, hidden, model, elem)
    agreed = resolve_tiles(policy, plan_tokens, hidden, model, elem)
    return None if agreed is None else split_even(num_tokens, agreed.num_tiles)


def _operator(
    x: torch.Tensor,
    structure: MLPStructure,
    act: str,
    plan: TilePlan,
    autocast: AutocastState,
    kernels: bool,
) -> torch.Tensor:
    lins = structure.linears
    up = lins[1] if structure.kind is MLPKind.GATED else None
    first, down = lins[0], lins[-1]
    dtypes = [lin.weight.dtype for lin in lins]
    autocast_dtype = autocast.dtype if autocast.compute_dtype(x.dtype, *dtypes) else None
    out = operator.mlp(
        x.reshape(-1, x.shape[-1]),
        first.weight,
        first.bias,
        None if up is None else up.weight,
        None if up is None else up.bias,
        down.weight,
        down.bias,
        structure.kind.value,
        act,
        structure.gate_first,
        list(plan.sizes),
        autocast_dtype,
        kernels,
    )
    return out.view(*x.shape[:-1], out.shape[-1])


def _checkpointed_tiles(
    call: Callable[..., Any], x: torch.Tensor, args: tuple[torch.Tensor, ...], plan: TilePlan
) -> Any:
    """The module run on each tile under a non-reentrant checkpoint; outputs concatenated over
    tokens (an output with x's leading dims gets them back; a flat one, e.g. MoE router
    logits, stays flat)."""
    lead = tuple(x.shape[:-1])
    flat = x.reshape(-1, x.shape[-1])
    extras = [a.reshape(-1, *a.shape[len(lead) :]) for a in args]
    grad = torch.is_grad_enabled()
    pieces: list[list[torch.Tensor | None]] = []
    keeps: list[bool] = []
    single = True
    for start, stop in plan.bounds():
        n = stop - start
        xt = flat[start:stop]
        tile_in = xt.unsqueeze(0) if x.dim() == 3 else xt
        tile_args = [e[start:stop] for e in extras]
        out = (
            checkpoint(call, tile_in, *tile_args, use_reentrant=False)
            if grad
            else call(tile_in, *tile_args)
        )
        single = isinstance(out, torch.Tensor)
        items = (out,) if single else tuple(out)
        tile_lead = (1, n) if x.dim() == 3 else (n,)
        row: list[torch.Tensor | None] = []
        keeps = []
        for item in items:
            if item is None:
                row.append(None)
                keeps.append(True)
            elif tuple(item.shape[: len(tile_lead)]) == tile_lead:
                row.append(item.reshape(n, *item.shape[len(tile_lead) :]))
                keeps.append(True)
            else:
                row.append(item)
                keeps.append(False)
        pieces.append(row)
    outs: list[torch.Tensor | None] = []
    for k, keep in enumerate(keeps):
        parts = [row[k] for row in pieces]
        if any(p is None for p in parts):
            outs.append(None)
            continue
        joined = torch.cat([p for p in parts if p is not None])
        outs.append(joined.view(*lead, *joined.shape[1:]) if keep else joined)
    return outs[0] if single else tuple(outs)
