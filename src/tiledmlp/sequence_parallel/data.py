"""Splitting a batch's sequences over the ranks of a sequence-parallel group.

Every rank of an SP group of size P holds the same full batch; shard_batch returns this rank's
contiguous slice of S/P tokens of every sequence, with the position ids the model needs and the
labels already shifted.

Invariant: labels are shifted over the whole sequence before it is cut, so the target of a
rank's last token (the next rank's first token) is kept, and no token is scored twice or lost:
the ranks' shift_labels together are exactly the shifted labels of the unsplit batch. A target
that crosses into the next packed document (where that document starts) is ignored, by the same
document rule the attention uses.
"""

from __future__ import annotations

from typing import Any

import torch

from tiledmlp.sequence_parallel.groups import SequenceParallelGroups
from tiledmlp.sequence_parallel.sizes import check_sequence_divisible

__all__ = ["shard_batch", "shift_labels"]


def shift_labels(
    labels: torch.Tensor, position_ids: torch.Tensor, ignore_index: int = -100
) -> torch.Tensor:
    """Next-token targets of unshifted labels, ignoring targets across document boundaries.

    Args:
        labels: (batch, seq) token ids as Hugging Face takes them (not shifted), ignore_index
            where no loss is wanted.
        position_ids: (batch or 1, seq); a document starts where a position is not the previous
            one plus 1.

    Returns:
        (batch, seq): out[:, i] = labels[:, i + 1], except ignore_index at the last column and
        at columns whose next token starts a new document.
    """
    out = torch.full_like(labels, ignore_index)
    out[:, :-1] = labels[:, 1:]
    positions = position_ids.expand_as(labels)
    starts = positions[:, 1:] != positions[:, :-1] + 1  # column i+1 starts a document
    out[:, :-1] = out[:, :-1].masked_fill(starts, ignore_index)
    return out


def shard_batch(
    batch: dict[str, torch.Tensor],
    groups: SequenceParallelGroups | Any,
    *,
    ignore_index: int = -100,
) -> dict[str, torch.Tensor]:
    """This rank's shard of a full batch, ready for model(**shard).

    Contract: every rank of the SP group passes the same full batch. Output tensors hold columns
    [r * S/P, (r + 1) * S/P) of the full batch, r = the rank in the SP group:
        input_ids: (B, S/P) the rank's tokens.
        position_ids: (B, S/P) the given position ids' columns, or those of 0..S-1 when the
            batch has none (one document per row). Packed documents: restart at 0 for each
            document (any break in +1 steps starts one).
        shift_labels: (B, S/P), only with labels: the columns of shift_labels(labels, positions),
            i.e. the next token's label, ignore_index at the end of each row and of each
            document. No further shifting must happen: Hugging Face's ForCausalLMLoss (and
            tiledmlp's tiled loss) use shift_labels as is when given.
        labels: the same tensor as shift_labels (Hugging Face computes a loss only when labels
            is not None; with shift_labels given, labels is not read).
    Other keys are refused: attention_mask (pack instead of padding) and anything else whose
    splitting is not known.

    Args:
        batch: input_ids (B, S); optional labels (B, S) unshifted, optional position_ids
            (B, S) or (1, S).
        groups: SequenceParallelGroups, or a process group (its size and this rank's index in it
            are used).
        ignore_index: the label of positions without a loss.

    Returns:
        The shard described above.

    Raises:
        ValueError: S not divisible by P, shapes that disagree, no input_ids, or keys it cannot
            split.
    """
    size, rank = _size_and_rank(groups)
    _check_keys(batch)
    ids = batch["input_ids"]
    if ids.dim() != 2:
        raise ValueError(
            f"tiledmlp: shard_batch expects input_ids of shape (batch, seq), got {tuple(ids.shape)}"
        )
    s = ids.shape[1]
    check_sequence_divisible(s, size)
    positions = _positions(batch.get("position_ids"), ids)
    cols = slice(rank * (s // size), (rank + 1) * (s // size))
    out = {
        "input_ids": ids[:, cols].contiguous(),
        "position_ids": positions[:, cols].contiguous(),
    }
    labels = batch.get("labels")
    if labels is not None:
        if labels.shape != ids.shape:
            raise ValueError(
                f"tiledmlp: labels of shape {tuple(labels.shape)} do not match input_ids "
                f"{tuple(ids.shape)}"
            )
        shifted = shift_labels(labels, positions, ignore_index)[:, cols].contiguous()
        out["shift_labels"] = shifted
        out["labels"] = shifted
    return out


_KNOWN = ("input_ids", "labels", "position_ids")


def _check_keys(batch: dict[str, torch.Tensor]) -> None:
    """Refuses a batch without input_ids, or with keys shard_batch cannot split."""
    if "input_ids" not in batch:
        raise ValueError(
            f"tiledmlp: shard_batch needs input_ids (batch, seq), got keys {sorted(batch)}"
        )
    unknown = sorted(set(batch) - set(_KNOWN))
    if unknown:
        fix = (
            "attention_mask: padding cannot be split across ranks; pack the sequences (no "
            "attention_mask, position_ids restarting at 0 per document)"
            if "attention_mask" in unknown
            else "shard them yourself or drop them"
        )
        raise ValueError(
            f"tiledmlp: shard_batch splits {sorted(_KNOWN)} only, got also {unknown}; {fix}"
        )


def _positions(positions: torch.Tensor | None, ids: torch.Tensor) -> torch.Tensor:
    """The full batch's (B, S) position ids: the given ones (B or 1 rows), or 0..S-1."""
    b, s = ids.shape
    if positions is None:
        return torch.arange(s, device=ids.device).expand(b, s)
    if positions.dim() != 2 or positions.shape[1] != s or positions.shape[0] not in (1, b):
        raise ValueError(
            f"tiledmlp: position_ids of shape {tuple(positions.shape)} do not match input_ids "
            f"{tuple(ids.shape)}; expected ({b}, {s}) or (1, {s})"
        )
    return positions.expand(b, s)


def _size_and_rank(groups: SequenceParallelGroups | Any) -> tuple[int, int]:
    if isinstance(groups, SequenceParallelGroups):
        return groups.sp_size, groups.sp_rank
    import torch.distributed as dist

    return dist.get_world_size(groups), dist.get_rank(groups)
