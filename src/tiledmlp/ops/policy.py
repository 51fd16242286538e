"""Tile policies: from the user's choice to an explicit tile plan.

Forms: a positive int (number of tiles), "arctic" (ceil(tokens / hidden), the paper's rule),
"auto" (a memory-budget rule, below), "target:<GB>" (a memory target, below), or a
tokens-per-tile count.

"target:<GB>" (the seeds' memory-target mode): the fewest tiles whose working memory (the tile's
intermediates plus the float32 gradient accumulators, by the memory model) fits <GB> GiB;
untiled when the untiled module's intermediates fit. Tiles are never smaller than one token.
Modules without a fast path have no memory model: their intermediates are taken as those of a
gated MLP with intermediate size 4 x hidden (GENERIC_WIDTH), in the input's dtype.

"auto" for a recognised MLP: tiles of about `weight_bytes / (c_t * m * e)` tokens, i.e. a tile's
transient intermediates are about the size of the MLP's weights (c_t (n, m) tensors of e bytes per
token row, see fast.py). It runs untiled unless its memory model predicts that tiling needs at
most half the untiled module's intermediates (short sequences run untiled), so "auto" never
costs memory and costs no recompute where it saves little (tests/test_policy.py measures this). For modules without a fast path it uses the paper's rule
beyond two tiles' worth of tokens and runs untiled below.

Invariant: the resolution depends only on the token count, the module's shapes and dtypes, and
the policy; never on free memory, so every rank with the same inputs gets the same plan.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tiledmlp.ops.structure import MLPKind, MLPStructure
from tiledmlp.ops.tiles import TilePlan, arctic_num_tiles, split_by_tile_tokens, split_even

__all__ = ["MemoryModel", "resolve_plan", "validate_policy"]

_NAMED = ("auto", "arctic")
_TARGET = "target:"
GENERIC_WIDTH = 4  # intermediate / hidden assumed for "target:<GB>" without a memory model


def target_bytes(num_tiles: object) -> float | None:
    """The byte budget of a "target:<GB>" policy, or None for any other policy.

    Raises:
        ValueError: a "target:" string whose GB is not a positive number.
    """
    if not isinstance(num_tiles, str) or not num_tiles.startswith(_TARGET):
        return None
    text = num_tiles[len(_TARGET) :]
    try:
        gb = float(text)
    except ValueError:
        gb = -1.0
    if not math.isfinite(gb) or gb <= 0:
        raise ValueError(
            f"num_tiles {num_tiles!r}: expected 'target:<GB>' with a positive number of GiB, "
            "e.g. 'target:2' or 'target:0.5'"
        )
    return gb * 2**30


def validate_policy(num_tiles: object, tile_tokens: object) -> None:
    """Raises ValueError unless (num_tiles, tile_tokens) is an allowed combination."""
    if tile_tokens is not None:
        if isinstance(tile_tokens, bool) or not isinstance(tile_tokens, int) or tile_tokens < 1:
            raise ValueError(f"tile_tokens must be a positive int or None, got {tile_tokens!r}")
        if num_tiles != "auto":
            raise ValueError(
                f"give either num_tiles or tile_tokens, not both (got num_tiles={num_tiles!r}, "
                f"tile_tokens={tile_tokens!r}); leave num_tiles at its default 'auto'."
            )
        return
    if isinstance(num_tiles, str) and (num_tiles in _NAMED or target_bytes(num_tiles)):
        return
    if isinstance(num_tiles, bool) or not isinstance(num_tiles, int) or num_tiles < 1:
        raise ValueError(
            "num_tiles must be a positive int, 'auto', 'arctic' or 'target:<GB>', got "
            f"{num_tiles!r}"
        )


@dataclass(frozen=True)
class MemoryModel:
    """Bytes a recognised MLP needs beyond weights, grads, input, output and their gradients.

    Coefficients count (tokens, intermediate) tensors alive at the peak; measured with the
    torch.profiler memory timeline (tests/test_memory.py holds them to it).
    """

    structure: MLPStructure
    compute_dtype: torch.dtype
    # The structure's parameters as the op uses them (weight, bias per linear, None where no
    # bias); default: read from the structure. The op passes the tensors it already holds, so a
    # parametrized weight (spectral_norm) is evaluated once per call, as in the untiled module.
    params: tuple[torch.Tensor | None, ...] | None = None

    def _params(self) -> list[torch.Tensor]:
        params = self.params if self.params is not None else self.structure.params()
        return [p for p in params if p is not None]

    # (tokens, intermediate) tensors above weights/grads/x/y/dy/dx at the peak of a step,
    # measured at long sequences (fp32, h256/m768): untiled SwiGLU 5.5, untiled plain 2.6;
    # tiled per tile 5 (gated) and 4 (plain), see fast.py.
    UNTILED_GATED = 5.5
    UNTILED_PLAIN = 2.5
    TILED_GATED = 5.0
    TILED_PLAIN = 4.0
    # Tile only where the model predicts at most half the untiled intermediates: at short
    # sequences the untiled peak overlaps less with the gradients and sits below the model.
    MARGIN = 0.5

    @property
    def _elem(self) -> int:
        return torch.empty((), dtype=self.compute_dtype).element_size()

    def untiled_bytes(self, tokens: int) -> float:
        c = self.UNTILED_PLAIN if self.structure.kind is MLPKind.PLAIN else self.UNTILED_GATED
        return c * tokens * self.structure.intermediate_size * self._elem

    def tiled_bytes(self, tile_tokens: int) -> float:
        c = self.TILED_PLAIN if self.structure.kind is MLPKind.PLAIN else self.TILED_GATED
        return c * tile_tokens * self.structure.intermediate_size * self._elem + self._acc_bytes()

    def _acc_bytes(self) -> float:
        """Extra bytes of grads.GradSlot: a float32 accumulator beside the final low-precision
        gradient, and one shared scratch in the compute dtype, for every parameter whose
        gradient is not summed in place (see grads.py)."""
        wide = (torch.float32, torch.float64)
        params = self._params()
        indirect = [p for p in params if not (p.dtype == self.compute_dtype and p.dtype in wide)]
        if not indirect:
            return 0.0
        acc = sum(4 * p.numel() for p in indirect if p.dtype not in wide)
        return acc + max(p.numel() for p in indirect) * self._elem

    def weight_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self._params())

    def auto_tile_tokens(self) -> int:
        c = self.TILED_PLAIN if self.structure.kind is MLPKind.PLAIN else self.TILED_GATED
        per_token = c * self.structure.intermediate_size * self._elem
        return max(1, int(self.weight_bytes() // per_token))


def resolve_plan(
    num_tiles: int | str,
    tile_tokens: int | None,
    num_tokens: int,
    hidden_size: int,
    model: MemoryModel | None,
    element_size: int = 4,
) -> TilePlan | None:
    """The tile plan for a call, or None to run the module untiled ("auto" and "target:<GB>").

    Args:
        num_tiles: int, "auto", "arctic" or "target:<GB>" (validated by validate_policy).
        tile_tokens: tokens per tile, or None.
        num_tokens: flattened tokens of the input.
        hidden_size: last dim of the input.
        model: memory model of a recognised MLP, or None for the generic path.
        element_size: bytes per element of the input (the generic path's "target:<GB>").
    """
    budget = target_bytes(num_tiles)
    if budget is not None:
        return _target_plan(budget, num_tokens, hidden_size, model, element_size)
    if tile_tokens is not None:
        return split_by_tile_tokens(num_tokens, tile_tokens)
    if isinstance(num_tiles, int):
        return split_even(num_tokens, num_tiles)
    if num_tiles == "arctic":
        return split_even(num_tokens, arctic_num_tiles(num_tokens, hidden_size))
    if model is None:
        if num_tokens < 2 * hidden_size:
            return None
        return split_even(num_tokens, arctic_num_tiles(num_tokens, hidden_size))
    target = model.auto_tile_tokens()
    tiles = math.ceil(num_tokens / target)
    tiled = model.tiled_bytes(math.ceil(num_tokens / tiles))
    if tiles < 2 or tiled > model.MARGIN * model.untiled_bytes(num_tokens):
        return None
    return split_even(num_tokens, tiles)


def _target_plan(
    budget: float, num_tokens: int, hidden: int, model: MemoryModel | None, elem: int
) -> TilePlan | None:
    if model is not None:
        untiled = model.untiled_bytes(num_tokens)
        fixed = model.tiled_bytes(0)
        per_token = model.tiled_bytes(1) - fixed
    else:
        per_token = MemoryModel.TILED_GATED * GENERIC_WIDTH * hidden * elem
        untiled = MemoryModel.UNTILED_GATED * GENERIC_WIDTH * hidden * elem * num_tokens
        fixed = 0.0
    if untiled <= budget or num_tokens < 2:
        return None
    tile = max(1, int((budget - fixed) // per_token)) if budget > fixed else 1
    tiles = min(num_tokens, math.ceil(num_tokens / tile))
    return None if tiles < 2 else split_even(num_tokens, tiles)
