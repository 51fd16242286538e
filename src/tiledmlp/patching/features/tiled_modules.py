"""What the tiled MLPs, tiled norms and tiled decoder layers share: a PatchState on each module
they tile (patching/state.py), the forward installed on a tiled MLP or norm, and the root's
once-per-step token agreement (patching/agreement.py), alive while any module is tiled.

Each of the three features owns the modules whose PatchState has its kind ("norm", "decoder
layer", or any other kind: an MLP); removing a feature restores its modules alone.

Invariant: a tiled module computes what its original forward computes, with the same
gradients; tiling a module again updates its tile policy.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from tiledmlp.config.patch import PatchConfig
from tiledmlp.config.tiled import TiledMLPConfig
from tiledmlp.ops.mlp.functional import run_tiled_mlp
from tiledmlp.ops.mlp.structure import recognise
from tiledmlp.ops.mlp.untiled import UntiledCall
from tiledmlp.ops.tiling.tiles import TileCount
from tiledmlp.patching.agreement import StepTokens, remove_agreement, step_tokens
from tiledmlp.patching.bound import BoundForward, bind
from tiledmlp.patching.detect import Candidate, hidden_size_of
from tiledmlp.patching.engine_registry import backend_for, run_checks
from tiledmlp.patching.features.base import Feature
from tiledmlp.patching.report import ReportParts
from tiledmlp.patching.state import STATE, PatchState, original_forward

__all__ = [
    "ModuleTiling",
    "Owns",
    "blocked_modules",
    "describe_modules",
    "hidden_size",
    "patch_module",
    "remove_modules",
    "tile_candidates",
    "reset_tile_counts",
    "tile_counts",
    "tiled_forward",
]

#: which tiled modules a feature owns, by their PatchState
Owns = Callable[[PatchState], bool]


def hidden_size(model: nn.Module, config: PatchConfig) -> int:
    """The hidden size of the model's MLPs and norms: the config's, else the model's."""
    hidden = config.hidden_size if config.hidden_size is not None else hidden_size_of(model)
    if hidden is None:
        raise ValueError(
            f"patch_model: cannot tell the hidden size of {type(model).__name__} (no "
            "config.hidden_size and no nn.Embedding); pass hidden_size=..."
        )
    return hidden


def tiled_forward(self: nn.Module, x: Any, *args: Any, **kwargs: Any) -> Any:
    """The tiled forward installed on patched modules (bound to the instance with
    patching.bound.bind, so a deepcopy or an unpickled copy of a patched model runs its own
    weights)."""
    state: PatchState = self.__dict__[STATE]
    orig = original_forward(self)
    if (
        kwargs
        or len(args) != state.per_token_args
        or not isinstance(x, torch.Tensor)
        or x.dim() not in (2, 3)  # e.g. a norm over (batch, seq, heads, head_dim) (xLSTM)
    ):
        return orig(x, *args, **kwargs)  # an unexpected call shape: leave it untiled
    run_checks(self)
    return run_tiled_mlp(
        self,
        x,
        *args,
        policy=state.config.policy,
        forward=orig,
        backend=backend_for(self),
        plan_tokens=state.step.value,
        count=state.count,
        kernels=state.config.kernels,
    )


def patch_module(
    module: nn.Module, cand: Candidate, config: TiledMLPConfig, step: StepTokens
) -> None:
    """Installs tiled_forward on `module` (a tiled module takes the new policy and step)."""
    existing = module.__dict__.get(STATE)
    if existing is not None:
        existing.config = config  # idempotent; a new policy replaces the old one
        existing.step = step
        return
    state = PatchState(
        module.__dict__.get("forward"), config, cand.path, cand.kind, cand.per_token_args, step
    )
    module.__dict__[STATE] = state
    # recognised now, eagerly: a compiled model's trace reads what the probe found (ops/mlp/traced.py)
    if not cand.per_token_args:
        recognise(module, UntiledCall(module, original_forward(module)))
    module.forward = bind(tiled_forward, module, original_forward)  # type: ignore[method-assign]


def _owned(model: nn.Module, owns: Owns) -> list[tuple[str, nn.Module, PatchState]]:
    found = []
    for name, module in model.named_modules():
        state = module.__dict__.get(STATE)
        if state is not None and owns(state):
            found.append((name, module, state))
    return found


def _ours_on_top(module: nn.Module, forward: Callable[..., Any]) -> bool:
    fwd = module.__dict__.get("forward")
    return isinstance(fwd, BoundForward) and fwd.func is forward and fwd.module is module


def blocked_modules(
    model: nn.Module, owns: Owns, forward: Callable[..., Any] = tiled_forward
) -> list[str]:
    """Why tiled modules cannot be restored: another forward sits over ours (`forward`, the
    one the feature installs)."""
    return [
        f"cannot restore {name or '<root>'} ({type(module).__name__}): another forward was "
        "installed over the tiled one, and removing ours would remove it too. Remove that one "
        "first (or leave the model patched)"
        for name, module, _ in _owned(model, owns)
        if not _ours_on_top(module, forward)
    ]


def remove_modules(model: nn.Module, owns: Owns, keys: tuple[str, ...] = ()) -> list[str]:
    """Restores the owned modules' forwards (and drops their `keys`); the root's agreement
    goes with the last tiled module. Returns the restored modules' names."""
    restored = []
    for name, module, state in _owned(model, owns):
        del module.__dict__[STATE]
        for key in keys:
            module.__dict__.pop(key, None)
        if state.saved is None:
            module.__dict__.pop("forward", None)
        else:
            module.forward = state.saved  # type: ignore[method-assign]
        restored.append(name)
    if not _owned(model, lambda _: True):
        remove_agreement(model)
    return restored


def describe_modules(
    model: nn.Module,
    owns: Owns,
    report: ReportParts,
    forward: Callable[..., Any] = tiled_forward,
) -> None:
    """The owned modules' paths as they are now (a fast-path module whose children changed
    since, e.g. PEFT adapters injected, is described as the generic path it now takes; one
    whose tiled forward another library covered since, e.g. Liger's kernels applied by a
    Trainer after patching, is said to run that forward instead)."""
    for name, module, state in _owned(model, owns):
        report.config = state.config
        if not _ours_on_top(module, forward):
            top = module.__dict__.get("forward")
            func = getattr(top, "__func__", top)
            where = f"{getattr(func, '__module__', '?')}.{getattr(func, '__qualname__', '?')}"
            report.paths[name] = (
                f"{state.path}: {state.kind}, covered: {where}, installed over the tiled "
                "forward since, runs instead (patch after it to tile it)"
            )
        elif (
            state.path == "fast"
            and recognise(module, UntiledCall(module, original_forward(module))) is None
        ):
            report.paths[name] = "generic: changed since patching (e.g. adapters injected)"
        else:
            report.paths[name] = f"{state.path}: {state.kind}"


class ModuleTiling(Feature):
    """A feature that tiles modules of the model: it owns the modules whose PatchState its
    `owns` accepts, and blocks, removes and describes those alone."""

    removed_keys: tuple[str, ...] = ()  # per-module entries the feature adds beside its state
    installed_forward: Callable[..., Any] = staticmethod(tiled_forward)  # what it installs

    def owns(self, state: PatchState) -> bool:
        raise NotImplementedError

    def blocked(self, model: nn.Module) -> list[str]:
        return blocked_modules(model, self.owns, self.installed_forward)

    def remove(self, model: nn.Module) -> list[str]:
        return remove_modules(model, self.owns, keys=self.removed_keys)

    def describe(self, model: nn.Module, report: ReportParts) -> None:
        describe_modules(model, self.owns, report, self.installed_forward)


def tile_candidates(
    model: nn.Module, candidates: list[Candidate], config: PatchConfig, report: ReportParts
) -> None:
    """Tiles each candidate module (the MLPs or the norms) and reports its path."""
    if candidates:
        step = step_tokens(model)
        for cand in candidates:
            patch_module(cand.module, cand, config.mlp_config, step)
    report.paths.update({c.name: f"{c.path}: {c.kind}" for c in candidates})


def reset_tile_counts(model: nn.Module) -> None:
    """Zeroes every tiled module's tile count: patch_model's probes may run tiled modules, and
    tile_counts counts the model's own calls only."""
    for module in model.modules():
        state = module.__dict__.get(STATE)
        if state is not None:
            state.count.calls = state.count.tiles = state.count.last = 0


def tile_counts(model: nn.Module) -> dict[str, TileCount]:
    """How many tiles each patched module of `model` ran since it was patched (the MLPs, and
    the norms where they are tiled), by qualified name (an untiled call counts 1 tile; `last` is
    the latest call's count). Calls made by patch_model's own probes are not counted."""
    return {
        name: module.__dict__[STATE].count
        for name, module in model.named_modules()
        if STATE in module.__dict__
    }
