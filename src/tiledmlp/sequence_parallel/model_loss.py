"""The model's own loss under sequence parallelism: exact over the whole sequences.

A Hugging Face causal LM given this rank's shard computes a local loss: the mean over the rank's
counted targets (or their sum over num_items_in_batch). Used as it is (`out.loss.backward()`, as
every training loop does) it would train on a wrongly weighted, wrongly scaled loss without a
warning. `install` registers `exact_output` (through a forward hook on the model the user calls)
so that `out.loss` is instead the token-weighted loss of the SP group's whole sequences, with
sequence_parallel_loss's gradient contract (right under DDP, FSDP2 and ZeRO, which average over
the world; with gradient accumulation, each micro-batch's loss is its own exact mean, or the
exact sum over num_items_in_batch when that is given).

Invariant: whenever the forward computes a loss, every rank of the SP group runs the same one
all-reduce of two numbers (every rank holds the same batch, so all compute a loss or none);
labels that would be shifted per rank (losing the target at every shard boundary) are refused
before any collective.
"""

from __future__ import annotations

from typing import Any

import torch

from tiledmlp.sequence_parallel.groups import SequenceParallelGroups
from tiledmlp.sequence_parallel.loss import (
    count_tokens,
    sequence_parallel_loss,
    sequence_parallel_loss_from_mean,
)

__all__ = ["exact_output", "refuse_unshifted_labels"]


def refuse_unshifted_labels(given: dict[str, Any], error: type[Exception] = ValueError) -> None:
    """Raises when labels come without shift_labels: each rank would shift its own slice and
    lose the target of its last token (the next rank's first)."""
    if given.get("labels") is not None and given.get("shift_labels") is None:
        raise error(
            "tiledmlp: sequence parallelism (Ulysses): got labels without shift_labels; each "
            "rank would shift its own slice of the sequence and lose the target at every shard "
            "boundary. Pass this rank's shard from tiledmlp.sequence_parallel.shard_batch "
            "(it holds shift_labels, shifted over the whole sequence)"
        )


def _loss_of(output: Any) -> torch.Tensor | None:
    if isinstance(output, dict):  # ModelOutput is an OrderedDict
        loss = output.get("loss")
    elif isinstance(output, tuple) and output:
        loss = output[0]
    else:
        return None
    return loss if isinstance(loss, torch.Tensor) and loss.dim() == 0 else None


def exact_output(output: Any, given: dict[str, Any], groups: SequenceParallelGroups) -> Any:
    """`output` with its loss replaced by the exact loss over the SP group's sequences, or None
    (no change) when the forward computed no loss from shift_labels.

    Args:
        output: the model's output (a ModelOutput, or the tuple of return_dict=False).
        given: the forward's arguments by name (shift_labels, num_items_in_batch).
        groups: the SP layout.
    """
    shifted = given.get("shift_labels")
    loss = _loss_of(output)
    if loss is None or shifted is None:
        return None
    count = count_tokens(shifted)
    num_items = given.get("num_items_in_batch")
    if num_items is None:
        exact = sequence_parallel_loss_from_mean(loss, count, groups)
    else:
        # The model divided its local sum by num_items_in_batch: the whole sequences' count.
        exact = sequence_parallel_loss(loss * num_items, count, groups, denominator=num_items)
    if isinstance(output, dict):
        output["loss"] = exact
        return output
    return (exact, *output[1:])
