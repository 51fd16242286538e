"""The MLP's tile plan for a tile policy: what "auto" and "target:<GB>" mean for an MLP.

"target:<GB>": the fewest tiles whose working memory (the tile's intermediates plus the float32
gradient accumulators, by the memory model) fits <GB> GiB; untiled when the untiled module's
intermediates fit. Tiles are never smaller than one token. Modules without a fast path have no
memory model: their intermediates are taken as those of a gated MLP with intermediate size
4 x hidden (GENERIC_WIDTH), in the input's dtype.

"auto" for a recognised MLP on the CPU: tiles of about `weight_bytes / (c_t * m * e)` tokens,
i.e. a tile's transient intermediates are about the size of the MLP's weights (c_t (n, m) tensors
of e bytes per token row, see fast.py). It runs untiled unless its memory model predicts that
tiling needs at most CPU_MARGIN (half) of the untiled module's intermediates (short sequences run
untiled: there the untiled peak overlaps less with the gradients and sits below the model), so
"auto" never costs memory and costs no recompute where it saves little (tests/ops/tiling/test_policy.py
measures this).

"auto" for a recognised MLP on an accelerator (any device but the CPU) is time-aware: small tiles
lose GEMM efficiency and add a pass over every weight-sized accumulator per tile, while the
memory saving is nearly all captured by a few large tiles. It takes the largest tiles that keep
ACCELERATOR_SAVING of the saving the memory model says tiling can reach (untiled intermediates
minus the accumulators), but never tiles whose working memory exceeds ACCELERATOR_MAX_TILE_BYTES
(at very long sequences the last part of the saving would cost many GiB) and never fewer than
ACCELERATOR_MIN_TILE_TOKENS tokens per tile (the three in memory_model.py); untiled when that
leaves fewer than two tiles or saves less than ACCELERATOR_MIN_SAVING_BYTES (256 MiB) per call:
a small model's MLP (hidden 512, intermediate 2048, bf16: 352 MiB of untiled intermediates at
16K tokens, of which two tiles would save 178 MiB) runs untiled there, where its tiles would
cost more time than the memory they save is worth (docs/benchmarks.md lists the tiles it picks
for an 8B-shaped MLP, which the floor leaves as they were).

For modules without a fast path "auto" uses the paper's rule beyond two tiles' worth of tokens
and runs untiled below. A count, tokens per tile and "arctic" need no memory model.

Invariant: the plan depends only on the token count, the module's shapes, dtypes and device
type, and the policy; never on free memory, so every rank with the same inputs gets the same
plan. The planner resolves for an accelerator on fake CPU tensors with `assume_device`
(ops/tiling/assumed.py).
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
