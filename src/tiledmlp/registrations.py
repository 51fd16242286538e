"""Registrations, declared: each engine check, engine parameter backend and sequence
parallelism's attention backend, named with the module (and attribute) that provides it.

The lower layers look their providers up here where they use them: the engines' checks and
backends (patching/engine_registry.py) and the attention backend
(sequence_parallel/attention_backend.py) live in higher layers (integrations, patching).

Invariant: the only import from a lower layer into a higher one in the package, and a late one:
`provided` imports a provider's module by name (importlib) the first time it is asked, so what a
lookup finds does not depend on what the process imported before. Nothing is imported here at
import time (stdlib only).
"""

from __future__ import annotations

import functools
import importlib
from typing import Any

__all__ = ["ATTENTION_BACKEND", "ENGINE_BACKENDS", "ENGINE_CHECKS", "provided", "provided_all"]

# engine -> "module:attribute" of a check run on every tiled call under torch.distributed,
# (module) -> None, raising for a layout the engine cannot run tiled
ENGINE_CHECKS: dict[str, str] = {
    "fsdp": "tiledmlp.integrations.fsdp:check_mlp",
}
# engine -> "module:attribute" of a provider asked, per tiled call, for the module's parameter
# backend, (module) -> ParamBackend | None (ops/tiling/backend.py)
ENGINE_BACKENDS: dict[str, str] = {
    "deepspeed": "tiledmlp.integrations.deepspeed:backend_for",
}
# "module:attribute" of sequence parallelism's AttentionBackend (Hugging Face transformers')
ATTENTION_BACKEND = "tiledmlp.patching.hf_attention:HF_ATTENTION"


@functools.cache
def provided(where: str) -> Any:
    """The object `where` ("module:attribute") names, its module imported on first use.

    Raises:
        ValueError: `where` is not "module:attribute".
    """
    module, colon, name = where.partition(":")
    if not colon or not module or not name:
        raise ValueError(f"a registration names 'module:attribute', got {where!r}")
    return getattr(importlib.import_module(module), name)


def provided_all(table: dict[str, str]) -> list[Any]:
    """The objects a table of registrations names, in its order."""
    return [provided(where) for where in table.values()]
