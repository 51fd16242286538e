"""tiledmlp: tiled MLPs for long-sequence training with exact gradients and minimal recompute.

The MLP of a decoder layer runs over the tokens in tiles, keeps none of its big intermediates,
and recomputes only what it must, tile by tile, in the backward.

Invariant: importing the package imports nothing else (no torch: `tiledmlp plan` answers a
question asked before without it); the first public name read from it (`tiledmlp.patch_model`,
`from tiledmlp import patch_model`) or sub-package read as an attribute (`tiledmlp.patching`)
imports the module that defines it (PEP 562). The engines' checks and sequence parallelism's
attention backend are declared in tiledmlp/registrations.py and imported where first used, so
a process that imports only deep modules finds them too.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the names below, for type checkers and editors
    from tiledmlp.config import PatchConfig, TiledMLPConfig, TilePolicy
    from tiledmlp.module import TiledMLP
    from tiledmlp.ops import TiledMLPFunction, TilePlan, tiled_mlp
    from tiledmlp.ops.loss.cross_entropy import (
        CrossEntropyOutput,
        TokenStats,
        tiled_cross_entropy,
        tiled_token_logprobs,
        tiled_token_stats,
    )
    from tiledmlp.patching import PatchReport, patch_from_args, patch_model, unpatch_model
    from tiledmlp.patching.check import check
    from tiledmlp.patching.check_result import CheckResult

__version__ = "0.1.0"

# public name -> the module that defines it
_HOMES = {
    "PatchConfig": "tiledmlp.config",
    "TiledMLPConfig": "tiledmlp.config",
    "TilePolicy": "tiledmlp.config",
    "TiledMLP": "tiledmlp.module",
    "TiledMLPFunction": "tiledmlp.ops",
    "TilePlan": "tiledmlp.ops",
    "tiled_mlp": "tiledmlp.ops",
    "CrossEntropyOutput": "tiledmlp.ops.loss.cross_entropy",
    "TokenStats": "tiledmlp.ops.loss.cross_entropy",
    "tiled_cross_entropy": "tiledmlp.ops.loss.cross_entropy",
    "tiled_token_logprobs": "tiledmlp.ops.loss.cross_entropy",
    "tiled_token_stats": "tiledmlp.ops.loss.cross_entropy",
    "PatchReport": "tiledmlp.patching",
    "patch_from_args": "tiledmlp.patching",
    "patch_model": "tiledmlp.patching",
    "unpatch_model": "tiledmlp.patching",
    "check": "tiledmlp.patching.check",
    "CheckResult": "tiledmlp.patching.check_result",
}


def __getattr__(name: str) -> Any:
    """A public name, imported on first use (module docstring); then kept in the module."""
    home = _HOMES.get(name)
    if home is None:  # a sub-package read as an attribute (`tiledmlp.patching.tile_counts`)
        if name.startswith("_") or importlib.util.find_spec(f"tiledmlp.{name}") is None:
            raise AttributeError(f"module 'tiledmlp' has no attribute {name!r}")
        return importlib.import_module(f"tiledmlp.{name}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOMES))


def enable(
    config: PatchConfig | None = None, *, check: bool = False, **patch_kwargs: object
) -> None:
    """Patches every causal LM transformers builds from now on with `config` or patch_model's
    keyword options, parsed once into a PatchConfig, after tiledmlp.check passes on it where
    `check` is set (see tiledmlp.integrations.hf.enable); `disable()` undoes it."""
    from tiledmlp.integrations.hf import enable as _enable

    _enable(config, check=check, **patch_kwargs)


def disable() -> None:
    """Undoes enable() (see tiledmlp.integrations.hf.disable)."""
    from tiledmlp.integrations.hf import disable as _disable

    _disable()


__all__ = [
    "CheckResult",
    "CrossEntropyOutput",
    "PatchConfig",
    "PatchReport",
    "TilePlan",
    "TilePolicy",
    "TiledMLP",
    "TiledMLPConfig",
    "TiledMLPFunction",
    "TokenStats",
    "__version__",
    "check",
    "disable",
    "enable",
    "patch_from_args",
    "patch_model",
    "tiled_cross_entropy",
    "tiled_mlp",
    "tiled_token_logprobs",
    "tiled_token_stats",
    "unpatch_model",
]
