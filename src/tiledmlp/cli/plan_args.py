"""`tiledmlp plan`'s request: its flags parsed once into one frozen, typed object that the
planning, the report, the measurement and the bottom line read.

The tile policy is one value: --num-tiles and --tile-budget-gb (its other spelling, GB of
working memory per MLP) are settled here into `num_tiles`; the dtype is its torch name; the
lengths --measure runs default by the device.

Invariant: nothing after `PlanArgs.of` changes the request; the parsed arguments are never
written to.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Any

from tiledmlp.cli.common import UsageError, dtype_name
from tiledmlp.ops.tiling.policy import TilePolicy

__all__ = ["PlanArgs"]


@dataclass(frozen=True, kw_only=True)
class PlanArgs:
    """What `tiledmlp plan` was asked (each field is the flag of its name; see `plan
    --help`)."""

    model: str | None
    hidden: int | None
    intermediate: int | None
    seq_len: int
    dtype: str  # the torch dtype's name
    num_tiles: TilePolicy  # --num-tiles, or --tile-budget-gb's target policy
    device: str
    budget_gb: float | None
    gradient_checkpointing: bool
    optimizer: str
    memory_gb: float | None
    gpu: str | None
    sequence_parallel_size: int
    stacks: tuple[str, ...] | None
    engine: str
    offload_params: bool
    expandable_segments: bool
    attention_kernel: str
    measure: bool
    measure_layers: int
    measure_lengths: tuple[int, ...]
    json: bool

    @classmethod
    def of(cls, args: argparse.Namespace) -> PlanArgs:
        """The request of `plan`'s parsed flags.

        Raises:
            UsageError: --num-tiles and --tile-budget-gb that ask for two policies.
        """
        values: dict[str, Any] = {
            f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)
        }
        values["dtype"] = dtype_name(args.dtype)
        values["num_tiles"] = _tiles(args.num_tiles, getattr(args, "tile_budget_gb", None))
        if values.get("measure_lengths") is None:
            cpu = args.device == "cpu"
            values["measure_lengths"] = (512, 1024, 2048) if cpu else (8192, 16384, 32768)
        return cls(**values)

    def asked(self) -> dict[str, Any]:
        """Every field by name (what the plan's cache key is made of)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


def _tiles(num_tiles: TilePolicy, budget: TilePolicy | None) -> TilePolicy:
    """The one tile policy of --num-tiles and --tile-budget-gb."""
    if budget is None:
        return num_tiles
    if num_tiles.rule != "auto" and num_tiles != budget:
        raise UsageError(
            f"--tile-budget-gb {budget.amount:g} and --num-tiles {num_tiles} disagree; give one "
            f"(--tile-budget-gb GB is --num-tiles target:GB)"
        )
    return budget
