"""The named stacks of features that the planner predicts and the measurement suite measures.

Each stack adds one feature to the one before it; `STACK_PATCHES` holds the PatchConfig that
turns a stack on (None: the model is left unpatched), at the default tile policy
(`stack_patch` gives it another). The names are public: the planner's JSON keys and the CLI's
`--stacks` values.

Invariant: the planner and the suite use these names and configs alone, so a prediction and its
measurement always describe the same model.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from tiledmlp.config.patch import FEATURES, PatchConfig
from tiledmlp.ops.tiling.policy import TilePolicy

__all__ = ["STACKS", "STACK_PATCHES", "StackRow", "stack_keywords", "stack_of", "stack_patch"]

STACK_PATCHES: dict[str, PatchConfig | None] = {
    "untiled": None,
    "tiled_mlp": PatchConfig(),
    "tiled_mlp_loss": PatchConfig(tiled_loss=True),
    "tiled_mlp_loss_offload": PatchConfig(tiled_loss=True, activation_offloading=True),
    "tiled_mlp_loss_offload_norms": PatchConfig(
        tiled_loss=True, activation_offloading=True, tiled_norms=True
    ),
    "tiled_layer": PatchConfig(
        tiled_loss=True, activation_offloading=True, tiled_norms=True, tiled_layers=True
    ),
}
STACKS: tuple[str, ...] = tuple(STACK_PATCHES)


def _features(patch: PatchConfig | None) -> frozenset[str]:
    return frozenset() if patch is None else frozenset(f for f in FEATURES if getattr(patch, f))


# the features in the order the stacks add them (each stack's one more), tiled_mlp first
_ADDED: tuple[str, ...] = tuple(
    dict.fromkeys(f for p in STACK_PATCHES.values() for f in FEATURES if f in _features(p))
)


def stack_patch(
    stack: str,
    tiles: TilePolicy = TilePolicy(),  # noqa: B008 (frozen: shared safely)
) -> PatchConfig | None:
    """The PatchConfig of the named `stack` with the tile policy `tiles` (None: untiled).

    Raises:
        ValueError: an unknown stack name.
        TypeError: `tiles` is not a TilePolicy.
    """
    if not isinstance(tiles, TilePolicy):
        raise TypeError(
            f"stack_patch: tiles must be a TilePolicy (e.g. TilePolicy.of(4), TilePolicy.of("
            f"'arctic')), got {tiles!r}"
        )
    if stack not in STACK_PATCHES:
        raise ValueError(f"stack must be one of {', '.join(STACKS)}, got {stack!r}")
    patch = STACK_PATCHES[stack]
    if patch is None:
        return None
    return dataclasses.replace(patch, tiles=tiles)


def stack_of(patch: PatchConfig | None) -> str | None:
    """The name of the stack whose features `patch` turns on ("untiled" for None, or for a
    patch with no feature on), or None where no named stack has them."""
    on = _features(patch)
    return next((s for s, p in STACK_PATCHES.items() if _features(p) == on), None)


def stack_keywords(stack: str) -> dict[str, bool] | None:
    """The patch_model keywords that turn `stack` on over patch_model's defaults (the tiled
    MLPs are on by default), in the order the stacks add them; None for "untiled". For text
    that spells a stack out: a `patch_model(...)` call, a framework's keys."""
    patch = STACK_PATCHES[stack]
    if patch is None:
        return None
    return {f: True for f in _ADDED if f != "tiled_mlp" and getattr(patch, f)}


_HF_OFFLOAD, _EVERY = "+hf_offload", "+every_"


@dataclass(frozen=True)
class StackRow:
    """A row of the whole-model plan: a named stack, with transformers' own checkpointing
    options where set (its name, the plan's JSON key: "<stack>[+hf_offload][+every_<N>]").

    Attributes:
        stack: one of STACKS.
        every_n_layers: N > 1: only every N-th decoder layer checkpointed
            (activation_checkpointing_enable(every_n_layers=N)).
        transformers_offload: transformers' activation_checkpointing_enable(offload=True).
    """

    stack: str
    every_n_layers: int = 1
    transformers_offload: bool = False

    @property
    def name(self) -> str:
        every = f"{_EVERY}{self.every_n_layers}" if self.every_n_layers > 1 else ""
        return f"{self.stack}{_HF_OFFLOAD if self.transformers_offload else ''}{every}"

    @classmethod
    def of(cls, name: str) -> StackRow:
        """The row named `name`.

        Raises:
            ValueError: not a stack name with optional +hf_offload and +every_<N> (N > 1).
        """
        stack, every, offload = name, 1, False
        if _EVERY in stack:
            stack, _, n = stack.rpartition(_EVERY)
            every = int(n) if n.isdigit() and int(n) > 1 else 0
        if stack.endswith(_HF_OFFLOAD):
            stack, offload = stack[: -len(_HF_OFFLOAD)], True
        if stack not in STACK_PATCHES or every == 0:
            raise ValueError(
                f"a plan's row is a stack ({', '.join(STACKS)}) with optional {_HF_OFFLOAD} and "
                f"{_EVERY}<N> (N > 1), e.g. tiled_mlp_loss{_HF_OFFLOAD}{_EVERY}2; got {name!r}"
            )
        return cls(stack, every, offload)
