"""Ops layer: the tiled MLP autograd Function, its functional entry point, and the tile math.

Imports torch only: no transformers, no deepspeed, no torch.distributed collectives.
"""

from tiledmlp.ops.function import TiledMLPFunction
from tiledmlp.ops.functional import tiled_mlp
from tiledmlp.ops.structure import MLPKind, MLPStructure, recognise
from tiledmlp.ops.tiles import TilePlan, arctic_num_tiles, split_by_tile_tokens, split_even

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
