"""TiledMLPConfig: the tile policy as data.

Invariant: a config that constructs is valid; unknown keys are rejected (from_dict).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from tiledmlp.ops.policy import validate_policy

__all__ = ["TiledMLPConfig"]


@dataclass(frozen=True, kw_only=True)
class TiledMLPConfig:
    """How an MLP is tiled.

    Attributes:
        num_tiles: a positive int, "auto" (memory-budget rule, default) or "arctic"
            (ceil(tokens / hidden)).
        tile_tokens: tokens per tile instead of num_tiles (num_tiles must stay "auto").
        kernels: use the fused Triton elementwise kernels for gated MLPs where they can run
            (CUDA; default True). False: PyTorch only (see tiled_mlp's `kernels`).
    """

    num_tiles: int | str = "auto"
    tile_tokens: int | None = None
    kernels: bool = True

    def __post_init__(self) -> None:
        validate_policy(self.num_tiles, self.tile_tokens)
        if not isinstance(self.kernels, bool):
            raise ValueError(f"TiledMLPConfig: kernels must be True or False, got {self.kernels!r}")

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> TiledMLPConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(
                f"unknown TiledMLPConfig keys {unknown}; expected some of {sorted(known)}"
            )
        return cls(**values)
