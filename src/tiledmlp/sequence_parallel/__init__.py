"""Ulysses sequence parallelism for Hugging Face decoder models.

Each rank of a sequence-parallel (SP) group of P ranks holds seq/P tokens of every sequence;
attention runs on whole sequences, heads/P per rank, between two all-to-alls; the rest of the
model (norms, MLPs, loss) stays local. Quick start, on every rank:

    groups = make_groups(sequence_parallel_size)
    install(model, groups)                      # before DDP / FSDP / DeepSpeed wrap it
    shard = shard_batch(batch, groups)          # the same full batch on every SP rank
    out = engine(**shard)                       # out.loss: exact over the whole sequences
    out.loss.backward()                         # the engine averages over all P * D ranks

A loss computed from the logits instead goes through sequence_parallel_loss (a local sum and
count); the model's own loss must not (it is exact already: passing it raises).

Invariant: with gradients averaged over the whole world, training matches a single process
on the unsplit batch (the mean of the D replicas' losses), step for step.
"""

from tiledmlp.sequence_parallel.all_to_all import (
    AllToAllFunction,
    all_to_all,
    heads_to_sequence,
    sequence_to_heads,
)
from tiledmlp.sequence_parallel.attention import SUPPORTED_ATTENTION, UlyssesAttention
from tiledmlp.sequence_parallel.collectives import CollectiveError
from tiledmlp.sequence_parallel.data import shard_batch, shift_labels
from tiledmlp.sequence_parallel.groups import SequenceParallelGroups, make_groups
from tiledmlp.sequence_parallel.install import UlyssesReport, install, installed_groups, remove
from tiledmlp.sequence_parallel.loss import (
    count_tokens,
    is_exact_loss,
    sequence_parallel_loss,
    sequence_parallel_loss_from_mean,
)

__all__ = [
    "SUPPORTED_ATTENTION",
    "AllToAllFunction",
    "CollectiveError",
    "SequenceParallelGroups",
    "UlyssesAttention",
    "UlyssesReport",
    "all_to_all",
    "count_tokens",
    "heads_to_sequence",
    "install",
    "installed_groups",
    "is_exact_loss",
    "make_groups",
    "remove",
    "sequence_parallel_loss",
    "sequence_parallel_loss_from_mean",
    "sequence_to_heads",
    "shard_batch",
    "shift_labels",
]
