"""The exact token-weighted loss over sequences split across a sequence-parallel group.

Each rank of an SP group scores its own tokens: a local sum s_r of per-token losses over n_r
counted (not ignored) tokens. The loss of the group's batch is L = sum_r s_r / sum_r n_r, the
same on every rank of the group (or sum_r s_r / M for a given denominator M, e.g. Hugging
Face's num_items_in_batch for gradient accumulation over micro-batches).

Invariant (the gradient contract): the returned loss has the value L on every rank and the
gradient P * ds_r / N on rank r (N = sum_r n_r, or M). Gradients summed over the SP group give
P * dL, so an engine that averages gradients over the whole world of W = P * D ranks (DDP,
FSDP/FSDP2, DeepSpeed ZeRO over the default group, as they do) ends with
(1 / W) * sum_d P * dL_d = mean_d dL_d: the single-process gradient of the mean of the D
replicas' losses. A group whose tokens are all ignored gets L = 0 with zero gradients on every
rank (what untiled training gives: no signal, and every rank takes the same step).

A loss that is already exact carries a marker (its autograd node, and an attribute for losses
computed without gradients); reducing it again raises instead of silently scaling it by P.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from tiledmlp.sequence_parallel.collectives import guarded
from tiledmlp.sequence_parallel.groups import SequenceParallelGroups

__all__ = [
    "count_tokens",
    "is_exact_loss",
    "sequence_parallel_loss",
    "sequence_parallel_loss_from_mean",
]

_MARK = "_tiledmlp_sequence_parallel_exact"
# how far up a loss's graph a marker is looked for (loss * 1.0, loss.float(), loss / k, ...)
_SEARCH_NODES = 8


class _ExactLoss(torch.autograd.Function):
    """value in the forward; the upstream gradient times `scale` for local_sum in the backward.
    Its node marks a loss as already exact over the SP group."""

    @staticmethod
    def forward(ctx: Any, local_sum: torch.Tensor, value: torch.Tensor, scale: float) -> Any:
        ctx.scale = scale
        return value.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        return grad * ctx.scale, None, None


def count_tokens(shift_labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """The number of counted targets in (batch, seq/P) shift_labels, a 0-dim int64 tensor."""
    return (shift_labels != ignore_index).sum()


def is_exact_loss(loss: Any) -> bool:
    """Whether `loss` is (or is computed from, a few operations up) a loss already reduced over
    the sequence-parallel group: the model's loss under sequence parallelism, or a result of
    sequence_parallel_loss."""
    if not isinstance(loss, torch.Tensor):
        return False
    if getattr(loss, _MARK, False):
        return True
    seen, todo = 0, [loss.grad_fn]
    while todo and seen < _SEARCH_NODES:
        node = todo.pop(0)
        if node is None:
            continue
        seen += 1
        if type(node).__name__ == "_ExactLossBackward":
            return True
        todo += [n for n, _ in node.next_functions]
    return False


def _refuse_exact(loss: torch.Tensor, what: str) -> None:
    if is_exact_loss(loss):
        raise ValueError(
            f"tiledmlp: {what} got a loss that is already exact over the sequence-parallel "
            "group (the model's own loss under sequence parallelism is, since patch_model / "
            "install set it up); reducing it again would scale its gradient by the group size. "
            "Use out.loss as it is; the helper is for losses computed from the logits, e.g. "
            "sequence_parallel_loss(F.cross_entropy(..., reduction='sum'), count, groups)"
        )


def sequence_parallel_loss(
    local_sum: torch.Tensor,
    local_count: torch.Tensor | int,
    groups: SequenceParallelGroups,
    denominator: torch.Tensor | float | None = None,
) -> torch.Tensor:
    """The exact mean loss over the SP group's tokens, with the gradient contract above.

    One all-reduce of two numbers over the SP group (run it on every rank of the group, also
    under torch.no_grad).

    Args:
        local_sum: 0-dim, the sum of this rank's per-token losses (differentiable).
        local_count: this rank's number of counted tokens (0 is allowed).
        groups: from make_groups.
        denominator: divide the group's sum by this instead of its counted tokens (the same on
            every rank: e.g. num_items_in_batch, the counted tokens of the whole sequences of
            all micro-batches of an accumulated step).

    Returns:
        0-dim, sum of the sums / sum of the counts (or / denominator) over the SP group: the
        same value on every rank of the group; its gradient on rank r is P * d(local_sum) / N.
        0 with zero gradients when nothing in the group counts (or the denominator is 0).

    Raises:
        ValueError: local_sum is not 0-dim, or is already an exact loss (reducing it twice
            would scale its gradient by P).
    """
    if local_sum.dim() != 0:
        raise ValueError(
            f"tiledmlp: local_sum must be a 0-dim tensor (a sum of per-token losses), got shape "
            f"{tuple(local_sum.shape)}; sum it first, e.g. F.cross_entropy(..., reduction='sum')"
        )
    _refuse_exact(local_sum, "sequence_parallel_loss")
    device = local_sum.device
    count = torch.as_tensor(local_count, device=device).to(torch.float64)
    stats = torch.stack([local_sum.detach().to(torch.float64), count])
    if groups.sp_size > 1:
        with guarded("the sequence-parallel loss's all-reduce", groups.sp_group):
            dist.all_reduce(stats, group=groups.sp_group)
    # exact: counts are integers far below 2**53; a given denominator is the same on every rank
    n = float(stats[1].item()) if denominator is None else float(denominator)
    if n == 0:
        # Nothing counts in the whole group: no signal, the same zero step on every rank (an
        # error here would leave the other replicas waiting in the gradient all-reduce).
        value, scale = torch.zeros((), dtype=local_sum.dtype, device=device), 0.0
    else:
        # Value: total / N, bitwise the same on every rank; gradient: P / N * d(local_sum).
        value, scale = (stats[0] / n).to(local_sum.dtype), groups.sp_size / n
    if torch.is_grad_enabled() and local_sum.requires_grad:
        out = _ExactLoss.apply(local_sum, value, scale)
    else:
        out = value
    setattr(out, _MARK, True)
    return out  # type: ignore[no-any-return]


def sequence_parallel_loss_from_mean(
    local_mean: torch.Tensor, local_count: torch.Tensor | int, groups: SequenceParallelGroups
) -> torch.Tensor:
    """sequence_parallel_loss from a local mean over the local counted tokens, e.g. a custom
    loss reduced by "mean" over this rank's shift_labels. (The model's own loss under sequence
    parallelism is already exact: passing it here raises.)

    A rank whose tokens are all ignored has a NaN mean (0 / 0): it contributes 0 to the sum and
    no gradient.

    Args:
        local_mean: 0-dim, this rank's mean loss over its counted tokens.
        local_count: that count (count_tokens(shard["shift_labels"])).
        groups: from make_groups.

    Returns:
        As sequence_parallel_loss.

    Raises:
        ValueError: local_mean is already an exact loss.
    """
    _refuse_exact(local_mean, "sequence_parallel_loss_from_mean")
    count = torch.as_tensor(local_count, device=local_mean.device)
    local_sum = torch.where(count > 0, local_mean * count, torch.zeros_like(local_mean))
    return sequence_parallel_loss(local_sum, count, groups)
