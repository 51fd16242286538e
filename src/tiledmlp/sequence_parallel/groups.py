"""Process groups for Ulysses sequence parallelism (SP) combined with data parallelism (DP).

With a world of W ranks and SP size P, the ranks form D = W / P sequence-parallel groups of P
consecutive ranks ([0..P-1], [P..2P-1], ...); the ranks of one SP group hold the same batch, each
rank seq/P tokens of every sequence, and rank r is DP replica r // P.

Invariant: every check here runs before any collective, so a misconfigured run fails with the
same error on every rank instead of hanging; and every rank creates every SP group, in the same
order (torch.distributed.new_group is itself collective over the world).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from tiledmlp.ops.tiling.values import check_int
from tiledmlp.sequence_parallel.collectives import default_timeout
from tiledmlp.sequence_parallel.sizes import check_world_divisible

__all__ = ["SequenceParallelGroups", "make_groups"]


@dataclass(frozen=True, kw_only=True)
class SequenceParallelGroups:
    """This rank's place in the SP x DP layout.

    Attributes:
        sp_group: the process group of the P ranks sharing this rank's sequences.
        sp_size: P, the number of ranks a sequence is split over.
        sp_rank: this rank's index in its SP group; it holds tokens
            [sp_rank * seq / P, (sp_rank + 1) * seq / P) of every sequence.
        dp_size: D, the number of data-parallel replicas (world size / P).
        dp_rank: this rank's replica, the index of its SP group.
    """

    sp_group: Any
    sp_size: int
    sp_rank: int
    dp_size: int
    dp_rank: int

    def __post_init__(self) -> None:
        for size, rank, what in (
            (self.sp_size, self.sp_rank, "sp"),
            (self.dp_size, self.dp_rank, "dp"),
        ):
            if size < 1 or not 0 <= rank < size:
                raise ValueError(
                    f"tiledmlp: SequenceParallelGroups needs {what}_size >= 1 and "
                    f"0 <= {what}_rank < {what}_size, got {what}_size={size}, "
                    f"{what}_rank={rank}; build it with make_groups"
                )


def make_groups(sequence_parallel_size: int, group: Any = None) -> SequenceParallelGroups:
    """Creates (or adopts) this rank's sequence-parallel group.

    Must be called on every rank of the world, with the same arguments.

    Args:
        sequence_parallel_size: P, the number of ranks each sequence is split over.
        group: an existing process group to use as this rank's SP group; its size must be P and
            its ranks either consecutive ([k*P .. k*P+P-1]: replica k) or strided by D = world/P
            ([k, k+D, ..]: replica k). For another layout, build SequenceParallelGroups directly.
            None: consecutive ranks form the SP groups and every rank creates all of them.

    Returns:
        This rank's SequenceParallelGroups (with consecutive groups, dp_rank = rank // P).

    Raises:
        ValueError: P < 1, no default process group, world size not divisible by P, or a given
            group whose size is not P or whose layout is neither consecutive nor strided. Raised
            before any collective.
    """
    p = sequence_parallel_size
    check_int(
        "tiledmlp: sequence_parallel_size", p, hint="; use 1 to switch sequence parallelism off"
    )
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(
            "tiledmlp: sequence parallelism needs a default process group, and none is "
            "initialised; call torch.distributed.init_process_group first (or run under torchrun)"
        )
    world = dist.get_world_size()
    rank = dist.get_rank()
    check_world_divisible(world, p, size_name="sequence_parallel_size")
    if group is not None:
        size = dist.get_world_size(group)
        if size != p:
            raise ValueError(
                f"tiledmlp: the given sequence-parallel group has {size} ranks, expected "
                f"sequence_parallel_size = {p}; pass a group of {p} ranks or set "
                f"sequence_parallel_size={size}"
            )
        return SequenceParallelGroups(
            sp_group=group,
            sp_size=p,
            sp_rank=dist.get_rank(group),
            dp_size=world // p,
            dp_rank=_replica_of(sorted(dist.get_process_group_ranks(group)), world),
        )
    mine: Any = None
    # The default group's timeout bounds the SP collectives too (new_group's own default is 30
    # minutes, whatever init_process_group was given).
    timeout = default_timeout()
    # new_group is collective over the world: every rank creates every group, in this order.
    for start in range(0, world, p):
        created = dist.new_group(list(range(start, start + p)), timeout=timeout)
        if start <= rank < start + p:
            mine = created
    return SequenceParallelGroups(
        sp_group=mine, sp_size=p, sp_rank=rank % p, dp_size=world // p, dp_rank=rank // p
    )


def _replica_of(ranks: list[int], world: int) -> int:
    """The DP replica of a given SP group (its sorted global ranks): k for [k*P .. k*P+P-1]
    (consecutive) or for [k, k+D, ..] (strided by D = world / P)."""
    p = len(ranks)
    if ranks == list(range(ranks[0], ranks[0] + p)) and ranks[0] % p == 0:
        return ranks[0] // p
    stride = world // p
    if ranks == list(range(ranks[0], world, stride)):
        return ranks[0]
    raise ValueError(
        f"tiledmlp: the given sequence-parallel group holds ranks {ranks}, expected "
        f"{p} consecutive ranks starting at a multiple of {p}, or ranks strided by {stride}; "
        "for another layout construct SequenceParallelGroups(sp_group=..., sp_size=..., "
        "sp_rank=..., dp_size=..., dp_rank=...) directly"
    )
