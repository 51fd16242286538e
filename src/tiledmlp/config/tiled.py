"""TiledMLPConfig: the tile policy of one tiled MLP, as TiledMLP takes it.

Invariant: a config that constructs is valid (its `policy` is the checked TilePolicy); unknown
keys are rejected (from_dict).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from tiledmlp.ops.tiling.policy import TilePolicy

__all__ = ["TiledMLPConfig"]


@dataclass(frozen=True, kw_only=True)
class TiledMLPConfig:
    """How an MLP is tiled.

    Attributes:
        num_tiles: a positive int, "auto" (memory-budget rule, default), "arctic"
            (ceil(tokens / hidden)) or "target:<GB>" (a memory target).
        tile_tokens: tokens per tile instead of num_tiles (num_tiles must stay "auto").
        kernels: use the fused Triton elementwise kernels for gated MLPs where they can run
            (CUDA; default True). False: PyTorch only (see tiled_mlp's `kernels`).
        policy: the checked TilePolicy of num_tiles and tile_tokens (derived).
    """

    num_tiles: int | str = "auto"
    tile_tokens: int | None = None
    kernels: bool = True
    policy: TilePolicy = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "policy", TilePolicy.of(self.num_tiles, self.tile_tokens))
        if not isinstance(self.kernels, bool):
            raise ValueError(f"TiledMLPConfig: kernels must be True or False, got {self.kernels!r}")

    @classmethod
    def of(cls, policy: TilePolicy, kernels: bool = True) -> TiledMLPConfig:
        """The config of a TilePolicy, which it keeps as it is (num_tiles and tile_tokens show
        it in tiled_mlp's keywords; nothing parses them again)."""
        config = cls(kernels=kernels)
        object.__setattr__(config, "num_tiles", policy.num_tiles)
        object.__setattr__(config, "tile_tokens", policy.tile_tokens)
        object.__setattr__(config, "policy", policy)
        return config

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> TiledMLPConfig:
        known = {f.name for f in fields(cls) if f.init}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(
                f"unknown TiledMLPConfig keys {unknown}; expected some of {sorted(known)}"
            )
        return cls(**values)
