"""The exact token-weighted loss over sequences split across a sequence-parallel group.

Each rank of an SP group scores its own tokens: a local sum s_r of per-token losses over n_r
counted (not ignored) tokens. The loss of the group's batch is L = sum_r s_r / sum_r n_r, the
same on every rank of the group.

Invariant (the gradient contract): the returned loss has the value L on every rank and the
gradient P * ds_r / N on rank r (N = sum_r n_r). Gradients summed over the SP group give
P * dL, so an engine that averages gradients over the whole world of W = P * D ranks (DDP,
FSDP/FSDP2, DeepSpeed ZeRO over the default group, as they do) ends with
(1 / W) * sum_d P * dL_d = mean_d dL_d: the single-process gradient of the mean of the D
replicas' losses.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tiledmlp.sequence_parallel.groups import SequenceParallelGroups

__all__ = ["count_tokens", "sequence_parallel_loss", "sequence_parallel_loss_from_mean"]


def count_tokens(shift_labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """The number of counted targets in (batch, seq/P) shift_labels, a 0-dim int64 tensor."""
    return (shift_labels != ignore_index).sum()


def sequence_parallel_loss(
    local_sum: torch.Tensor, local_count: torch.Tensor | int, groups: SequenceParallelGroups
) -> torch.Tensor:
    """The exact mean loss over the SP group's tokens, with the gradient contract above.

    One all-reduce of two numbers over the SP group (run it on every rank of the group, also
    under torch.no_grad).

    Args:
        local_sum: 0-dim, the sum of this rank's per-token losses (differentiable).
        local_count: this rank's number of counted tokens (0 is allowed).
        groups: from make_groups.

    Returns:
        0-dim, sum of the sums / sum of the counts over the SP group: the same value on every
        rank of the group; its gradient on rank r is P * d(local_sum) / N.

    Raises:
        ValueError: no counted token in the whole group (the mean is undefined).
    """
    if local_sum.dim() != 0:
        raise ValueError(
            f"tiledmlp: local_sum must be a 0-dim tensor (a sum of per-token losses), got shape "
            f"{tuple(local_sum.shape)}; sum it first, e.g. F.cross_entropy(..., reduction='sum')"
        )
    device = local_sum.device
    count = torch.as_tensor(local_count, device=device).to(torch.float64)
    stats = torch.stack([local_sum.detach().to(torch.float64), count])
    if groups.sp_size > 1:
        dist.all_reduce(stats, group=groups.sp_group)
    n = float(stats[1].item())  # exact: counts are integers far below 2**53
    if n == 0:
        raise ValueError(
            "tiledmlp: no counted token in the sequence-parallel group's batch (every label is "
            "ignore_index); the mean loss is undefined: skip this batch or check the labels"
        )
    # Value: total / N, bitwise the same on every rank; gradient: P / N * d(local_sum)
    # (x - x.detach() is exactly 0 in value).
    value = (stats[0] / n).to(local_sum.dtype)
    return value + (local_sum - local_sum.detach()) * (groups.sp_size / n)


def sequence_parallel_loss_from_mean(
    local_mean: torch.Tensor, local_count: torch.Tensor | int, groups: SequenceParallelGroups
) -> torch.Tensor:
    """sequence_parallel_loss from a local mean over the local counted tokens, e.g. a Hugging
    Face causal LM's outputs.loss given shift_labels (and no num_items_in_batch) or tiledmlp's
    tiled loss, which both divide the local sum by the local count.

    A rank whose tokens are all ignored has a NaN mean (0 / 0): it contributes 0 to the sum and
    no gradient.

    Args:
        local_mean: 0-dim, this rank's mean loss over its counted tokens.
        local_count: that count (count_tokens(shard["shift_labels"])).
        groups: from make_groups.

    Returns:
        As sequence_parallel_loss.
    """
    count = torch.as_tensor(local_count, device=local_mean.device)
    local_sum = torch.where(count > 0, local_mean * count, torch.zeros_like(local_mean))
    return sequence_parallel_loss(local_sum, count, groups)
