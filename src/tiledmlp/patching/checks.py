"""Checks that engines (FSDP, DeepSpeed) register and patched forwards run under torch.distributed.

Invariant: with no process group initialised nothing runs; the patching layer never imports an
engine itself.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.distributed as dist
from torch import nn

__all__ = ["register_check", "run_checks"]

_CHECKS: list[Callable[[nn.Module], None]] = []


def register_check(check: Callable[[nn.Module], None]) -> None:
    """Adds a check run on every tiled MLP call while a process group is initialised."""
    if check not in _CHECKS:
        _CHECKS.append(check)


def run_checks(module: nn.Module) -> None:
    if not _CHECKS or not dist.is_available() or not dist.is_initialized():
        return
    for check in _CHECKS:
        check(module)
