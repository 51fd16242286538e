"""Tile policies: from the user's choice to an explicit tile plan.

Forms: a positive int (number of tiles), "arctic" (ceil(tokens / hidden), the paper's rule),
"auto" (a memory-budget rule, below), "target:<GB>" (a memory target, below), or a
tokens-per-tile count.

"target:<GB>" (the memory-target mode of other frameworks' keys): the fewest tiles whose working memory (the tile's
intermediates plus the float32 gradient accumulators, by the memory model) fits <GB> GiB;
untiled when the untiled module's intermediates fit. Tiles are never smaller than one token.
Modules without a fast path have no memory model: their intermediates are taken as those of a
gated MLP with intermediate size 4 x hidden (GENERIC_WIDTH), in the input's dtype.

"auto" for a recognised MLP on the CPU: tiles of about `weight_bytes / (c_t * m * e)` tokens,
i.e. a tile's transient intermediates are about the size of the MLP's weights (c_t (n, m) tensors
of e bytes per token row, see fast.py). It runs untiled unless its memory model predicts that
tiling needs at most half the untiled module's intermediates (short sequences run untiled), so
"auto" never costs memory and costs no recompute where it saves little (tests/ops/tiling/test_policy.py
measures this).

"auto" for a recognised MLP on an accelerator (any device but the CPU) is time-aware: small tiles
lose GEMM efficiency and add a pass over every weight-sized accumulator per tile, while the
memory saving is nearly all captured by a few large tiles. It takes the largest tiles that keep
ACCELERATOR_SAVING of the saving the memory model says tiling can reach (untiled intermediates
minus the accumulators), but never tiles whose working memory exceeds ACCELERATOR_MAX_TILE_BYTES
(at very long sequences the last part of the saving would cost many GiB) and never fewer than
ACCELERATOR_MIN_TILE_TOKENS tokens per tile (the three in ops/mlp/memory_model.py); untiled when that
leaves fewer than two tiles or saves less than ACCELERATOR_MIN_SAVING_BYTES (256 MiB) per call:
a small model's MLP (hidden 512, intermediate 2048, bf16: 352 MiB of untiled intermediates at
16K tokens, of which two tiles would save 178 MiB) runs untiled there, where its tiles would
cost more time than the memory they save is worth (docs/benchmarks.md lists the tiles it picks
for an 8B-shaped MLP, which the floor leaves as they were).

For modules without a fast path "auto" uses the paper's rule beyond two tiles' worth of tokens
and runs untiled below.

A policy is a frozen `TilePolicy`, valid by construction: `TilePolicy.of(num_tiles, tile_tokens)`
is the one place the Python spellings (an int, "auto", "arctic", "target:<GB>", tokens per tile)
are checked; `TilePolicy.budget(gb)` builds the memory target from a number of GiB. Edges that
read text (command lines, config files, other frameworks' keys) normalise it in tiledmlp.config
and build the same objects; ops take a TilePolicy and never re-validate it per call.

Invariant: the resolution depends only on the token count, the module's shapes, dtypes and device
type, and the policy; never on free memory, so every rank with the same inputs gets the same
plan. The planner resolves for an accelerator on fake CPU tensors with `assume_device`
(ops/mlp/memory_model.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from tiledmlp.ops.mlp.memory_model import GENERIC_WIDTH, MemoryModel, assume_device
from tiledmlp.ops.tiling.tiles import TilePlan, arctic_num_tiles, split_by_tile_tokens, split_even
from tiledmlp.ops.tiling.values import check_int, is_int, positive_number

__all__ = ["ACCELERATOR_MIN_SAVING_BYTES", "MemoryModel", "TilePolicy", "assume_device"]

#: "auto" on an accelerator tiles a call only where that saves at least this much (module
#: docstring): below it the saving is small beside any accelerator's memory, while the tiles'
#: fixed costs (launches, accumulator passes, the fused kernels' first use) dominate a small
#: model's step.
ACCELERATOR_MIN_SAVING_BYTES = 256 * 2**20

Rule = Literal["auto", "arctic", "count", "tokens", "target"]
_TARGET = "target:"
_POLICIES = "a positive int, 'auto', 'arctic' or 'target:<GB>'"


@dataclass(frozen=True)
class TilePolicy:
    """How a run of tokens is cut into tiles; valid by construction.

    Build one with `TilePolicy.of(num_tiles, tile_tokens)` (the Python spellings) or
    `TilePolicy.budget(gb)`; the fields are its canonical form.

    Attributes:
        rule: "auto", "arctic", "count" (a number of tiles), "tokens" (tokens per tile) or
            "target" (a memory target, module docstring).
        amount: the number of tiles ("count"), tokens per tile ("tokens") or GiB ("target");
            0 for "auto" and "arctic".
    """

    rule: Rule = "auto"
    amount: float = 0

    def __post_init__(self) -> None:
        if self.rule in ("auto", "arctic"):
            ok = self.amount == 0
        elif self.rule in ("count", "tokens"):
            ok = is_int(self.amount)
        else:
            ok = self.rule == "target" and positive_number(self.amount) is not None
        if not ok:
            raise ValueError(
                f"TilePolicy(rule={self.rule!r}, amount={self.amount!r}): expected rule 'auto' "
                "or 'arctic' with amount 0, 'count' or 'tokens' with a positive int, or "
                "'target' with a positive number of GiB; build it with TilePolicy.of(...)"
            )

    @classmethod
    def of(
        cls,
        num_tiles: int | str | TilePolicy = "auto",
        tile_tokens: int | None = None,
        *,
        name: str = "num_tiles",
    ) -> TilePolicy:
        """The policy of tiled_mlp's (num_tiles, tile_tokens) pair.

        Args:
            num_tiles: a positive int, "auto", "arctic", "target:<GB>" or a TilePolicy.
            tile_tokens: tokens per tile instead of num_tiles (which must stay "auto").
            name: what to call num_tiles in the message of a bad value.

        Raises:
            ValueError: a value of the wrong kind, or both num_tiles and tile_tokens.
        """
        if tile_tokens is not None:
            check_int("tile_tokens", tile_tokens)
            if num_tiles != "auto" and num_tiles != cls():
                raise ValueError(
                    f"give either num_tiles or tile_tokens, not both (got num_tiles="
                    f"{num_tiles!r}, tile_tokens={tile_tokens!r}); leave num_tiles at its "
                    "default 'auto'."
                )
            return cls("tokens", tile_tokens)
        if isinstance(num_tiles, TilePolicy):
            return num_tiles
        if num_tiles == "auto":
            return cls("auto")
        if num_tiles == "arctic":
            return cls("arctic")
        if isinstance(num_tiles, str) and num_tiles.startswith(_TARGET):
            return cls("target", _gib(num_tiles, name))
        if is_int(num_tiles):
            return cls("count", num_tiles)
        raise ValueError(f"{name} must be {_POLICIES}, got {num_tiles!r}")

    @classmethod
    def budget(cls, gb: float) -> TilePolicy:
        """The memory target of `gb` GiB per MLP (a positive number)."""
        return cls("target", gb)

    @property
    def num_tiles(self) -> int | str:
        """The policy as tiled_mlp's num_tiles: an int, "auto", "arctic" or "target:<GB>"
        ("auto" for tokens per tile, which is `tile_tokens`)."""
        if self.rule == "count":
            return int(self.amount)
        if self.rule == "target":
            return f"{_TARGET}{self.amount:g}"
        return "arctic" if self.rule == "arctic" else "auto"

    @property
    def tile_tokens(self) -> int | None:
        """Tokens per tile, or None for the other rules."""
        return int(self.amount) if self.rule == "tokens" else None

    @property
    def target_bytes(self) -> float | None:
        """The byte budget of a memory target, or None for the other rules."""
        return self.amount * 2**30 if self.rule == "target" else None

    def for_loss(self) -> TilePolicy:
        """The tiled loss's policy: the same number of tiles, else "auto" (the MLP-only rules
        "arctic", "target:<GB>" and tokens per tile have no meaning for the LM head)."""
        return self if self.rule == "count" else TilePolicy()

    def resolve(
        self,
        num_tokens: int,
        hidden_size: int,
        model: MemoryModel | None,
        element_size: int = 4,
    ) -> TilePlan | None:
        """The tile plan for a call, or None to run the module untiled ("auto" and "target").

        Args:
            num_tokens: flattened tokens of the input.
            hidden_size: last dim of the input.
            model: memory model of a recognised MLP, or None for the generic path.
            element_size: bytes per element of the input (the generic path's "target").
        """
        if self.rule == "target":
            budget = self.amount * 2**30
            return _target_plan(budget, num_tokens, hidden_size, model, element_size)
        if self.rule == "tokens":
            return split_by_tile_tokens(num_tokens, int(self.amount))
        if self.rule == "count":
            return split_even(num_tokens, int(self.amount))
        if self.rule == "arctic":
            return split_even(num_tokens, arctic_num_tiles(num_tokens, hidden_size))
        return _auto_plan(num_tokens, hidden_size, model)

    def __str__(self) -> str:
        if self.rule == "tokens":
            return f"tile_tokens={int(self.amount)}"
        return str(self.num_tiles)


def _gib(text: str, name: str) -> float:
    """The GiB of a "target:<GB>" string."""
    try:
        gb = float(text[len(_TARGET) :])
    except ValueError:
        gb = -1.0
    if not math.isfinite(gb) or gb <= 0:
        raise ValueError(
            f"{name} {text!r}: expected 'target:<GB>' with a positive number of GiB, "
            "e.g. 'target:2' or 'target:0.5'"
        )
    return gb


def _auto_plan(num_tokens: int, hidden_size: int, model: MemoryModel | None) -> TilePlan | None:
    """The "auto" rule (module docstring): CPU, accelerator, or without a memory model."""
    if model is None:
        if num_tokens < 2 * hidden_size:
            return None
        return split_even(num_tokens, arctic_num_tiles(num_tokens, hidden_size))
    if model.on_accelerator:
        tiles = math.ceil(num_tokens / model.accelerator_tile_tokens(num_tokens))
        tiled = model.tiled_bytes(math.ceil(num_tokens / max(tiles, 1)))
        if tiles < 2 or model.untiled_bytes(num_tokens) - tiled < ACCELERATOR_MIN_SAVING_BYTES:
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
