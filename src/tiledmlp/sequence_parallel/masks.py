"""Masks of Ulysses attention, from the whole sequences' position ids.

Causal masking comes from the position ids gathered over the sequence-parallel group: a
document starts at column 0 and wherever a position is not the previous one plus 1 (Hugging
Face's own rule for packed sequences on sdpa), so packed documents never attend to each other.
The model itself builds no mask (`no_mask`), and a padding mask, which covers local tokens only,
is refused (`refuse_padding`).

Invariant: query i may attend to key j exactly when both are in the same document, j <= i, and
i - j is below the sliding window when one is set; with one document per row and no effective
window no mask is built (sdpa's own causal path).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["FullPositions", "no_mask", "refuse_padding", "ulysses_error"]


def ulysses_error(what: str) -> ValueError:
    """The ValueError sequence parallelism raises, naming itself."""
    return ValueError(f"tiledmlp: sequence parallelism (Ulysses): {what}")


class FullPositions:
    """Whole-sequence position ids (batch, seq) and what the masks need from them."""

    def __init__(self, given: torch.Tensor, version: int, positions: torch.Tensor) -> None:
        self.given = given
        self.version = version
        self.positions = positions
        self.starts = _document_starts(positions)
        self.packed = bool(self.starts.any())  # one host sync per forward
        self._masks: dict[int | None, torch.Tensor | None] = {}

    def sdpa_mask(self, window: Any) -> torch.Tensor | None:
        """None (plain causal: sdpa's is_causal) for one document per row and no effective
        sliding window, else the boolean (batch, 1, seq, seq) mask; one per window size."""
        seq = self.positions.shape[1]
        key = window if isinstance(window, int) and 0 < window < seq else None
        if key not in self._masks:
            needed = self.packed or key is not None
            self._masks[key] = _causal_documents_mask(self.starts, key) if needed else None
        return self._masks[key]


def _document_starts(positions: torch.Tensor) -> torch.Tensor:
    """(batch, seq) int -> (batch, seq) bool: True where a new document starts after column 0
    (a position that is not the previous one plus 1); all False for one document per row."""
    starts = torch.zeros_like(positions, dtype=torch.bool)
    starts[:, 1:] = positions[:, 1:] != positions[:, :-1] + 1
    return starts


def _causal_documents_mask(starts: torch.Tensor, window: Any) -> torch.Tensor:
    """(batch, seq) bool document starts -> (batch, 1, seq, seq) bool, True where query i may
    attend to key j: same document, j <= i, and i - j < window when a sliding window is set."""
    doc = starts.cumsum(-1)
    seq = starts.shape[1]
    idx = torch.arange(seq, device=starts.device)
    allowed = idx[None, :] <= idx[:, None]
    if isinstance(window, int) and window > 0:
        allowed = allowed & (idx[:, None] - idx[None, :] < window)
    return ((doc[:, :, None] == doc[:, None, :]) & allowed)[:, None]


def no_mask(*args: Any, attention_mask: Any = None, **kwargs: Any) -> None:
    """The mask function for the registered name: the wrapper masks from the position ids, so
    the model builds none. A 2-D padding mask with zeros is refused (before any collective)."""
    refuse_padding(attention_mask)
    return None


def refuse_padding(attention_mask: Any) -> None:
    """Raises unless `attention_mask` is None or a 2-D mask of ones (no padding).

    Raises:
        ValueError: a 2-D mask with zeros, or a prepared (not 2-D) mask.
    """
    if attention_mask is None:
        return
    if attention_mask.dim() == 2 and bool(attention_mask.all()):
        return
    what = "with padding (zeros)" if attention_mask.dim() == 2 else "prepared (not 2-D)"
    raise ulysses_error(
        f"got an attention mask {what} of shape {tuple(attention_mask.shape)}; padding cannot "
        "be split across ranks: pack the sequences instead (documents back to back, "
        "position_ids restarting at 0 for each, no attention_mask) and ignore the filler "
        "tokens' labels"
    )
