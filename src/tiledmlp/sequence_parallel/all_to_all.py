"""Differentiable all-to-all for Ulysses sequence parallelism.

Around attention, P ranks switch between "local tokens, all heads" (batch, heads, seq/P, d) and
"all tokens, heads/P" (batch, heads/P, seq, d): each rank cuts its tensor into P chunks along one
dimension (the scatter dimension), sends chunk j to rank j, and concatenates what it receives,
rank 0's chunk first, along another (the gather dimension).

Invariant: chunks are contiguous and in rank order on both sides, so rank r gets heads
[r*H/P, (r+1)*H/P) and the gathered sequence is the ranks' local sequences in rank order; the
backward is the same exchange with the two dimensions swapped (the exact transpose), so the
gradient of the output flows back to the rank and position its input came from.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from tiledmlp.sequence_parallel.collectives import guarded

__all__ = ["AllToAllFunction", "all_to_all", "heads_to_sequence", "sequence_to_heads"]


def _exchange(x: torch.Tensor, group: Any, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """The forward exchange (no autograd): see all_to_all."""
    p = dist.get_world_size(group)
    if p == 1:
        return x
    n = x.shape[scatter_dim]
    if n % p != 0:
        raise ValueError(
            f"tiledmlp: all-to-all over {p} ranks needs dimension {scatter_dim} divisible by {p}, "
            f"got shape {tuple(x.shape)}"
        )
    # (P, ..., n/P at scatter_dim, ...): chunk j is row j, as all_to_all_single sends it.
    send = x.unflatten(scatter_dim, (p, n // p)).movedim(scatter_dim, 0).contiguous()
    recv = torch.empty_like(send)
    with guarded("the sequence-parallel all-to-all", group):
        dist.all_to_all_single(recv, send, group=group)
    # recv[j] is rank j's chunk: put the rank index just before gather_dim and merge the two.
    return recv.movedim(0, gather_dim).flatten(gather_dim, gather_dim + 1)


class AllToAllFunction(torch.autograd.Function):
    """all_to_all as an autograd Function; the backward is the reverse all-to-all."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: torch.Tensor, group: Any, scatter_dim: int, gather_dim: int
    ) -> torch.Tensor:
        ctx.group = group
        ctx.dims = (scatter_dim, gather_dim)
        return _exchange(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:  # type: ignore[override]
        scatter_dim, gather_dim = ctx.dims
        return _exchange(grad, ctx.group, gather_dim, scatter_dim), None, None, None


def all_to_all(x: torch.Tensor, group: Any, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Differentiable all-to-all over `group` (P ranks).

    Args:
        x: any shape; x.shape[scatter_dim] divisible by P. Every rank passes the same shape.
        group: the process group (P ranks); with P = 1, x is returned as is.
        scatter_dim: the dimension cut into P contiguous chunks, chunk j going to rank j.
        gather_dim: the dimension along which the P received chunks are concatenated in rank
            order.

    Returns:
        x's shape with scatter_dim divided by P and gather_dim multiplied by P.

    Raises:
        ValueError: x.shape[scatter_dim] not divisible by P.
    """
    scatter_dim %= x.dim()
    gather_dim %= x.dim()
    return AllToAllFunction.apply(x, group, scatter_dim, gather_dim)


def sequence_to_heads(x: torch.Tensor, group: Any) -> torch.Tensor:
    """(batch, heads, seq/P, d) -> (batch, heads/P, seq, d): rank r keeps heads
    [r*heads/P, (r+1)*heads/P) of the whole sequence."""
    return all_to_all(x, group, scatter_dim=1, gather_dim=2)


def heads_to_sequence(x: torch.Tensor, group: Any) -> torch.Tensor:
    """(batch, seq, heads/P, d) -> (batch, seq/P, heads, d), the layout attention functions
    return: back to this rank's tokens, all heads (the inverse of sequence_to_heads)."""
    return all_to_all(x, group, scatter_dim=1, gather_dim=2)
