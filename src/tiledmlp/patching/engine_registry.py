"""What engines (FSDP, DeepSpeed) register with the patching layer: checks run on every tiled
call under torch.distributed, and providers of a parameter backend (ops/tiling/backend.py).

Invariant: with no process group initialised nothing runs and the default backend is used; the
patching layer never imports an engine itself. The engines register when tiledmlp.integrations
is imported, which reading any public name of the package (`from tiledmlp import patch_model`)
does, and which a tiled call under an initialised process group asks for where none has
registered yet (ops/tiling/deferred.py); if still none has, the call is refused, never run
without the engine's backend.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.distributed as dist
from torch import nn

from tiledmlp.ops.tiling.backend import ParamBackend
from tiledmlp.ops.tiling.deferred import load_deferred

__all__ = ["backend_for", "register_backend", "register_check", "run_checks"]

_CHECKS: list[Callable[[nn.Module], None]] = []
_BACKENDS: list[Callable[[nn.Module], ParamBackend | None]] = []


def register_check(check: Callable[[nn.Module], None]) -> None:
    """Adds a check run on every tiled MLP call while a process group is initialised."""
    if check not in _CHECKS:
        _CHECKS.append(check)


def _engines_registered() -> None:
    """Raises where no engine has registered (module docstring): under ZeRO-3 a tiled call
    hands its gradients to the engine through the engine's backend, and under FSDP the engine's
    check refuses what it cannot run; neither may be skipped silently."""
    if not _CHECKS and not _BACKENDS:
        load_deferred()  # the integrations, where only a deep module was imported
    if not _CHECKS and not _BACKENDS:
        raise RuntimeError(
            "a tiled call runs under torch.distributed, but the engines' integrations are not "
            "loaded: import patch_model and the rest from the package (`from tiledmlp import "
            "patch_model`), or `import tiledmlp.integrations` before the model runs"
        )


def run_checks(module: nn.Module) -> None:
    if not dist.is_available() or not dist.is_initialized():
        return
    _engines_registered()
    for check in _CHECKS:
        check(module)


def register_backend(provider: Callable[[nn.Module], ParamBackend | None]) -> None:
    """Adds a provider asked, per tiled call, for the module's parameter backend."""
    if provider not in _BACKENDS:
        _BACKENDS.append(provider)


def backend_for(module: nn.Module) -> ParamBackend | None:
    """The first backend a registered engine provides for `module`, else None (local)."""
    if not dist.is_available() or not dist.is_initialized():
        return None
    _engines_registered()
    for provider in _BACKENDS:
        backend = provider(module)
        if backend is not None:
            return backend
    return None
