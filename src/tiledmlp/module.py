"""TiledMLP: a module that runs a wrapped token-wise MLP through tiled_mlp().

Invariant: TiledMLP(mlp)(x) equals mlp(x) with the same gradients; the wrapped module is kept as
the child `mlp` (so its state_dict keys gain the prefix "mlp."; patch_model swaps behaviour on the
instance instead and keeps keys unchanged).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tiledmlp.config import TiledMLPConfig
from tiledmlp.ops.mlp.functional import run_tiled_mlp

__all__ = ["TiledMLP"]


class TiledMLP(nn.Module):
    """Wraps `mlp` so that its forward runs in tiles.

    Args:
        mlp: the token-wise module to tile.
        config: the tile policy (default: TiledMLPConfig()).
    """

    def __init__(self, mlp: nn.Module, config: TiledMLPConfig | None = None) -> None:
        super().__init__()
        self.mlp = mlp
        self.config = config or TiledMLPConfig()

    def forward(self, x: torch.Tensor) -> Any:
        """x: (batch, seq, hidden) or (tokens, hidden); returns what mlp(x) returns."""
        return run_tiled_mlp(self.mlp, x, policy=self.config.policy, kernels=self.config.kernels)

    def extra_repr(self) -> str:
        extra = "" if self.config.kernels else ", kernels=False"
        return (
            f"num_tiles={self.config.num_tiles!r}, tile_tokens={self.config.tile_tokens!r}{extra}"
        )
