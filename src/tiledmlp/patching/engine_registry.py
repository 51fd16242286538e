"""The engines' (FSDP, DeepSpeed) part in a tiled call: checks run on every tiled call under
torch.distributed, and providers of a parameter backend (ops/tiling/backend.py).

Invariant: with no process group initialised nothing runs and the default backend is used; the
patching layer never imports an engine itself: the engines' checks and backends are declared in
tiledmlp/registrations.py and imported from there the first time a tiled call runs under a
process group, whatever the process imported before.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.distributed as dist
from torch import nn

from tiledmlp.ops.tiling.backend import ParamBackend
from tiledmlp.registrations import ENGINE_BACKENDS, ENGINE_CHECKS, provided_all

__all__ = ["backend_for", "run_checks"]


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def run_checks(module: nn.Module) -> None:
    """Runs every engine's check on the tiled `module` while a process group is initialised."""
    if not _distributed():
        return
    checks: list[Callable[[nn.Module], None]] = provided_all(ENGINE_CHECKS)
    for check in checks:
        check(module)


def backend_for(module: nn.Module) -> ParamBackend | None:
    """The first backend an engine provides for `module`, else None (local)."""
    if not _distributed():
        return None
    providers: list[Callable[[nn.Module], ParamBackend | None]] = provided_all(ENGINE_BACKENDS)
    for provider in providers:
        backend = provider(module)
        if backend is not None:
            return backend
    return None
