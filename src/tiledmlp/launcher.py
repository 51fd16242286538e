"""Whether a distributed launcher started this process: torchrun, the deepspeed launcher and
accelerate launch each set RANK and WORLD_SIZE for every process they start.

One rule for `tiledmlp train` (which engine may run, and on how many processes) and for how a
command's process ends (cli/leave.py).
"""

from __future__ import annotations

import os

__all__ = ["launched"]


def launched() -> bool:
    """Whether a distributed launcher started this process (RANK and WORLD_SIZE are set)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ
