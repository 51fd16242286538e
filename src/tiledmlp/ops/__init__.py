"""Ops layer: the four tiled ops, one sub-package each, on shared tile machinery.

    tiling/      tile plans and policies, gradient accumulators, recompute state, guards
    mlp/         the tiled MLP (mlp/glu/: its fused elementwise kernels)
    loss/        the tiled LM-head loss
    attention/   the attention core by groups of heads
    offloading/  checkpointed layers' inputs in host memory
    library.py   the tiled MLP and loss as PyTorch custom operators, for torch.compile

The path of one tiled-MLP call: mlp/functional.tiled_mlp checks its input and turns the tile
policy (tiling/policy) into a plan (tiling/tiles); mlp/structure recognises the module (through
tiling/probe and mlp/untiled) and picks an engine, mlp/fast (minimal recompute) or mlp/generic;
mlp/function.TiledMLPFunction runs the forward tile by tile, keeping nothing but the autocast and
RNG state (tiling/state); its backward recomputes each tile's first projections, the gated
activation in mlp/glu/kernels (Triton where it runs, mlp/glu/reference otherwise), sums every
weight's gradient in one buffer (tiling/grads) under the guards of tiling/guards, and hands each
gradient once to the engine's backend (tiling/backend).

Imports torch only (importing this package imports nothing; each name below loads its module
on first use): no transformers, no deepspeed, no torch.distributed collectives.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tiledmlp.ops.mlp.function import TiledMLPFunction
    from tiledmlp.ops.mlp.functional import tiled_mlp
    from tiledmlp.ops.mlp.structure import MLPKind, MLPStructure, recognise
    from tiledmlp.ops.tiling.tiles import (
        TilePlan,
        arctic_num_tiles,
        split_by_tile_tokens,
        split_even,
    )

# the names below, each imported from its module on first use (PEP 562): importing a module of
# ops (a tile policy's parser, say) imports no torch through this package
_HOMES = {
    "TiledMLPFunction": "tiledmlp.ops.mlp.function",
    "tiled_mlp": "tiledmlp.ops.mlp.functional",
    "MLPKind": "tiledmlp.ops.mlp.structure",
    "MLPStructure": "tiledmlp.ops.mlp.structure",
    "recognise": "tiledmlp.ops.mlp.structure",
    "TilePlan": "tiledmlp.ops.tiling.tiles",
    "arctic_num_tiles": "tiledmlp.ops.tiling.tiles",
    "split_by_tile_tokens": "tiledmlp.ops.tiling.tiles",
    "split_even": "tiledmlp.ops.tiling.tiles",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'tiledmlp.ops' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


__all__ = [
    "MLPKind",
    "MLPStructure",
    "TilePlan",
    "TiledMLPFunction",
    "arctic_num_tiles",
    "recognise",
    "split_by_tile_tokens",
    "split_even",
    "tiled_mlp",
]
