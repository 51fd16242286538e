"""Rank-consistent tile counts, agreed once per step.

A forward pre-hook on the patched model's root all-reduces (MAX) the number of tokens each rank
feeds in this step; every tiled MLP of the model then resolves its tile policy for that count and
splits its own tokens into that many tiles. Ranks whose sequence lengths differ therefore run
the same number of tiles in every layer, at the cost of one tiny all-reduce per step (not per
layer). Without an initialised process group (or with one rank) nothing is exchanged.

Invariant: every rank calls the all-reduce exactly once per root forward, whatever its inputs
(a rank without a recognisable input contributes 0), so the collective itself cannot deadlock.
The root holds one agreement while any module of it is tiled (step_tokens installs it,
remove_agreement takes it off).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle

from tiledmlp.sequence_parallel.collectives import guarded

__all__ = ["StepTokens", "agree", "install_agreement", "remove_agreement", "step_tokens"]

_AGREEMENT = "_tiledmlp_agreement"


@dataclass
class StepTokens:
    """The largest token count over ranks in the current step, or None (single process)."""

    value: int | None = None


def _local_tokens(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[int, torch.device | None]:
    for t in (kwargs.get("input_ids"), kwargs.get("inputs_embeds"), *args[:1]):
        if isinstance(t, torch.Tensor):
            n = t.numel() // t.shape[-1] if t.is_floating_point() and t.dim() > 0 else t.numel()
            return n, t.device
    return 0, None


def agree(
    step: StepTokens, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    """The forward pre-hook: stores the largest token count over ranks in `step`."""
    del module
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        step.value = None
        return
    n, device = _local_tokens(args, kwargs)
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    t = torch.tensor([n], dtype=torch.int64, device=device or torch.device("cpu"))
    with guarded("the per-step token agreement (tiled MLPs)"):
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    step.value = int(t.item())


def install_agreement(model: nn.Module, step: StepTokens) -> RemovableHandle:
    """Registers the once-per-step agreement on `model` (the root the user calls).

    The hook is a partial of a module-level function over `step`: a deepcopy of the model gets
    a hook writing into the copy's own StepTokens (the one its patched MLPs read), and the model
    pickles.
    """
    return model.register_forward_pre_hook(functools.partial(agree, step), with_kwargs=True)


def step_tokens(model: nn.Module) -> StepTokens:
    """The root's once-per-step token count, its agreement installed on first use."""
    existing = model.__dict__.get(_AGREEMENT)
    if existing is not None:
        return existing[0]  # type: ignore[no-any-return]
    step = StepTokens()
    model.__dict__[_AGREEMENT] = (step, install_agreement(model, step))
    return step


def remove_agreement(model: nn.Module) -> bool:
    """Takes the root's agreement off; returns whether it had one."""
    agreement = model.__dict__.pop(_AGREEMENT, None)
    if agreement is None:
        return False
    agreement[1].remove()
    return True
