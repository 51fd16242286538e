"""Ops layer: the four tiled ops, one sub-package each, on shared tile machinery.

    tiling/      tile plans and policies, gradient accumulators, recompute state, guards
    mlp/         the tiled MLP (mlp/glu/: its fused elementwise kernels)
    loss/        the tiled LM-head loss
    attention/   the attention core by groups of heads
    offloading/  checkpointed layers' inputs in host memory

The path of one tiled-MLP call: mlp/functional.tiled_mlp checks its input and turns the tile
policy (tiling/policy) into a plan (tiling/tiles); mlp/structure recognises the module (through
tiling/probe and mlp/untiled) and picks an engine, mlp/fast (minimal recompute) or mlp/generic;
mlp/function.TiledMLPFunction runs the forward tile by tile, keeping nothing but the autocast and
RNG state (tiling/state); its backward recomputes each tile's first projections, the gated
activation in mlp/glu/kernels (Triton where it runs, mlp/glu/reference otherwise), sums every
weight's gradient in one buffer (tiling/grads) under the guards of tiling/guards, and hands each
gradient once to the engine's backend (tiling/backend).

Imports torch only: no transformers, no deepspeed, no torch.distributed collectives.
"""

from tiledmlp.ops.mlp.function import TiledMLPFunction
from tiledmlp.ops.mlp.functional import tiled_mlp
from tiledmlp.ops.mlp.structure import MLPKind, MLPStructure, recognise
from tiledmlp.ops.tiling.tiles import TilePlan, arctic_num_tiles, split_by_tile_tokens, split_even

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
