"""The accelerator's "auto": a call is tiled only where that saves at least
ACCELERATOR_MIN_SAVING_BYTES; a small model's MLPs run untiled, an 8B-shaped MLP's tiles do not
change."""

from __future__ import annotations

import torch

from tiledmlp.models.mlps import GatedMLP
from tiledmlp.ops.mlp.memory_model import MemoryModel
from tiledmlp.ops.mlp.structure import MLPKind, MLPStructure
from tiledmlp.ops.mlp.tile_rules import ACCELERATOR_MIN_SAVING_BYTES, resolve_tiles
from tiledmlp.ops.tiling.assumed import assume_device
from tiledmlp.ops.tiling.policy import TilePolicy


def _model(hidden: int, intermediate: int) -> MemoryModel:
    with torch.device("meta"):
        mlp = GatedMLP(hidden, intermediate).to(torch.bfloat16)
    s = MLPStructure(
        MLPKind.GATED, (mlp.gate_proj, mlp.up_proj), mlp.down_proj, mlp.act_fn, True, False, ()
    )
    return MemoryModel(s, torch.bfloat16)


def _tiles(model: MemoryModel, n: int, hidden: int, device: str = "cuda") -> int:
    with assume_device(device):
        plan = resolve_tiles(TilePolicy.of("auto"), n, hidden, model)
    return 0 if plan is None else plan.num_tiles


def test_small_model_mlp_runs_untiled_on_an_accelerator() -> None:
    # `tiledmlp train --model small` (hidden 512, intermediate 2048, bf16) at 16K tokens: two
    # 8K-token tiles would save 178 MiB per call (352 MiB untiled), below the 256 MiB floor
    small = _model(512, 2048)
    n = 16384
    saving = small.untiled_bytes(n) - small.tiled_bytes(8192)
    assert 0 < saving < ACCELERATOR_MIN_SAVING_BYTES
    assert _tiles(small, n, 512) == 0
    # from 32K tokens the saving passes the floor: tiled again
    assert _tiles(small, 32768, 512) == 4
    assert _tiles(small, 65536, 512) == 8
    # the CPU's rule has no floor and is unchanged
    assert _tiles(small, n, 512, device="cpu") > 1


def test_8b_shaped_mlp_tiles_unchanged() -> None:
    # hidden 4096 / intermediate 14336 (Llama-3-8B): the smallest tiled length, 16K tokens,
    # saves 560 MiB per call and keeps its two tiles
    big = _model(4096, 14336)
    saving = big.untiled_bytes(16384) - big.tiled_bytes(8192)
    assert saving >= ACCELERATOR_MIN_SAVING_BYTES
    assert {n: _tiles(big, n, 4096) for n in (8192, 16384, 32768)} == {8192: 0, 16384: 2, 32768: 4}
