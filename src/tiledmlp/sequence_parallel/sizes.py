"""The sizes Ulysses sequence parallelism needs, each rule checked by one function.

Over P ranks, each rank holds seq_len / P tokens of every sequence, and the world splits into
world / P data-parallel replicas of P ranks. The library, the planner and the CLI check these
rules through the functions here, naming the values as their callers know them (a keyword, a
flag), with one message per rule.

Invariant: each check raises ValueError (what was expected, what was got, how to fix it) before
any collective, and returns nothing when the rule holds.
"""

from __future__ import annotations

__all__ = ["check_sequence_divisible", "check_world_divisible"]


def check_sequence_divisible(
    seq_len: int,
    p: int,
    *,
    seq_name: str = "the sequence length",
    size_name: str = "the sequence-parallel size",
) -> None:
    """Raises unless `seq_len` is divisible by the sequence-parallel size `p`.

    Args:
        seq_len: tokens per sequence.
        p: the sequence-parallel size, >= 1.
        seq_name: what the caller calls seq_len (e.g. "--seq-len").
        size_name: what the caller calls p (e.g. "--sequence-parallel-size").

    Raises:
        ValueError: seq_len % p != 0.
    """
    if seq_len % p:
        lower, upper = max(p, seq_len // p * p), -(-seq_len // p) * p
        raise ValueError(
            f"{seq_name} {seq_len} must be divisible by {size_name} {p} (each rank holds "
            f"{seq_len} / {p} tokens); pad or pack the sequences to a multiple of {p} (e.g. "
            f"{lower} or {upper}), or choose a sequence-parallel size that divides {seq_len}"
        )


def check_world_divisible(
    world: int, p: int, *, size_name: str = "the sequence-parallel size"
) -> None:
    """Raises unless the world size is divisible by the sequence-parallel size `p`.

    Args:
        world: the number of processes.
        p: the sequence-parallel size, >= 1.
        size_name: what the caller calls p (e.g. "--sequence-parallel-size").

    Raises:
        ValueError: world % p != 0.
    """
    if world % p:
        raise ValueError(
            f"the world size ({world}) must be divisible by {size_name} ({p}); launch a "
            f"multiple of {p} processes (e.g. torchrun --nproc_per_node {p}), or choose a "
            f"sequence-parallel size that divides {world}"
        )
