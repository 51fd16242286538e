"""The memory a plan is judged against: a named card's, the GPU here, or this machine's RAM.

Cards by name (`--gpu`): config/gpus.py.

Invariant: every figure is in GiB and says where it comes from; nothing here estimates.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from tiledmlp.config.gpus import GPUS

__all__ = ["GPUS", "Memory", "gpu_memory", "here"]


@dataclass(frozen=True)
class Memory:
    """What a plan is judged against: `gib` of memory, described by `what`; `here`: the memory
    of the machine the command runs on (its host RAM is then the one that counts too)."""

    gib: float
    what: str
    here: bool


def gpu_memory(name: str) -> Memory:
    """A named card's memory (GPUS)."""
    card = GPUS[name]
    return Memory(card.gib, f"{card.name}, {card.gib:,.1f} GiB ({card.source})", here=False)


def here(device: str) -> Memory | None:
    """The memory of this machine's device of `device`'s type: the first GPU's total, or the
    RAM still available (cgroup limit respected) for "cpu"; None when there is no such GPU."""
    if device == "cpu":
        from tiledmlp.process_memory import available_ram_bytes

        ram = available_ram_bytes()
        if ram is None:
            return None
        return Memory(ram / 2**30, f"this machine's available RAM, {ram / 2**30:,.1f} GiB", True)
    if not _gpu_nodes():  # torch would find none: no need to import it to ask
        return None
    import torch

    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(0)
    gib = props.total_memory / 2**30
    return Memory(gib, f"{props.name}, {gib:,.1f} GiB (the GPU here)", here=True)


def _gpu_nodes() -> bool:
    """False only where torch cannot see a GPU: on Linux, no device node of NVIDIA's driver
    (/dev/nvidia0, ...), ROCm's (/dev/kfd) or WSL's (/dev/dxg); True elsewhere (ask torch)."""
    if sys.platform != "linux":
        return True
    dev = Path("/dev")
    return any(dev.glob("nvidia[0-9]*")) or (dev / "kfd").exists() or (dev / "dxg").exists()
