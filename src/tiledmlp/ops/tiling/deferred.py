"""Registrations a higher layer makes on first need instead of at import.

The package facade (tiledmlp/__init__.py) imports nothing heavy, so that a command such as a
repeated `tiledmlp plan` answers without torch; the engines' checks and backends
(patching/engine_registry.py) and sequence parallelism's attention backend
(sequence_parallel/attention_backend.py) are registered by the integrations and the patching
layer when those are imported. The facade defers that import here; a registry that finds itself
empty when asked calls `load_deferred()` before it refuses, so a process that imported only a
deep module (`from tiledmlp.sequence_parallel import ...`, `tiledmlp check` under torchrun)
gets its registrations too.

Invariant: nothing here imports anything; each loader runs at most once.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["defer", "load_deferred"]

_LOADERS: list[Callable[[], object]] = []


def defer(loader: Callable[[], object]) -> None:
    """Adds `loader`, run by the first load_deferred()."""
    _LOADERS.append(loader)


def load_deferred() -> None:
    """Runs the deferred loaders not yet run, in the order they were deferred."""
    while _LOADERS:
        _LOADERS.pop(0)()
