"""What turns a planner's stack on, in each place a user can: `tiledmlp train` flags, a
`patch_model(...)` call and axolotl's keys, derived from the stack's PatchConfig
(config/stacks.py) and the option schema (config/schema.py), never written out per stack.

Invariant: the flags given to `tiledmlp train` (on its defaults) turn on exactly the stack's
features; the call and the keys set exactly stack_keywords(stack).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tiledmlp.config.patch import FEATURES, PatchConfig
from tiledmlp.config.schema import option_of
from tiledmlp.config.stacks import STACK_PATCHES, stack_keywords

__all__ = ["axolotl_keys", "patch_call", "train_flags"]


def _our_key(field: str) -> str:
    """The main key of PatchConfig's `field` (use_tiled_mlp, tiled_loss, ...)."""
    spec = option_of(next(f for f in dataclasses.fields(PatchConfig) if f.name == field))
    assert spec is not None  # every feature field carries its option
    return next(k.name for k in spec.keys if k.ours)


def train_flags(stack: str) -> list[str]:
    """The `tiledmlp train` flags of `stack`, over train's defaults (the tiled MLPs and the
    tiled loss); checkpointing is added where the stack offloads (it needs it)."""
    from tiledmlp.train.defaults import DEFAULT_PATCH

    patch = STACK_PATCHES[stack]
    if patch is None:
        return [f"--{_our_key('tiled_mlp').replace('_', '-')}", "false"]
    flags: list[str] = []
    if patch.activation_offloading:
        flags.append("--gradient-checkpointing")
    for field in FEATURES:
        want, default = bool(getattr(patch, field)), bool(getattr(DEFAULT_PATCH, field))
        if want != default:
            flags += [f"--{_our_key(field).replace('_', '-')}"] + ([] if want else ["false"])
    return flags


def patch_call(stack: str, extra: dict[str, Any] | None = None) -> str:
    """`patch_model(model, ...)` with the stack's keywords (and `extra`); '' for "untiled"."""
    options = stack_keywords(stack)
    if options is None:
        return ""
    kwargs = {**options, **(extra or {})}
    return "patch_model(model" + "".join(f", {k}={v!r}" for k, v in kwargs.items()) + ")"


def axolotl_keys(stack: str) -> list[str]:
    """The axolotl config lines (the tiledmlp plugin's keys) of `stack`; [] for "untiled"."""
    options = stack_keywords(stack)
    if options is None:
        return []
    lines = ["plugins: [tiledmlp.integrations.axolotl.TiledMLPPlugin]", "tiledmlp: true"] + [
        f"tiledmlp_{k}: {str(v).lower()}" for k, v in options.items()
    ]
    if options.get("activation_offloading"):
        lines.append("gradient_checkpointing: true")
    return lines
