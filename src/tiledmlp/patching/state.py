"""What a patched MLP records on its instance, and the forward it replaced.

Detection (detect.py) reads the original forward of an already patched module, the tiling
features (features/tiled_modules.py, features/tiled_layers/) write the record: all import this
module. A record's kind says which feature owns the module: NORM_KIND (tiled norms),
LAYER_KIND (tiled decoder layers), any other (tiled MLPs: the MLP's kind).

Invariant: a module is patched exactly when its __dict__ holds a PatchState under STATE.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from tiledmlp.config.tiled import TiledMLPConfig
from tiledmlp.ops.tiling.tiles import TileCount
from tiledmlp.patching.agreement import StepTokens

__all__ = ["LAYER_KIND", "NORM_KIND", "STATE", "PatchState", "original_forward"]

STATE = "_tiledmlp_patch"
NORM_KIND = "norm"
LAYER_KIND = "decoder layer"


@dataclass
class PatchState:
    """The record of one patched module."""

    saved: Any  # the instance-level forward that was replaced; None when the class's was in use
    config: TiledMLPConfig
    path: str
    kind: str
    per_token_args: int
    step: StepTokens
    count: TileCount = field(default_factory=TileCount)


def original_forward(module: nn.Module) -> Callable[..., Any]:
    """The module's forward as it was before patching (bound), or its current forward."""
    state = module.__dict__.get(STATE)
    if state is None:
        return module.forward
    if state.saved is None:
        return type(module).forward.__get__(module)
    return state.saved  # type: ignore[no-any-return]
