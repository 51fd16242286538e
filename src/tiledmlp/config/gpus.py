"""The cards a plan or a run's pre-flight can be judged against by name (`--gpu`), and the
memory CUDA reports for each (torch's total_memory): from the committed records where tiledmlp
was measured on that card (benchmarks/results/gpu/), else the card's specified memory less the
same share the measured H100 loses to the driver.

Invariant: every figure is in GiB and says where it comes from; nothing here estimates.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["GPUS", "Card"]

_MIB = 1024.0
_H100_SHARE = 81079.0 / 81559.0  # what CUDA reports of the H100's 81,559 MiB (its records)


@dataclass(frozen=True)
class Card:
    """A card's name as CUDA spells it, its memory in GiB as CUDA reports it, and the source."""

    name: str
    gib: float
    source: str


# --gpu NAME -> the card
GPUS: dict[str, Card] = {
    "h100-80gb": Card(
        "NVIDIA H100 80GB HBM3", 81079.0 / _MIB, "as CUDA reported it in the records"
    ),
    "h200": Card("NVIDIA H200", 143155.9 / _MIB, "as CUDA reported it in the records"),
    "a100-80gb": Card(
        "NVIDIA A100 80GB", 81920 * _H100_SHARE / _MIB, "specified, less the driver's share"
    ),
    "a100-40gb": Card(
        "NVIDIA A100 40GB", 40960 * _H100_SHARE / _MIB, "specified, less the driver's share"
    ),
    "l40s": Card("NVIDIA L40S", 46068 * _H100_SHARE / _MIB, "specified, less the driver's share"),
    "4090": Card(
        "NVIDIA GeForce RTX 4090", 24564 * _H100_SHARE / _MIB, "specified, less the driver's share"
    ),
}
