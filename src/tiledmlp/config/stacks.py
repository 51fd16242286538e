"""The named stacks of features that the planner predicts and the measurement suite measures.

Each stack adds one feature to the one before it; `STACK_OPTIONS` holds the `patch_model`
keywords that turn a stack on (None: the model is left unpatched).

Invariant: the planner and the suite use these names and options alone, so a prediction and its
measurement always describe the same model.
"""

from __future__ import annotations

from typing import Any

__all__ = ["STACKS", "STACK_OPTIONS", "stack_option"]

STACK_OPTIONS: dict[str, dict[str, Any] | None] = {
    "untiled": None,
    "tiled_mlp": {},
    "tiled_mlp_loss": {"tiled_loss": True},
    "tiled_mlp_loss_offload": {"tiled_loss": True, "activation_offloading": True},
    "tiled_mlp_loss_offload_norms": {
        "tiled_loss": True,
        "activation_offloading": True,
        "tiled_norms": True,
    },
    "tiled_layer": {
        "tiled_loss": True,
        "activation_offloading": True,
        "tiled_norms": True,
        "tiled_layers": True,
    },
}
STACKS: tuple[str, ...] = tuple(STACK_OPTIONS)


def stack_option(stack: str, name: str) -> bool:
    """Whether `stack` turns on the patch_model option `name` ("tiled_mlp": any patched stack)."""
    options = STACK_OPTIONS[stack]
    if options is None:
        return False
    return name == "tiled_mlp" or bool(options.get(name, False))
