"""tiledmlp: tiled MLPs for long-sequence training with exact gradients and minimal recompute.

The MLP of a decoder layer runs over the tokens in tiles, keeps none of its big intermediates,
and recomputes only what it must, tile by tile, in the backward.
"""

from tiledmlp import integrations  # noqa: F401  (registers the engines' checks)
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
