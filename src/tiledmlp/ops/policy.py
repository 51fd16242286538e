"""Tile policies: from the user's choice to an explicit tile plan.

Forms: a positive int (number of tiles), "arctic" (ceil(tokens / hidden), the paper's rule),
"auto" (a memory-budget rule, below), "target:<GB>" (a memory target, below), or a
tokens-per-tile count.

"target:<GB>" (unsloth's memory-target mode): the fewest tiles whose working memory (the tile's
intermediates plus the float32 gradient accumulators, by the memory model) fits <GB> GiB;
untiled when the untiled module's intermediates fit. Tiles are never smaller than one token.
Modules without a fast path have no memory model: their intermediates are taken as those of a
gated MLP with intermediate size 4 x hidden (GENERIC_WIDTH), in the input's dtype.

"auto" for a recognised MLP on the CPU: tiles of about `weight_bytes / (c_t * m * e)` tokens,
i.e. a tile's transient intermediates are about the size of the MLP's weights (c_t (n, m) tensors
of e bytes per token row, see fast.py). It runs untiled unless its memory model predicts that
tiling needs at most half the untiled module's intermediates (short sequences run untiled), so
"auto" never costs memory and costs no recompute where it saves little (tests/test_policy.py
measures this).

"auto" for a recognised MLP on an accelerator (any device but the CPU) is time-aware: small tiles
lose GEMM efficiency and add a pass over every weight-sized accumulator per tile, while the
memory saving is nearly all captured by a few large tiles. It takes the largest tiles that keep
ACCELERATOR_SAVING (90%) of the saving the memory model says tiling can reach (untiled
intermediates minus the accumulators), but never tiles whose working memory exceeds
ACCELERATOR_MAX_TILE_BYTES (2 GiB: at very long sequences the last 10% would be many GiB) and
never fewer than ACCELERATOR_MIN_TILE_TOKENS (8K) tokens per tile; untiled when that leaves
fewer than two tiles or saves nothing. (Hidden 4096 / intermediate 12288 in bf16: untiled at 8K
tokens, 2 tiles at 16K, 4 at 32K, 10 at 128K (13K-token tiles), 31 at 512K (2 GiB tiles).)

For modules without a fast path "auto" uses the paper's rule beyond two tiles' worth of tokens
and runs untiled below.

Invariant: the resolution depends only on the token count, the module's shapes, dtypes and device
type, and the policy; never on free memory, so every rank with the same inputs gets the same
plan. The planner resolves for an accelerator on fake CPU tensors with `assume_device`.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from tiledmlp.ops.grads import fp32_epilogue
from tiledmlp.ops.structure import MLPKind, MLPStructure
from tiledmlp.ops.tiles import TilePlan, arctic_num_tiles, split_by_tile_tokens, split_even

__all__ = ["MemoryModel", "assume_device", "resolve_plan", "validate_policy"]

_NAMED = ("auto", "arctic")
_TARGET = "target:"
GENERIC_WIDTH = 4  # intermediate / hidden assumed for "target:<GB>" without a memory model
ACCELERATOR_MIN_TILE_TOKENS = 8192
ACCELERATOR_MAX_TILE_BYTES = 2 * 2**30
ACCELERATOR_SAVING = 0.9
_ASSUMED: list[str] = []  # device types set by assume_device, innermost last


@contextlib.contextmanager
def assume_device(device_type: str) -> Iterator[None]:
    """Within the block, "auto" resolves as on `device_type` whatever device the tensors are on
    (the planner estimates a GPU's step on fake CPU tensors)."""
    _ASSUMED.append(device_type)
    try:
        yield
    finally:
        _ASSUMED.pop()


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
        gradient for every parameter whose gradient is not summed in place, and one shared
        scratch in the compute dtype where the GEMM cannot accumulate in float32 (see
        grads.py)."""
        wide = (torch.float32, torch.float64)
        params = self._params()
        indirect = [p for p in params if not (p.dtype == self.compute_dtype and p.dtype in wide)]
        if not indirect:
            return 0.0
        acc = sum(4 * p.numel() for p in indirect if p.dtype not in wide)
        if fp32_epilogue(indirect[0].device, self.compute_dtype):
            return acc  # tile products accumulate in the GEMM: no scratch
        return acc + max(p.numel() for p in indirect) * self._elem

    def weight_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self._params())

    @property
    def on_accelerator(self) -> bool:
        """Whether the "auto" rule is the accelerator's (module docstring)."""
        if _ASSUMED:
            return _ASSUMED[-1] != "cpu"
        params = self._params()
        return bool(params) and params[0].device.type not in ("cpu", "meta")

    def accelerator_tile_tokens(self, num_tokens: int) -> int:
        """The accelerator's "auto" tile size for `num_tokens` tokens (module docstring)."""
        fixed = self.tiled_bytes(0)
        per_token = self.tiled_bytes(1) - fixed
        reachable = self.untiled_bytes(num_tokens) - fixed
        keep = int((1 - ACCELERATOR_SAVING) * reachable // per_token) if per_token > 0 else 0
        cap = int(ACCELERATOR_MAX_TILE_BYTES // per_token) if per_token > 0 else keep
        return max(ACCELERATOR_MIN_TILE_TOKENS, min(keep, cap))

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
    if model.on_accelerator:
        tiles = math.ceil(num_tokens / model.accelerator_tile_tokens(num_tokens))
        tiled = model.tiled_bytes(math.ceil(num_tokens / max(tiles, 1)))
        if tiles < 2 or tiled >= model.untiled_bytes(num_tokens):
            return None
        return split_even(num_tokens, tiles)
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
