"""The MLP variants a benchmark compares: untiled, tiled (ours), DeepSpeed's TiledMLP, Liger's
tiled SwiGLU (its apply_tiled_mlp with its fused SiLU-mul, on GPUs with liger-kernel installed).

Invariant: every variant computes the same function of (mlp, x) and is driven by the same step
(forward, then backward with the given upstream gradient), so their numbers are comparable.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tiledmlp.config.values import parse_tile_policy
from tiledmlp.ops.mlp.functional import tile_plan, tiled_mlp

__all__ = ["Variant", "deepspeed_available", "liger_available", "make_variant"]


@dataclass(frozen=True)
class Variant:
    """A named way to run an MLP: forward(mlp, x) -> output."""

    name: str
    num_tiles: int | str | None
    forward: Callable[[nn.Module, torch.Tensor], torch.Tensor]

    def tiles(self, mlp: nn.Module, x: torch.Tensor) -> int:
        """Tiles this variant actually runs for x (0 when untiled)."""
        if self.name == "untiled" or self.num_tiles is None:
            return 0
        if self.name in ("deepspeed", "liger"):
            return len(torch.chunk(x, int(self.num_tiles), dim=-2))  # what torch.chunk gives it
        plan = tile_plan(mlp, x, policy=parse_tile_policy(self.num_tiles))
        return 0 if plan is None else plan.num_tiles


def deepspeed_available() -> bool:
    try:
        from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP  # noqa: F401
    except Exception:
        return False
    return True


def _liger() -> tuple[Any, Any]:
    """(apply_tiled_mlp, LigerSiLUMulFunction) from liger-kernel."""
    from liger_kernel.ops import LigerSiLUMulFunction, apply_tiled_mlp

    return apply_tiled_mlp, LigerSiLUMulFunction


def liger_available() -> bool:
    """Whether liger-kernel's tiled MLP and fused SiLU-mul import (they need Triton)."""
    try:
        _liger()
    except Exception:
        return False
    return True


def _gated_forward(mlp: Any, x: torch.Tensor) -> torch.Tensor:
    return mlp.down_proj(mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x))


def make_variant(name: str, num_tiles: int | str | None = None) -> Variant:
    """Builds a variant.

    Args:
        name: "untiled", "tiled" (ours), "deepspeed" (deepspeed's TiledMLP; gated MLPs with
            gate_proj/up_proj/down_proj/act_fn, the module shape its docs patch) or "liger"
            (liger-kernel's apply_tiled_mlp with LigerSiLUMulFunction, SiLU-gated MLPs).
        num_tiles: tiles for "tiled" (int, "auto", "arctic"), "deepspeed" and "liger" (int).
    """
    if name == "untiled":
        return Variant(name, None, lambda mlp, x: mlp(x))
    if name == "tiled":
        tiles = "auto" if num_tiles is None else num_tiles
        return Variant(name, tiles, lambda mlp, x: tiled_mlp(mlp, x, num_tiles=tiles))
    if name == "deepspeed":
        if not isinstance(num_tiles, int):
            raise ValueError(f"the deepspeed variant needs an int num_tiles, got {num_tiles!r}")
        from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP as DSTiledMLP

        shards = num_tiles

        def ds_forward(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
            return DSTiledMLP.apply(_gated_forward, mlp, x, shards, [])  # type: ignore[no-any-return]

        return Variant(name, shards, ds_forward)
    if name == "liger":
        if not isinstance(num_tiles, int):
            raise ValueError(f"the liger variant needs an int num_tiles, got {num_tiles!r}")
        apply_tiled, silu_mul = _liger()
        count = num_tiles

        def liger_shard(mlp: Any, x: torch.Tensor) -> torch.Tensor:
            return mlp.down_proj(silu_mul.apply(mlp.gate_proj(x), mlp.up_proj(x)))  # type: ignore[no-any-return]

        def liger_forward(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
            return apply_tiled(liger_shard, mlp, x, count, list(mlp.parameters()))  # type: ignore[no-any-return]

        return Variant(name, count, liger_forward)
    raise ValueError(
        f"unknown variant {name!r}; expected 'untiled', 'tiled', 'deepspeed' or 'liger'"
    )
