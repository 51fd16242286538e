"""TiledMLPConfig: the tile policy of one tiled MLP, as TiledMLP takes it.

Invariant: a config that constructs is valid: it holds a TilePolicy and the kernels switch, the
only things stored; `num_tiles` and `tile_tokens` are read-only spellings of the policy. Unknown
keys are rejected (from_dict).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tiledmlp.config.values import parse_tile_pair
from tiledmlp.ops.tiling.policy import TilePolicy

__all__ = ["TiledMLPConfig"]


@dataclass(frozen=True, kw_only=True, repr=False)
class _Stored:
    """What a TiledMLPConfig stores, checked; TiledMLPConfig's constructor builds it once
    with its final values."""

    policy: TilePolicy = TilePolicy()  # noqa: RUF009 (frozen: shared safely)
    kernels: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.policy, TilePolicy):
            raise TypeError(
                f"TiledMLPConfig: policy must be a TilePolicy, got {self.policy!r}; or give "
                "num_tiles / tile_tokens"
            )
        if not isinstance(self.kernels, bool):
            raise ValueError(f"TiledMLPConfig: kernels must be True or False, got {self.kernels!r}")


class TiledMLPConfig(_Stored):
    """How an MLP is tiled: a frozen tile policy and the kernels switch.

    Args:
        num_tiles: a positive int, "auto" (memory-budget rule, default), "arctic"
            (ceil(tokens / hidden)) or "target:<GB>" (a memory target).
        tile_tokens: tokens per tile instead of num_tiles (num_tiles must stay "auto").
        kernels: use the fused Triton elementwise kernels for gated MLPs where they can run
            (CUDA; default True). False: PyTorch only (see tiled_mlp's `kernels`).
        policy: a TilePolicy instead of num_tiles / tile_tokens.

    Attributes:
        policy: the TilePolicy (stored).
        kernels: the kernels switch (stored).
        num_tiles: the policy as tiled_mlp's num_tiles (read-only).
        tile_tokens: the policy's tokens per tile, or None (read-only).

    Raises:
        ValueError: a bad num_tiles / tile_tokens or kernels, or a policy given with them.
    """

    def __init__(
        self,
        *,
        num_tiles: int | str = "auto",
        tile_tokens: int | None = None,
        kernels: bool = True,
        policy: TilePolicy | None = None,
    ) -> None:
        if policy is None:
            policy = parse_tile_pair(num_tiles, tile_tokens)
        elif num_tiles != "auto" or tile_tokens is not None:
            raise ValueError(
                f"TiledMLPConfig: give policy or num_tiles / tile_tokens, not both (got "
                f"policy={policy}, num_tiles={num_tiles!r}, tile_tokens={tile_tokens!r})"
            )
        super().__init__(policy=policy, kernels=kernels)

    @property
    def num_tiles(self) -> int | str:
        """The policy as tiled_mlp's num_tiles: an int, "auto", "arctic" or "target:<GB>"."""
        return self.policy.num_tiles

    @property
    def tile_tokens(self) -> int | None:
        """Tokens per tile, or None for the other policies."""
        return self.policy.tile_tokens

    def __repr__(self) -> str:
        return (
            f"TiledMLPConfig(num_tiles={self.num_tiles!r}, tile_tokens={self.tile_tokens!r}, "
            f"kernels={self.kernels!r})"
        )

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> TiledMLPConfig:
        """The config of a dict of its keywords (num_tiles, tile_tokens, kernels).

        Raises:
            ValueError: an unknown key, or a bad value.
        """
        known = {"num_tiles", "tile_tokens", "kernels"}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(
                f"unknown TiledMLPConfig keys {unknown}; expected some of {sorted(known)}"
            )
        return cls(**values)
