"""Memory planning without a GPU: peak memory of an MLP's forward + backward on fake tensors.

Builds a SwiGLU MLP of the given shape under torch's FakeTensorMode (nothing is allocated), runs
the untiled module and tiled_mlp on (1, seq_len, hidden) fake tokens, and tracks storages
(fake_memory.py). Counts weights, their gradients, the input, the output, the upstream gradient
and the input gradient, like the tensor-level measurements on real tensors
(tests/plan/test_plan.py compares both).

Invariant: the estimate depends only on shapes, dtype and the tile policy.
"""

from __future__ import annotations

from typing import Any

import torch

from tiledmlp.models.mlps import GatedMLP
from tiledmlp.ops.mlp.functional import run_tiled_mlp, tile_plan
from tiledmlp.ops.tiling.assumed import assume_device
from tiledmlp.ops.tiling.policy import TilePolicy
from tiledmlp.plan.sim.fast_fake import fake_mode
from tiledmlp.plan.sim.periodic_tiles import cut_peak_bytes

__all__ = ["estimate_fields", "plan_mlp"]

MiB = 2**20
# The recommendation tries 1, 2, 4, ... tiles up to this many (each try runs the fake step).
_MAX_SEARCH_TILES = 1024


def _estimate(
    hidden: int,
    intermediate: int,
    seq_len: int,
    dtype: torch.dtype,
    tiles: TilePolicy | None,
    device_type: str = "cuda",
) -> tuple[int, int]:
    """(peak bytes, tiles used) of one forward + backward; tiles None means untiled; "auto"
    resolves as on `device_type`."""
    mode = fake_mode()
    default = torch.get_default_dtype()
    with mode, assume_device(device_type):
        torch.set_default_dtype(dtype)  # build in dtype: .to() cannot swap fake parameters
        try:
            mlp = GatedMLP(hidden, intermediate)
        finally:
            torch.set_default_dtype(default)
        x = torch.empty(1, seq_len, hidden, dtype=dtype, requires_grad=True)
        dy = torch.empty(1, seq_len, hidden, dtype=dtype)
        used = 0
        if tiles is not None:
            plan = tile_plan(mlp, x, policy=tiles)
            used = 0 if plan is None else plan.num_tiles

        def step() -> None:
            y = mlp(x) if tiles is None else run_tiled_mlp(mlp, x, policy=tiles)
            y.backward(dy)

        peak = cut_peak_bytes(step, [*mlp.parameters(), x, dy])
    return peak, used


def estimate_fields(
    hidden: int,
    intermediate: int,
    seq_len: int,
    dtype: torch.dtype,
    tiles: TilePolicy,
    regular: int,
    tiled: int,
    used: int,
) -> dict[str, Any]:
    """The fields every estimate reports: the shape, the policy and the two peaks in MiB."""
    return {
        "hidden": hidden,
        "intermediate": intermediate,
        "seq_len": seq_len,
        "dtype": str(dtype).removeprefix("torch."),
        "num_tiles": tiles.num_tiles,  # its JSON spelling
        "tiles": used,
        "regular_mib": round(regular / MiB, 1),
        "tiled_mib": round(tiled / MiB, 1),
        "saving": round(1 - tiled / regular, 4) if regular else 0.0,
    }


def plan_mlp(
    *,
    hidden: int,
    intermediate: int,
    seq_len: int,
    dtype: torch.dtype,
    tiles: TilePolicy = TilePolicy(),  # noqa: B008 (frozen: shared safely)
    budget_bytes: int | None = None,
    device_type: str = "cuda",
) -> dict[str, Any]:
    """Estimated peak MiB untiled and tiled with the tile policy `tiles`; with a budget, the
    fewest tiles (a power of two up to 1024) that fit it. "auto" resolves as on `device_type`
    (a GPU by default; "cpu" to compare with a CPU run).

    Returns:
        {"regular_mib", "tiled_mib", "tiles", ...,} plus "recommended_num_tiles" (None when no
        tile count fits) and "recommended_mib" when budget_bytes is given.
    """
    regular, _ = _estimate(hidden, intermediate, seq_len, dtype, None)
    tiled, used = _estimate(hidden, intermediate, seq_len, dtype, tiles, device_type)
    out = estimate_fields(hidden, intermediate, seq_len, dtype, tiles, regular, tiled, used)
    if budget_bytes is not None:
        out["budget_mib"] = round(budget_bytes / MiB, 1)
        out["recommended_num_tiles"] = None
        if regular <= budget_bytes:
            out["recommended_num_tiles"] = 0  # fits untiled: no recompute needed
            out["recommended_mib"] = out["regular_mib"]
        else:
            elem = torch.empty((), dtype=dtype).element_size()
            # weights + grads, x + output + upstream grad + x grad: no tiling goes below this
            floor = (2 * 3 * hidden * intermediate + 4 * seq_len * hidden) * elem
            k = 1 if floor <= budget_bytes else seq_len + 1
            while k <= min(seq_len, _MAX_SEARCH_TILES):
                peak, _ = _estimate(hidden, intermediate, seq_len, dtype, TilePolicy("count", k))
                if peak <= budget_bytes:
                    out["recommended_num_tiles"] = k
                    out["recommended_mib"] = round(peak / MiB, 1)
                    break
                k *= 2
    return out
