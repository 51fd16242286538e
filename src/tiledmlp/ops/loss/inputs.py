"""The inputs of the tiled LM-head losses, checked and laid out once: the shifted targets and
what counts, the tile plan of the tokens, and the flattened hidden states with their autocast
state.

Invariant: a check raises before any tile runs; labels are compared and gathered as int64 so
that ignore_index=-100 never wraps around in a narrow dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tiledmlp.ops.tiling.policy import TilePolicy
from tiledmlp.ops.tiling.probe import absent
from tiledmlp.ops.tiling.state import AutocastState
from tiledmlp.ops.tiling.tiles import TilePlan, split_by_tile_tokens, split_even

__all__ = [
    "LOSS_MIN_TILE_BYTES",
    "HeadInput",
    "check_inputs",
    "loss_plan",
    "shift_labels",
    "shift_tokens",
    "targets_of",
]


def shift_labels(labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Causal-LM targets: position t predicts labels[..., t + 1]; the last position is ignored.

    Args:
        labels: (batch, seq) or (seq,) integer labels.
    """
    return shift_tokens(labels, ignore_index)


def shift_tokens(t: torch.Tensor, fill: int | bool) -> torch.Tensor:
    """t[..., 1:] with `fill` appended along the last dimension."""
    pad = torch.full((*t.shape[:-1], 1), fill, dtype=t.dtype, device=t.device)
    return torch.cat([t[..., 1:], pad], dim=-1)


#: "auto" never makes loss tiles whose float32 logits are smaller than this (see loss_plan)
LOSS_MIN_TILE_BYTES = 256 * 2**20


def loss_plan(num_tokens: int, hidden: int, vocab: int, elem: int, policy: TilePolicy) -> TilePlan:
    """The loss's tiles over `num_tokens` tokens under `policy` (a count, tokens per tile or
    "auto").

    "auto": tiles of max(hidden * elem / 4, LOSS_MIN_TILE_BYTES / (4 * vocab)) tokens: a tile's
    float32 logits (n x vocab x 4 bytes) are about the size of the LM-head weight (vocab x
    hidden x elem), and never under 256 MiB, so a small vocabulary (a byte tokenizer's 258)
    runs as one tile instead of many tiny ones whose per-tile costs (launches, a pass over the
    weight-sized gradient accumulator) would exceed the logits they spare; one tile when the
    whole input's logits are that small.
    """
    if policy.rule in ("arctic", "target"):
        raise ValueError(
            f"num_tiles={policy.num_tiles!r} is an MLP policy; give the loss an int or 'auto' "
            "(TilePolicy.for_loss() derives one)"
        )
    if policy.rule == "auto":
        per_tile = max(1, hidden * elem // 4, math.ceil(LOSS_MIN_TILE_BYTES / (4 * max(vocab, 1))))
        return split_even(num_tokens, max(1, math.ceil(num_tokens / per_tile)))
    if policy.rule == "tokens":
        return split_by_tile_tokens(num_tokens, int(policy.amount))
    return split_even(num_tokens, int(policy.amount))


def check_inputs(
    hidden_states: torch.Tensor,
    lm_head_weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None,
    softcap: float | None,
    mask: torch.Tensor | None,
    what: str,
) -> None:
    op = "tiled_cross_entropy" if what == "labels" else "tiled_token_logprobs"
    if not isinstance(hidden_states, torch.Tensor) or not hidden_states.is_floating_point():
        raise TypeError(f"{op}: hidden_states must be a floating-point tensor")
    if hidden_states.dim() not in (2, 3):
        raise ValueError(
            f"{op}: hidden_states must be (batch, seq, hidden) or (tokens, hidden), got "
            f"{tuple(hidden_states.shape)}"
        )
    if lm_head_weight.dim() != 2 or lm_head_weight.shape[1] != hidden_states.shape[-1]:
        raise ValueError(
            f"{op}: lm_head_weight must be (vocab, {hidden_states.shape[-1]}), got "
            f"{tuple(lm_head_weight.shape)}"
        )
    if labels.dtype.is_floating_point or labels.dtype.is_complex or labels.dtype == torch.bool:
        raise TypeError(f"{op}: {what} must be integer class indices, got {labels.dtype}")
    if tuple(labels.shape) != tuple(hidden_states.shape[:-1]):
        raise ValueError(
            f"{op}: {what} must have shape {tuple(hidden_states.shape[:-1])} (one per token), "
            f"got {tuple(labels.shape)}"
        )
    if bias is not None and tuple(bias.shape) != (lm_head_weight.shape[0],):
        raise ValueError(
            f"{op}: bias must be ({lm_head_weight.shape[0]},), got {tuple(bias.shape)}"
        )
    if softcap is not None and not softcap >= 0:
        raise ValueError(
            f"{op}: softcap must be positive, or None / 0 for no capping, got {softcap!r}"
        )
    if mask is not None and (mask.dtype != torch.bool or tuple(mask.shape) != tuple(labels.shape)):
        raise ValueError(
            f"{op}: mask must be a bool tensor of {what}' shape {tuple(labels.shape)} (True = the "
            f"token counts), got {mask.dtype} {tuple(mask.shape)}"
        )


def targets_of(
    labels: torch.Tensor,
    mask: torch.Tensor | None,
    shift: bool,
    ignore_index: int,
    vocab: int,
    op: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(targets, counted), flat. Labels of any integer dtype are compared and gathered as
    int64, so ignore_index=-100 never wraps around in a narrow dtype."""
    labels = labels.long()
    targets = shift_labels(labels, ignore_index) if shift else labels
    counted = targets != ignore_index
    if mask is not None:
        counted = counted & (shift_tokens(mask, False) if shift else mask)
    targets, counted = targets.reshape(-1), counted.reshape(-1)
    out_of_range = counted & ((targets < 0) | (targets >= vocab))
    if not absent(targets) and bool(out_of_range.any()):  # fake tensors (planning): no values
        raise ValueError(
            f"{op}: labels must be in [0, {vocab}) or equal ignore_index={ignore_index}"
        )
    return targets, counted


@dataclass(frozen=True)
class HeadInput:
    """The LM head's input as its tile loop takes it.

    Attributes:
        hidden: (tokens, hidden), the input flattened.
        autocast: the autocast state captured for the loop.
        wide: the softmax's dtype (the compute dtype promoted to at least float32).
        plan: the tiles over the tokens.
    """

    hidden: torch.Tensor
    autocast: AutocastState
    wide: torch.dtype
    plan: TilePlan

    @classmethod
    def of(
        cls,
        hidden_states: torch.Tensor,
        lm_head_weight: torch.Tensor,
        policy: TilePolicy,
    ) -> HeadInput:
        hidden = hidden_states.reshape(-1, hidden_states.shape[-1])
        autocast = AutocastState.capture(hidden.device.type)
        cd = autocast.compute_dtype(hidden.dtype, lm_head_weight.dtype) or hidden.dtype
        elem = torch.empty((), dtype=cd).element_size()
        vocab = lm_head_weight.shape[0]
        plan = loss_plan(hidden.shape[0], hidden.shape[1], vocab, elem, policy)
        return cls(hidden, autocast, torch.promote_types(cd, torch.float32), plan)
