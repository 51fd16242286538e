"""The MLP's tile plan for a tile policy: what "auto" and "target:<GB>" mean for an MLP.

Invariant: the plan depends only on the token count, the module's shapes, dtypes and device
type, and the policy; never on free memory, so every rank with the same inputs gets the same
plan. The planner resolves for an accelerator on fake CPU tensors with `assume_device`
(ops/tiling/assumed.py).

Note: how it works, its costs and its choices are in
docs/how-it-works/module-notes.md#ops-mlp-tile-rules.
"""

from __future__ import annotations

import math

from tiledmlp.ops.mlp.memory_model import GENERIC_WIDTH, MemoryModel
from tiledmlp.ops.tiling.policy import TilePolicy
from tiledmlp.ops.tiling.tiles import TilePlan, arctic_num_tiles, split_by_tile_tokens, split_even

__all__ = ["ACCELERATOR_MIN_SAVING_BYTES", "CPU_MARGIN", "resolve_tiles"]

#: "auto" on an accelerator tiles a call only where that saves at least this much (module
#: docstring): below it the saving is small beside any accelerator's memory, while the tiles'
#: fixed costs (launches, accumulator passes, the fused kernels' first use) dominate a small
#: model's step.
ACCELERATOR_MIN_SAVING_BYTES = 256 * 2**20
#: "auto" on the CPU tiles only where the memory model predicts at most this share of the
#: untiled intermediates (module docstring).
CPU_MARGIN = 0.5


def resolve_tiles(
    policy: TilePolicy,
    num_tokens: int,
    hidden_size: int,
    model: MemoryModel | None,
    element_size: int = 4,
) -> TilePlan | None:
    """The tile plan of an MLP call under `policy`, or None to run the module untiled ("auto"
    and "target").

    Args:
        policy: the tile policy.
        num_tokens: flattened tokens of the input.
        hidden_size: last dim of the input.
        model: memory model of a recognised MLP, or None for the generic path.
        element_size: bytes per element of the input (the generic path's "target").
    """
    if policy.rule == "target":
        budget = policy.amount * 2**30
        return _target_plan(budget, num_tokens, hidden_size, model, element_size)
    if policy.rule == "tokens":
        return split_by_tile_tokens(num_tokens, int(policy.amount))
    if policy.rule == "count":
        return split_even(num_tokens, int(policy.amount))
    if policy.rule == "arctic":
        return split_even(num_tokens, arctic_num_tiles(num_tokens, hidden_size))
    return _auto_plan(num_tokens, hidden_size, model)


def _auto_plan(num_tokens: int, hidden_size: int, model: MemoryModel | None) -> TilePlan | None:
    """The "auto" rule (module docstring): CPU, accelerator, or without a memory model."""
    if model is None:
        if num_tokens < 2 * hidden_size:
            return None
        return split_even(num_tokens, arctic_num_tiles(num_tokens, hidden_size))
    if model.on_accelerator:
        tiles = math.ceil(num_tokens / model.accelerator_tile_tokens(num_tokens))
        tiled = model.tiled_bytes(math.ceil(num_tokens / max(tiles, 1)))
        if tiles < 2 or model.untiled_bytes(num_tokens) - tiled < ACCELERATOR_MIN_SAVING_BYTES:
            return None
        return split_even(num_tokens, tiles)
    target = model.auto_tile_tokens()
    tiles = math.ceil(num_tokens / target)
    tiled = model.tiled_bytes(math.ceil(num_tokens / tiles))
    if tiles < 2 or tiled > CPU_MARGIN * model.untiled_bytes(num_tokens):
        return None
    return split_even(num_tokens, tiles)


def _target_plan(
    budget: float, num_tokens: int, hidden: int, model: MemoryModel | None, elem: int
) -> TilePlan | None:
    if model is not None:
        untiled = model.untiled_bytes(num_tokens)
        fixed = model.tiled_bytes(0)
        per_token = model.tiled_bytes(1) - fixed
    else:
        per_token = MemoryModel.TILED_GATED * GENERIC_WIDTH * hidden * elem
        untiled = MemoryModel.UNTILED_GATED * GENERIC_WIDTH * hidden * elem * num_tokens
        fixed = 0.0
    if untiled <= budget or num_tokens < 2:
        return None
    tile = max(1, int((budget - fixed) // per_token)) if budget > fixed else 1
    tiles = min(num_tokens, math.ceil(num_tokens / tile))
    return None if tiles < 2 else split_even(num_tokens, tiles)
